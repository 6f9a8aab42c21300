//! The management API: HTTP/JSON routes over [`Node`]. Documented in docs/api.md.

use std::sync::Arc;

use serde_json::{json, Value};
use tessera_http::{Request, Response};
use tessera_pool::{Error, ErrorKind};

use crate::node::Node;

fn status_of(e: &Error) -> u16 {
    match e.kind {
        ErrorKind::NotFound => 404,
        ErrorKind::AlreadyExists | ErrorKind::Busy => 409,
        ErrorKind::InvalidInput => 400,
        ErrorKind::NoSpace => 507,
        ErrorKind::Corrupt | ErrorKind::Io => 500,
    }
}

pub(crate) fn reply(r: Result<Value, Error>, ok: u16) -> Response {
    match r {
        Ok(v) => Response::json(ok, &v),
        Err(e) => Response::error(status_of(&e), &e.message),
    }
}

fn field<'a>(body: &'a Value, name: &str) -> Result<&'a Value, Error> {
    body.get(name)
        .ok_or_else(|| Error::invalid(format!("missing field '{name}'")))
}

pub(crate) fn str_field(body: &Value, name: &str) -> Result<String, Error> {
    field(body, name)?
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| Error::invalid(format!("field '{name}' must be a string")))
}

/// Sizes may be given as a number of bytes or as a string like "4G".
fn size_field(body: &Value, name: &str) -> Result<u64, Error> {
    match field(body, name)? {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| Error::invalid(format!("field '{name}' must be a positive integer"))),
        Value::String(s) => {
            tessera_device::parse_size(s).map_err(|e| Error::invalid(e.to_string()))
        }
        _ => Err(Error::invalid(format!(
            "field '{name}' must be a number of bytes or a size like \"4G\""
        ))),
    }
}

fn opt_str(body: &Value, name: &str) -> Option<String> {
    match body.get(name) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        _ => None,
    }
}

