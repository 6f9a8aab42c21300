//! `/v1/cluster`: the cluster this node is a member of (issue 13).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::Router;
use tessera_api::{ClaimReplica, ClusterStatus, ErrorReply, ReplicaFence};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/cluster", get(status))
        .route("/v1/replicas/{volume}/claim", post(claim))
}

#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    responses((status = 200, body = ClusterStatus),
        (status = 400, description = "The node is not in a cluster", body = ErrorReply),
        (status = 500, description = "etcd cannot be reached", body = ErrorReply)))]
pub async fn status(State(node): NodeState) -> Response {
    with_node(node, |n| reply(n.cluster_status(), 200)).await
}

#[utoipa::path(post, path = "/v1/replicas/{volume}/claim", tag = "cluster",
    params(("volume" = String, Path)), request_body = ClaimReplica,
    responses((status = 200, body = ReplicaFence),
        (status = 404, description = "No such replica on this node", body = ErrorReply),
        (status = 409, description = "Fenced: an owner of a newer epoch holds it", body = ErrorReply)))]
pub async fn claim(State(node): NodeState, Path(volume): Path<String>, bytes: Bytes) -> Response {
    match body::<ClaimReplica>(&bytes, "claim", "owner, epoch") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.claim_replica(&volume, &b.owner, b.epoch), 200)
            })
            .await
        }
        Err(r) => r,
    }
}
