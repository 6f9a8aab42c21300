//! `/v1/groups`: QoS groups (tenants) and their members.

use std::sync::Arc;

use tessera_api::{Deleted, PutGroup};
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::node::Node;

const FIELDS: &str = "limits {iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms}, step {step_pct, max_steps, step_ms, credit_ms}";

/// `rest`: the path after `/v1/groups`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", []) => Response::json(200, &node.groups.list()),
        ("GET", [name]) => reply(node.groups.get(name), 200),
        ("PUT", [name]) => match body::<PutGroup>(req, "group", FIELDS) {
            Ok(b) => reply(node.put_group(name, b.limits, b.step), 200),
            Err(r) => r,
        },
        ("DELETE", [name]) => reply(
            node.delete_group(name).map(|()| Deleted {
                deleted: name.to_string(),
            }),
            200,
        ),
        ("PUT", [name, "members", vol]) => reply(node.add_group_member(name, vol), 200),
        ("DELETE", [name, "members", vol]) => reply(node.remove_group_member(name, vol), 200),
        _ => no_route(req),
    }
}
