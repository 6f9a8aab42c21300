//! `/v1/nvmf/...`: NVMe/TCP subsystems, namespaces, hosts and controllers (docs/api.md).

use std::sync::Arc;

use serde_json::{json, Value};
use tessera_http::{Request, Response};
use tessera_pool::Error;

use crate::api::{reply, str_field};
use crate::node::Node;

fn strings(body: &Value, name: &str) -> Result<Vec<String>, Error> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Error::invalid(format!("field '{name}' must list strings")))
            })
            .collect(),
        Some(_) => Err(Error::invalid(format!(
            "field '{name}' must be a list of strings"
        ))),
    }
}

fn flag(body: &Value, name: &str) -> Option<bool> {
    body.get(name).and_then(Value::as_bool)
}

/// `parts` is the path after `/v1/nvmf`.
pub fn handle(node: &Arc<Node>, req: &Request, body: &Value, parts: &[&str]) -> Response {
    match (req.method.as_str(), parts) {
        ("GET", ["subsystems"]) => Response::json(200, &node.nvmf_list()),
        ("GET", ["controllers"]) => Response::json(200, &node.nvmf_controllers()),
        ("GET", ["subsystems", nqn]) => reply(node.nvmf_get(nqn), 200),
        ("POST", ["subsystems"]) => reply(
            (|| {
                node.nvmf_add_subsystem(
                    &str_field(body, "nqn")?,
                    flag(body, "allow_any_host").unwrap_or(false),
                    &strings(body, "hosts")?,
                )
            })(),
            201,
        ),
        ("PATCH", ["subsystems", nqn]) => match flag(body, "allow_any_host") {
            Some(a) => reply(node.nvmf_set_hosts(nqn, None, None, Some(a)), 200),
            None => Response::error(400, "PATCH takes {\"allow_any_host\": true|false}"),
        },
        ("DELETE", ["subsystems", nqn]) => reply(
            node.nvmf_remove_subsystem(nqn)
                .map(|_| json!({"deleted": nqn})),
            200,
        ),
        ("POST", ["subsystems", nqn, "namespaces"]) => reply(
            (|| {
                let nsid = body.get("nsid").and_then(Value::as_u64).unwrap_or(0);
                let nsid = u32::try_from(nsid).map_err(|_| Error::invalid("nsid is too large"))?;
                node.nvmf_add_namespace(nqn, &str_field(body, "volume")?, nsid)
            })(),
            201,
        ),
        ("DELETE", ["subsystems", nqn, "namespaces", nsid]) => match nsid.parse::<u32>() {
            Ok(id) => reply(
                node.nvmf_remove_namespace(nqn, id)
                    .map(|_| json!({"deleted": id})),
                200,
            ),
            Err(_) => Response::error(400, "the namespace ID must be a number"),
        },
        ("POST", ["subsystems", nqn, "hosts"]) => reply(
            (|| node.nvmf_set_hosts(nqn, Some(&str_field(body, "nqn")?), None, None))(),
            201,
        ),
        ("DELETE", ["subsystems", nqn, "hosts", host]) => {
            reply(node.nvmf_set_hosts(nqn, None, Some(host), None), 200)
        }
        _ => Response::error(
            404,
            &format!("no such API route: {} {}", req.method, req.path),
        ),
    }
}
