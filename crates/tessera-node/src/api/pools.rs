//! `/v1/pools`: pools, their rebuild, scrub and resync jobs, device replacement and
//! hot spares.

use std::sync::Arc;

use tessera_api::{
    CreatePool, Deleted, RebuildRequest, ReplaceRequest, ScrubRequest, SpareRequest, UpdatePool,
};
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::node::Node;

/// `rest`: the path after `/v1/pools`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", []) => Response::json(200, &node.list_pools()),
        ("POST", []) => create(node, req),
        ("GET", [name]) => reply(node.pool_detail(name), 200),
        ("PATCH", [name]) => match body::<UpdatePool>(req, "pool update", "overcommit") {
            Ok(b) => reply(node.update_pool(name, &b), 200),
            Err(r) => r,
        },
        ("DELETE", [name]) => reply(
            node.destroy_pool(name).map(|()| Deleted {
                deleted: name.to_string(),
            }),
            200,
        ),
        ("GET", [name, "rebuild"]) => reply(node.rebuild_status(name), 200),
        ("POST", [name, "rebuild"]) => {
            match body::<RebuildRequest>(req, "rebuild", "device, force") {
                Ok(b) => reply(node.start_rebuild(name, b.device, b.force), 202),
                Err(r) => r,
            }
        }
        ("DELETE", [name, "rebuild"]) => reply(node.stop_rebuild(name), 200),
        ("POST", [name, "replace"]) => match req.body_as::<ReplaceRequest>() {
            Ok(b) => reply(node.replace_device(name, b.device, &b.with, b.force), 200),
            Err(_) => Response::error(
                400,
                "replace needs {\"device\": index, \"with\": \"device spec\"}",
            ),
        },
        ("GET", [name, "spares"]) => reply(node.list_spares(name), 200),
        ("POST", [name, "spares"]) => match req.body_as::<SpareRequest>() {
            Ok(b) => reply(node.add_spare(name, &b.device, b.force), 201),
            Err(_) => Response::error(400, "adding a spare needs {\"device\": \"device spec\"}"),
        },
        // The spec may hold slashes: it comes in the body (or ?device=).
        ("DELETE", [name, "spares"]) => {
            let from_body = req.body_as::<SpareRequest>().ok().map(|b| b.device);
            match from_body.or_else(|| req.query_param("device").map(str::to_string)) {
                Some(d) => reply(node.remove_spare(name, &d), 200),
                None => {
                    Response::error(400, "removing a spare needs {\"device\": \"device spec\"}")
                }
            }
        }
        ("GET", [name, "scrub"]) => reply(node.scrub_status(name), 200),
        ("POST", [name, "scrub"]) => match req.body_as::<ScrubRequest>() {
            Ok(b) => reply(node.start_scrub(name, b.repair), 202),
            Err(_) => Response::error(400, "field 'repair' must be true or false"),
        },
        ("DELETE", [name, "scrub"]) => reply(node.stop_scrub(name), 200),
        ("GET", [name, "resync"]) => reply(node.resync_status(name), 200),
        _ => no_route(req),
    }
}

fn create(node: &Node, req: &Request) -> Response {
    let b: CreatePool = match body(
        req,
        "pool",
        "name, devices, layout, copies, stripe_size, unit_size, force, overcommit",
    ) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let mut layout = b.layout.unwrap_or_else(|| "concat".into());
    if let Some(c) = b.copies {
        layout = format!("{layout}:{c}");
    }
    // A bad ratio is refused before anything is created; a good one is set on the new
    // (empty) pool as `PATCH` would.
    if let Some(Err(e)) = b.overcommit.map(tessera_pool::validate_overcommit) {
        return reply::<(), _>(Err(e), 201);
    }
    let created = node
        .create_pool(
            &b.name,
            &b.devices,
            &layout,
            b.stripe_size.map(|s| s.as_text()).as_deref(),
            b.unit_size.map(|s| s.as_text()).as_deref(),
            b.force,
        )
        .and_then(|info| match b.overcommit {
            Some(r) => node.update_pool(
                &info.name,
                &UpdatePool {
                    overcommit: Some(r),
                },
            ),
            None => Ok(info),
        });
    reply(created, 201)
}
