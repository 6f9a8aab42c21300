//! `/v1/volumes`: thin volumes, their QoS limits and their I/O statistics.

use std::sync::Arc;
use std::time::Duration;

use tessera_api::{CreateVolume, Deleted, QosLimits, ResizeVolume, SizeArg};
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::error::Error;
use crate::node::Node;

const QOS_FIELDS: &str = "iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms, weight, reads_first";

fn size(s: &SizeArg) -> Result<u64, Error> {
    match s {
        SizeArg::Bytes(n) => Ok(*n),
        SizeArg::Text(t) => {
            tessera_device::parse_size(t).map_err(|e| Error::invalid(e.to_string()))
        }
    }
}

/// `rest`: the path after `/v1/volumes`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", []) => Response::json(200, &node.list_volumes()),
        ("POST", []) => match body::<CreateVolume>(req, "volume", "name, pool, size, force") {
            Ok(b) => reply(
                size(&b.size).and_then(|s| node.create_volume(&b.name, &b.pool, s, b.force)),
                201,
            ),
            Err(r) => r,
        },
        ("GET", [name]) => reply(node.volume(name), 200),
        ("PATCH", [name]) => match body::<ResizeVolume>(req, "resize", "size, force") {
            Ok(b) => reply(
                size(&b.size).and_then(|s| node.resize_volume(name, s, b.force)),
                200,
            ),
            Err(r) => r,
        },
        ("DELETE", [name]) => reply(
            node.delete_volume(name).map(|()| Deleted {
                deleted: name.to_string(),
            }),
            200,
        ),
        ("GET", [name, "qos"]) => reply(node.volume_qos(name), 200),
        ("PUT", [name, "qos"]) => match body::<QosLimits>(req, "QoS limits", QOS_FIELDS) {
            Ok(l) => reply(node.set_volume_qos(name, l), 200),
            Err(r) => r,
        },
        ("DELETE", [name, "qos"]) => reply(node.set_volume_qos(name, QosLimits::default()), 200),
        ("GET", [name, "stats"]) => {
            let ms = match req.query_param("interval_ms").map(str::parse::<u64>) {
                None => 1000,
                Some(Ok(ms)) if (1..=60_000).contains(&ms) => ms,
                Some(_) => return Response::error(400, "interval_ms must be between 1 and 60000"),
            };
            reply(node.volume_stats(name, Duration::from_millis(ms)), 200)
        }
        _ => no_route(req),
    }
}
