//! `/v1/nvmf`: NVMe/TCP subsystems, namespaces, hosts and controllers.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{delete, get, post, put};
use axum::Router;
use tessera_api::{
    AddHost, AddNamespace, ClusterPathInfo, ControllerInfo, CreateSubsystem, Deleted, ErrorReply,
    PatchSubsystem, PutClusterPath, SubsystemInfo,
};
use tessera_http::Response;

use super::{body, parse_body, reply, with_node, NodeState};
use crate::error::Error;
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/nvmf/subsystems", get(subsystems).post(create))
        .route("/v1/nvmf/controllers", get(controllers))
        .route(
            "/v1/nvmf/subsystems/{nqn}",
            get(subsystem).patch(patch).delete(remove),
        )
        .route("/v1/nvmf/subsystems/{nqn}/namespaces", post(namespace_add))
        .route(
            "/v1/nvmf/subsystems/{nqn}/namespaces/{nsid}",
            delete(namespace_remove),
        )
        .route("/v1/nvmf/subsystems/{nqn}/hosts", post(host_add))
        .route(
            "/v1/nvmf/subsystems/{nqn}/hosts/{host}",
            delete(host_remove),
        )
        .route("/v1/nvmf/cluster-paths", get(cluster_paths))
        .route(
            "/v1/nvmf/cluster-paths/{volume}",
            put(cluster_path_put).delete(cluster_path_remove),
        )
}

fn cluster_path_info(node: &Node, volume: &str) -> Option<ClusterPathInfo> {
    let (volume, owner, size) = node
        .cluster_paths()
        .into_iter()
        .find(|(v, _, _)| v == volume)?;
    let nqn = crate::nvmf::cluster_nqn(&volume);
    let ana_state = node
        .nvmf
        .target()
        .map(|t| t.ana_group(&nqn, 1).state(owner).name().to_string())
        .unwrap_or_default();
    Some(ClusterPathInfo {
        volume,
        nqn,
        owner,
        size,
        ana_state,
    })
}

#[utoipa::path(get, path = "/v1/nvmf/cluster-paths", tag = "nvmf",
    responses((status = 200, body = Vec<ClusterPathInfo>)))]
pub async fn cluster_paths(State(node): NodeState) -> Response {
    with_node(node, |n| {
        let all: Vec<ClusterPathInfo> = n
            .cluster_paths()
            .iter()
            .filter_map(|(v, _, _)| cluster_path_info(n, v))
            .collect();
        Response::json(200, &all)
    })
    .await
}

#[utoipa::path(put, path = "/v1/nvmf/cluster-paths/{volume}", tag = "nvmf",
    params(("volume" = String, Path)), request_body = PutClusterPath,
    responses((status = 200, body = ClusterPathInfo), (status = "4XX", body = ErrorReply)))]
pub async fn cluster_path_put(
    State(node): NodeState,
    Path(volume): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<PutClusterPath>(&bytes, "cluster path", "owner, size, other_paths") {
        Ok(b) => with_node(node, move |n| reply(put_cluster_path(n, &volume, &b), 200)).await,
        Err(r) => r,
    }
}

fn put_cluster_path(
    node: &Node,
    volume: &str,
    b: &PutClusterPath,
) -> Result<ClusterPathInfo, Error> {
    let path = match (b.owner, b.size) {
        (true, _) => crate::node::ClusterPath::Owner,
        (false, Some(size)) => crate::node::ClusterPath::Standby { size },
        (false, None) => {
            return Err(Error::invalid(
                "a path that is not the owner needs the volume's size",
            ))
        }
    };
    if let Some(p) = &b.other_paths {
        node.set_discovery_paths(volume, p)?;
    }
    node.export_cluster_path(volume, path)?;
    cluster_path_info(node, volume)
        .ok_or_else(|| Error::invalid(format!("cluster path '{volume}' vanished")))
}

#[utoipa::path(delete, path = "/v1/nvmf/cluster-paths/{volume}", tag = "nvmf",
    params(("volume" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn cluster_path_remove(State(node): NodeState, Path(volume): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.remove_cluster_path(&volume).map(|()| Deleted {
                deleted: volume.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(get, path = "/v1/nvmf/subsystems", tag = "nvmf",
    responses((status = 200, body = Vec<SubsystemInfo>)))]
pub async fn subsystems(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.nvmf_list())).await
}

#[utoipa::path(get, path = "/v1/nvmf/controllers", tag = "nvmf",
    responses((status = 200, body = Vec<ControllerInfo>)))]
pub async fn controllers(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.nvmf_controllers())).await
}

#[utoipa::path(get, path = "/v1/nvmf/subsystems/{nqn}", tag = "nvmf",
    params(("nqn" = String, Path)),
    responses((status = 200, body = SubsystemInfo), (status = 404, body = ErrorReply)))]
