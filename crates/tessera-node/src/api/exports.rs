//! `/v1/exports`: NBD exports.

use std::sync::Arc;

use tessera_api::{CreateExport, Deleted};
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::node::Node;

/// `rest`: the path after `/v1/exports`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", []) => Response::json(200, &node.list_exports()),
        ("POST", []) => match body::<CreateExport>(req, "export", "name, volume, read_only, tls") {
            Ok(b) => reply(node.add_export(&b.name, &b.volume, b.read_only, b.tls), 201),
            Err(r) => r,
        },
        ("DELETE", [name]) => reply(
            node.remove_export(name).map(|()| Deleted {
                deleted: name.to_string(),
            }),
            200,
        ),
        _ => no_route(req),
    }
}
