//! `/v1/background`: the background classes' limits (scrub, rebuild, resync).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, put};
use axum::Router;
use tessera_api::{BackgroundLimits, ErrorReply};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/background", get(list))
        .route("/v1/background/{class}", put(put_limits).delete(reset))
}

#[utoipa::path(get, path = "/v1/background", tag = "background",
    responses((status = 200, description = "Every class's limits, by class name",
        body = std::collections::BTreeMap<String, BackgroundLimits>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.jobs().background().list())).await
}

#[utoipa::path(put, path = "/v1/background/{class}", tag = "background",
    params(("class" = String, Path, description = "scrub, rebuild or resync")),
    request_body = BackgroundLimits,
    responses((status = 200, body = BackgroundLimits), (status = "4XX", body = ErrorReply)))]
pub async fn put_limits(
    State(node): NodeState,
    Path(class): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<BackgroundLimits>(
        &bytes,
        "background limits",
        "bps, latency_target_us, min_pct",
    ) {
        Ok(l) => {
            with_node(node, move |n| {
                let r = n.jobs().background().put(&class, Some(l));
                n.replicas().refresh_rates(n.jobs().background());
                reply(r, 200)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/background/{class}", tag = "background",
    params(("class" = String, Path, description = "scrub, rebuild or resync")),
    responses((status = 200, description = "The class is back to its defaults",
        body = BackgroundLimits), (status = "4XX", body = ErrorReply)))]
pub async fn reset(State(node): NodeState, Path(class): Path<String>) -> Response {
    with_node(node, move |n| {
        let r = n.jobs().background().put(&class, None);
        n.replicas().refresh_rates(n.jobs().background());
        reply(r, 200)
    })
    .await
}
