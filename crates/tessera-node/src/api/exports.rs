//! `/v1/exports`: NBD exports.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{delete, get};
use axum::Router;
use tessera_api::{CreateExport, Deleted, ErrorReply, ExportInfo};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/exports", get(list).post(create))
        .route("/v1/exports/{name}", delete(remove))
}

#[utoipa::path(get, path = "/v1/exports", tag = "exports",
    responses((status = 200, body = Vec<ExportInfo>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| {
        Response::json(200, &n.exports().list(&n.pools().list()))
    })
    .await
}

#[utoipa::path(post, path = "/v1/exports", tag = "exports", request_body = CreateExport,
    responses((status = 201, body = ExportInfo), (status = "4XX", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateExport>(&bytes, "export", "name, volume, read_only, tls") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.add_export(&b.name, &b.volume, b.read_only, b.tls), 201)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/exports/{name}", tag = "exports",
    params(("name" = String, Path)),
    responses((status = 200, body = Deleted), (status = 404, body = ErrorReply)))]
pub async fn remove(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.remove_export(&name).map(|()| Deleted {
                deleted: name.clone(),
            }),
            200,
        )
    })
    .await
}
