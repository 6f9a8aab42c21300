//! `/v1/iscsi`: iSCSI targets.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, put};
use axum::Router;
use tessera_api::{CreateIscsiTarget, Deleted, ErrorReply, IscsiAuth, IscsiTargetInfo};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/iscsi/targets", get(targets).post(create))
        .route("/v1/iscsi/targets/{iqn}", get(target).delete(remove))
        .route("/v1/iscsi/targets/{iqn}/auth", put(set_auth))
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
    match body::<CreateIscsiTarget>(
        &bytes,
        "iSCSI target",
        "iqn, volumes, allowed_initiators, chap",
    ) {
        Ok(b) => {
            with_node(node, move |n| {
                let auth = IscsiAuth {
                    allowed_initiators: b.allowed_initiators,
                    chap: b.chap,
                };
                reply(n.iscsi_create(&b.iqn, &b.volumes, auth), 201)
            })
            .await
        }
        Err(r) => r,
    }
}

/// Replace who may log in to a target: its initiator allowlist and CHAP settings, both
/// (what the body leaves out is cleared). Sessions logged in keep going.
#[utoipa::path(put, path = "/v1/iscsi/targets/{iqn}/auth", tag = "iscsi",
    params(("iqn" = String, Path)), request_body = IscsiAuth,
    responses((status = 200, body = IscsiTargetInfo), (status = "4XX", body = ErrorReply)))]
pub async fn set_auth(State(node): NodeState, Path(iqn): Path<String>, bytes: Bytes) -> Response {
    match body::<IscsiAuth>(&bytes, "iSCSI target access", "allowed_initiators, chap") {
        Ok(b) => with_node(node, move |n| reply(n.iscsi_set_auth(&iqn, b), 200)).await,
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
