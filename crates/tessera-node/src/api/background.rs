//! `/v1/background`: the background classes' limits (scrub, rebuild, resync).

use std::sync::Arc;

use tessera_api::BackgroundLimits;
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::node::Node;

/// `rest`: the path after `/v1/background`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", []) => Response::json(200, &node.background.list()),
        ("PUT", [class]) => {
            match body::<BackgroundLimits>(
                req,
                "background limits",
                "bps, latency_target_us, min_pct",
            ) {
                Ok(l) => reply(node.background.put(class, Some(l)), 200),
                Err(r) => r,
            }
        }
        ("DELETE", [class]) => reply(node.background.put(class, None), 200),
        _ => no_route(req),
    }
}
