//! `/v1/iscsi`: iSCSI targets.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::get;
use axum::Router;
use tessera_api::{CreateIscsiTarget, Deleted, ErrorReply, IscsiTargetInfo};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/iscsi/targets", get(targets).post(create))
        .route("/v1/iscsi/targets/{iqn}", get(target).delete(remove))
}

#[utoipa::path(get, path = "/v1/iscsi/targets", tag = "iscsi",
    responses((status = 200, body = Vec<IscsiTargetInfo>)))]
pub async fn targets(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.iscsi_list())).await
}

#[utoipa::path(get, path = "/v1/iscsi/targets/{iqn}", tag = "iscsi",
    params(("iqn" = String, Path)),
    responses((status = 200, body = IscsiTargetInfo), (status = 404, body = ErrorReply)))]
pub async fn target(State(node): NodeState, Path(iqn): Path<String>) -> Response {
    with_node(node, move |n| reply(n.iscsi_get(&iqn), 200)).await
}

#[utoipa::path(post, path = "/v1/iscsi/targets", tag = "iscsi", request_body = CreateIscsiTarget,
    responses((status = 201, body = IscsiTargetInfo), (status = "4XX", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateIscsiTarget>(&bytes, "iSCSI target", "iqn, volumes") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.iscsi_create(&b.iqn, &b.volumes), 201)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/iscsi/targets/{iqn}", tag = "iscsi",
    params(("iqn" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn remove(State(node): NodeState, Path(iqn): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.iscsi_delete(&iqn).map(|()| Deleted {
                deleted: iqn.clone(),
            }),
            200,
        )
    })
    .await
}
