//! `/v1/groups`: QoS groups (tenants) and their members.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, put};
use axum::Router;
use tessera_api::{Deleted, ErrorReply, GroupInfo, PutGroup};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

const FIELDS: &str = "limits {iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms}, step {step_pct, max_steps, step_ms, credit_ms}";

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/groups", get(list))
        .route(
            "/v1/groups/{name}",
            get(detail).put(put_group).delete(delete),
        )
        .route(
            "/v1/groups/{name}/members/{volume}",
            put(member_add).delete(member_remove),
        )
}

#[utoipa::path(get, path = "/v1/groups", tag = "groups",
    responses((status = 200, body = Vec<GroupInfo>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.groups.list())).await
}

#[utoipa::path(get, path = "/v1/groups/{name}", tag = "groups",
    params(("name" = String, Path)),
    responses((status = 200, body = GroupInfo), (status = 404, body = ErrorReply)))]
pub async fn detail(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.groups.get(&name), 200)).await
}

#[utoipa::path(put, path = "/v1/groups/{name}", tag = "groups",
    params(("name" = String, Path)), request_body = PutGroup,
    responses((status = 200, description = "Created or replaced", body = GroupInfo),
        (status = "4XX", body = ErrorReply)))]
pub async fn put_group(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<PutGroup>(&bytes, "group", FIELDS) {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.put_group(&name, b.limits, b.step), 200)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/groups/{name}", tag = "groups",
    params(("name" = String, Path)),
    responses((status = 200, body = Deleted), (status = 404, body = ErrorReply)))]
pub async fn delete(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.delete_group(&name).map(|()| Deleted {
                deleted: name.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(put, path = "/v1/groups/{name}/members/{volume}", tag = "groups",
    params(("name" = String, Path), ("volume" = String, Path)),
    responses((status = 200, body = GroupInfo), (status = "4XX", body = ErrorReply)))]
pub async fn member_add(
    State(node): NodeState,
    Path((name, volume)): Path<(String, String)>,
) -> Response {
    with_node(node, move |n| {
        reply(n.add_group_member(&name, &volume), 200)
    })
    .await
}

#[utoipa::path(delete, path = "/v1/groups/{name}/members/{volume}", tag = "groups",
    params(("name" = String, Path), ("volume" = String, Path)),
    responses((status = 200, body = GroupInfo), (status = "4XX", body = ErrorReply)))]
pub async fn member_remove(
    State(node): NodeState,
    Path((name, volume)): Path<(String, String)>,
) -> Response {
    with_node(node, move |n| {
        reply(n.remove_group_member(&name, &volume), 200)
    })
    .await
}