pub fn handle(node: &Arc<Node>, req: &Request) -> Response {
    let body = match req.method.as_str() {
        "POST" | "PATCH" | "PUT" => match req.json_body() {
            Ok(v) => v,
            Err(e) => return Response::error(400, &format!("request body is not valid JSON: {e}")),
        },
        _ => Value::Null,
    };
    let parts: Vec<&str> = req.path.trim_matches('/').split('/').collect();
    match (req.method.as_str(), parts.as_slice()) {
        ("GET", ["v1", "status"]) => Response::json(200, &node.status()),
        ("GET", ["v1", "pools"]) => Response::json(200, &node.list_pools()),
        ("GET", ["v1", "pools", name]) => {
            reply(
                node.pool(name).map(|p| {
                    let mut v = node.pool_value(&p);
                    if let Ok(r) = node.rebuild_status(name) {
                        v["rebuild"] = r;
                    }
                    if let Ok(r) = node.resync_status(name) {
                        v["resync"] = r;
                    }
                    v
                }),
                200,
            )
        }
        ("POST", ["v1", "pools"]) => reply(
            (|| {
                let name = str_field(&body, "name")?;
                let devices: Vec<String> = field(&body, "devices")?
                    .as_array()
                    .ok_or_else(|| {
                        Error::invalid("field 'devices' must be a list of device specs")
                    })?
                    .iter()
                    .map(|d| {
                        d.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| Error::invalid("device specs must be strings"))
                    })
                    .collect::<Result<_, _>>()?;
                let mut layout = opt_str(&body, "layout").unwrap_or_else(|| "concat".into());
                if let Some(c) = body.get("copies").and_then(Value::as_u64) {
                    layout = format!("{layout}:{c}");
                }
                let force = body.get("force").and_then(Value::as_bool).unwrap_or(false);
                node.create_pool(
                    &name,
                    &devices,
                    &layout,
                    opt_str(&body, "stripe_size").as_deref(),
                    opt_str(&body, "unit_size").as_deref(),
                    force,
                )
            })(),
            201,
        ),
        ("DELETE", ["v1", "pools", name]) => reply(
            node.destroy_pool(name).map(|_| json!({"deleted": name})),
            200,
        ),
        ("GET", ["v1", "volumes"]) => Response::json(200, &node.list_volumes()),
        ("GET", ["v1", "volumes", name]) => reply(
            node.find_volume(name)
                .map(|(p, v)| node.volume_json(&p, &v)),
            200,
        ),
        ("GET", ["v1", "volumes", name, "qos"]) => reply(
            node.find_volume(name).map(|(_, v)| serde_json::to_value(node.groups.volume_qos(&v).limits()).unwrap_or(Value::Null)),
            200,
        ),
        ("PUT", ["v1", "volumes", name, "qos"]) => match serde_json::from_value::<tessera_qos::QosLimits>(body.clone()) {
            Ok(l) => reply(node.set_volume_qos(name, l), 200),
            Err(e) => Response::error(400, &format!("bad QoS limits: {e} (fields: iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms, weight, reads_first)")),
        },
        ("DELETE", ["v1", "volumes", name, "qos"]) => reply(node.set_volume_qos(name, Default::default()), 200),
        ("GET", ["v1", "pools", name, "rebuild"]) => reply(node.rebuild_status(name), 200),
        ("POST", ["v1", "pools", name, "rebuild"]) => reply(
            node.start_rebuild(
                name,
                body.get("device").and_then(Value::as_u64).map(|d| d as usize),
                body.get("force").and_then(Value::as_bool).unwrap_or(false),
            ),
            202,
        ),
        ("POST", ["v1", "pools", name, "replace"]) => match (
            body.get("device").and_then(Value::as_u64),
            body.get("with").and_then(Value::as_str),
        ) {
            (Some(d), Some(w)) => reply(node.replace_device(name, d as usize, w), 200),
            _ => Response::error(400, "replace needs {\"device\": index, \"with\": \"device spec\"}"),
        },
        ("DELETE", ["v1", "pools", name, "rebuild"]) => reply(node.stop_rebuild(name), 200),
        ("GET", ["v1", "pools", name, "spares"]) => reply(node.list_spares(name), 200),
        ("POST", ["v1", "pools", name, "spares"]) => match body.get("device").and_then(Value::as_str) {
            Some(d) => reply(node.add_spare(name, d), 201),
            None => Response::error(400, "adding a spare needs {\"device\": \"device spec\"}"),
        },
        // The spec may hold slashes: it comes in the body (or ?device=).
        ("DELETE", ["v1", "pools", name, "spares"]) => {
            let from_body = req.json_body().ok().and_then(|b| b.get("device").and_then(Value::as_str).map(str::to_string));
            match from_body.or_else(|| req.query_param("device").map(str::to_string)) {
                Some(d) => reply(node.remove_spare(name, &d), 200),
                None => Response::error(400, "removing a spare needs {\"device\": \"device spec\"}"),
            }
        }
        ("GET", ["v1", "pools", name, "scrub"]) => reply(node.scrub_status(name), 200),
        ("POST", ["v1", "pools", name, "scrub"]) => match body.get("repair") {
            None | Some(Value::Bool(_)) => reply(
                node.start_scrub(name, body.get("repair").and_then(Value::as_bool).unwrap_or(true)),
                202,
            ),
            Some(_) => Response::error(400, "field 'repair' must be true or false"),
        },
        ("GET", ["v1", "pools", name, "resync"]) => reply(node.resync_status(name), 200),
        ("DELETE", ["v1", "pools", name, "scrub"]) => reply(node.stop_scrub(name), 200),
        ("GET", ["v1", "background"]) => Response::json(200, &node.background.list()),
        ("PUT", ["v1", "background", class]) => match serde_json::from_value::<tessera_qos::BackgroundLimits>(body.clone()) {
            Ok(l) => reply(node.background.put(class, Some(l)), 200),
            Err(e) => Response::error(400, &format!("bad background limits: {e} (fields: bps, latency_target_us, min_pct)")),
        },
        ("DELETE", ["v1", "background", class]) => reply(node.background.put(class, None), 200),
        ("GET", ["v1", "groups"]) => Response::json(200, &node.groups.list()),
        ("GET", ["v1", "groups", name]) => reply(node.groups.get(name), 200),
        ("PUT", ["v1", "groups", name]) => {
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Body {
                #[serde(default)]
                limits: tessera_qos::QosLimits,
                #[serde(default)]
                step: Option<tessera_qos::StepBurst>,
            }
            match serde_json::from_value::<Body>(body.clone()) {
                Ok(b) => reply(node.put_group(name, b.limits, b.step), 200),
                Err(e) => Response::error(400, &format!("bad group: {e} (fields: limits {{iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms}}, step {{step_pct, max_steps, step_ms, credit_ms}})")),
            }
        }
        ("DELETE", ["v1", "groups", name]) => reply(node.delete_group(name).map(|_| json!({"deleted": name})), 200),
        ("PUT", ["v1", "groups", name, "members", vol]) => reply(node.add_group_member(name, vol), 200),
        ("DELETE", ["v1", "groups", name, "members", vol]) => reply(node.remove_group_member(name, vol), 200),
        ("GET", ["v1", "volumes", name, "stats"]) => {
            let ms = match req.query_param("interval_ms").map(str::parse::<u64>) {
                None => 1000,
                Some(Ok(ms)) if (1..=60_000).contains(&ms) => ms,
                Some(_) => return Response::error(400, "interval_ms must be between 1 and 60000"),
            };
            reply(
                node.volume_stats(name, std::time::Duration::from_millis(ms)),
                200,
            )
        }
        ("POST", ["v1", "volumes"]) => reply(
            (|| {
                node.create_volume(
                    &str_field(&body, "name")?,
                    &str_field(&body, "pool")?,
                    size_field(&body, "size")?,
                )
            })(),
            201,
        ),
        ("PATCH", ["v1", "volumes", name]) => reply(
            (|| node.resize_volume(name, size_field(&body, "size")?))(),
            200,
        ),
        ("DELETE", ["v1", "volumes", name]) => reply(
            node.delete_volume(name).map(|_| json!({"deleted": name})),
            200,
        ),
        ("GET", ["v1", "exports"]) => Response::json(200, &node.list_exports()),
        ("POST", ["v1", "exports"]) => reply(
            (|| {
                let ro = body
                    .get("read_only")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                node.add_export(&str_field(&body, "name")?, &str_field(&body, "volume")?, ro)
            })(),
            201,
        ),
        ("DELETE", ["v1", "exports", name]) => reply(
            node.remove_export(name).map(|_| json!({"deleted": name})),
            200,
        ),
        (_, ["v1", "nvmf", ..]) => crate::nvmf_api::handle(node, req, &body, &parts[2..]),
        (_, ["v1", ..]) => Response::error(
            404,
            &format!("no such API route: {} {}", req.method, req.path),
        ),
        _ => Response::error(404, "the Tessera API lives under /v1/"),
    }
}
