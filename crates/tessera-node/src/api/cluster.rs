//! `/v1/cluster`: the cluster this node is a member of (issue 13).

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::Router;
use tessera_api::{ClusterStatus, ErrorReply};
use tessera_http::Response;

use super::{reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new().route("/v1/cluster", get(status))
}

#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    responses((status = 200, body = ClusterStatus),
        (status = 400, description = "The node is not in a cluster", body = ErrorReply),
        (status = 500, description = "etcd cannot be reached", body = ErrorReply)))]
pub async fn status(State(node): NodeState) -> Response {
    with_node(node, |n| reply(n.cluster_status(), 200)).await
}
