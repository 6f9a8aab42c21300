//! `/v1/nvmf`: NVMe/TCP subsystems, namespaces, hosts and controllers.

use std::sync::Arc;

use tessera_api::{AddHost, AddNamespace, CreateSubsystem, Deleted, PatchSubsystem};
use tessera_http::{Request, Response};

use super::{body, no_route, reply};
use crate::error::Error;
use crate::node::Node;

/// `rest`: the path after `/v1/nvmf`.
pub fn handle(node: &Arc<Node>, req: &Request, rest: &[&str]) -> Response {
    match (req.method.as_str(), rest) {
        ("GET", ["subsystems"]) => Response::json(200, &node.nvmf_list()),
        ("GET", ["controllers"]) => Response::json(200, &node.nvmf_controllers()),
        ("GET", ["subsystems", nqn]) => reply(node.nvmf_get(nqn), 200),
        ("POST", ["subsystems"]) => {
            match body::<CreateSubsystem>(req, "subsystem", "nqn, allow_any_host, hosts") {
                Ok(b) => reply(
                    node.nvmf_add_subsystem(&b.nqn, b.allow_any_host, &b.hosts.unwrap_or_default()),
                    201,
                ),
                Err(r) => r,
            }
        }
        ("PATCH", ["subsystems", nqn]) => match req.body_as::<PatchSubsystem>() {
            Ok(b) => reply(
                node.nvmf_set_hosts(nqn, None, None, Some(b.allow_any_host)),
                200,
            ),
            Err(_) => Response::error(400, "PATCH takes {\"allow_any_host\": true|false}"),
        },
        ("DELETE", ["subsystems", nqn]) => reply(
            node.nvmf_remove_subsystem(nqn).map(|()| Deleted {
                deleted: nqn.to_string(),
            }),
            200,
        ),
        ("POST", ["subsystems", nqn, "namespaces"]) => {
            match body::<AddNamespace>(req, "namespace", "volume, nsid") {
                Ok(b) => reply(
                    u32::try_from(b.nsid)
                        .map_err(|_| Error::invalid("nsid is too large"))
                        .and_then(|id| Ok(node.nvmf_add_namespace(nqn, &b.volume, id)?)),
                    201,
                ),
                Err(r) => r,
            }
        }
        ("DELETE", ["subsystems", nqn, "namespaces", nsid]) => match nsid.parse::<u32>() {
            Ok(id) => reply(
                node.nvmf_remove_namespace(nqn, id)
                    .map(|()| Deleted { deleted: id }),
                200,
            ),
            Err(_) => Response::error(400, "the namespace ID must be a number"),
        },
        ("POST", ["subsystems", nqn, "hosts"]) => match body::<AddHost>(
            req,
            "host",
            "nqn, dhchap_secret, dhchap_ctrl_secret, dhchap_hash, dhchap_dhgroup",
        ) {
            Ok(b) => reply(add_host(node, nqn, &b), 201),
            Err(r) => r,
        },
        ("DELETE", ["subsystems", nqn, "hosts", host]) => {
            reply(node.nvmf_set_hosts(nqn, None, Some(host), None), 200)
        }
        _ => no_route(req),
    }
}

fn add_host(node: &Node, nqn: &str, b: &AddHost) -> Result<tessera_api::SubsystemInfo, Error> {
    let auth = match &b.dhchap_secret {
        Some(s) => Some(crate::nvmf::HostAuthRecord::new(
            s,
            b.dhchap_ctrl_secret.as_deref(),
            b.dhchap_hash.as_deref(),
            b.dhchap_dhgroup.as_deref(),
        )?),
        None if b.dhchap_ctrl_secret.is_some()
            || b.dhchap_hash.is_some()
            || b.dhchap_dhgroup.is_some() =>
        {
            return Err(Error::invalid(
                "dhchap_ctrl_secret, dhchap_hash and dhchap_dhgroup need dhchap_secret",
            ))
        }
        None => None,
    };
    Ok(node.nvmf_add_host(nqn, &b.nqn, auth)?)
}