pub async fn subsystem(State(node): NodeState, Path(nqn): Path<String>) -> Response {
    with_node(node, move |n| reply(n.nvmf_get(&nqn), 200)).await
}

#[utoipa::path(post, path = "/v1/nvmf/subsystems", tag = "nvmf", request_body = CreateSubsystem,
    responses((status = 201, body = SubsystemInfo), (status = "4XX", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateSubsystem>(&bytes, "subsystem", "nqn, allow_any_host, hosts") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(
                    n.nvmf_add_subsystem(&b.nqn, b.allow_any_host, &b.hosts.unwrap_or_default()),
                    201,
                )
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(patch, path = "/v1/nvmf/subsystems/{nqn}", tag = "nvmf",
    params(("nqn" = String, Path)), request_body = PatchSubsystem,
    responses((status = 200, body = SubsystemInfo), (status = "4XX", body = ErrorReply)))]
pub async fn patch(State(node): NodeState, Path(nqn): Path<String>, bytes: Bytes) -> Response {
    match parse_body::<PatchSubsystem>(&bytes) {
        Ok(b) => {
            with_node(node, move |n| {
                reply(
                    n.nvmf_set_hosts(&nqn, None, None, Some(b.allow_any_host)),
                    200,
                )
            })
            .await
        }
        Err(_) => Response::error(400, "PATCH takes {\"allow_any_host\": true|false}"),
    }
}

#[utoipa::path(delete, path = "/v1/nvmf/subsystems/{nqn}", tag = "nvmf",
    params(("nqn" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn remove(State(node): NodeState, Path(nqn): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.nvmf_remove_subsystem(&nqn).map(|()| Deleted {
                deleted: nqn.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/nvmf/subsystems/{nqn}/namespaces", tag = "nvmf",
    params(("nqn" = String, Path)), request_body = AddNamespace,
    responses((status = 201, body = SubsystemInfo), (status = "4XX", body = ErrorReply)))]
pub async fn namespace_add(
    State(node): NodeState,
    Path(nqn): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<AddNamespace>(&bytes, "namespace", "volume, nsid") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(
                    u32::try_from(b.nsid)
                        .map_err(|_| Error::invalid("nsid is too large"))
                        .and_then(|id| n.nvmf_add_namespace(&nqn, &b.volume, id)),
                    201,
                )
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/nvmf/subsystems/{nqn}/namespaces/{nsid}", tag = "nvmf",
    params(("nqn" = String, Path), ("nsid" = u32, Path)),
    responses((status = 200, body = Deleted<u32>), (status = "4XX", body = ErrorReply)))]
pub async fn namespace_remove(
    State(node): NodeState,
    Path((nqn, nsid)): Path<(String, String)>,
) -> Response {
    match nsid.parse::<u32>() {
        Ok(id) => {
            with_node(node, move |n| {
                reply(
                    n.nvmf_remove_namespace(&nqn, id)
                        .map(|()| Deleted { deleted: id }),
                    200,
                )
            })
            .await
        }
        Err(_) => Response::error(400, "the namespace ID must be a number"),
    }
}

#[utoipa::path(post, path = "/v1/nvmf/subsystems/{nqn}/hosts", tag = "nvmf",
    params(("nqn" = String, Path)), request_body = AddHost,
    responses((status = 201, body = SubsystemInfo), (status = "4XX", body = ErrorReply)))]
pub async fn host_add(State(node): NodeState, Path(nqn): Path<String>, bytes: Bytes) -> Response {
    match body::<AddHost>(
        &bytes,
        "host",
        "nqn, dhchap_secret, dhchap_ctrl_secret, dhchap_hash, dhchap_dhgroup",
    ) {
        Ok(b) => with_node(node, move |n| reply(add_host(n, &nqn, &b), 201)).await,
        Err(r) => r,
    }
}

/// Allow host `b.nqn` on subsystem `nqn`, with its DH-HMAC-CHAP secrets when given.
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
    node.nvmf_add_host(nqn, &b.nqn, auth)
}

#[utoipa::path(delete, path = "/v1/nvmf/subsystems/{nqn}/hosts/{host}", tag = "nvmf",
    params(("nqn" = String, Path), ("host" = String, Path)),
    responses((status = 200, body = SubsystemInfo), (status = "4XX", body = ErrorReply)))]
pub async fn host_remove(
    State(node): NodeState,
    Path((nqn, host)): Path<(String, String)>,
) -> Response {
    with_node(node, move |n| {
        reply(n.nvmf_set_hosts(&nqn, None, Some(&host), None), 200)
    })
    .await
}
