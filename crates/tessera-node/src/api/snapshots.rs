//! `/v1/snapshots`, `/v1/snapshot-groups`, `/v1/clones`, and a volume's rollback and
//! changed extents (issue 14).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::Router;
use tessera_api::{
    ChangedExtents, CloneVolume, CreateSnapshot, CreateSnapshotGroup, Deleted, DeletedSnapshot,
    ErrorReply, ReplicaSnapshot, Rollback, SnapshotInfo, VolumeInfo,
};
use tessera_http::Response;

use super::{body, reply, with_node, NodeState};
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/snapshots", get(list).post(create))
        .route("/v1/snapshots/{name}", axum::routing::delete(delete))
        .route("/v1/snapshot-groups", post(create_group))
        .route("/v1/clones", post(clone))
        .route("/v1/volumes/{name}/rollback", post(rollback))
        .route("/v1/volumes/{name}/changes", get(changes))
        .route("/v1/replicas/{volume}/snapshots", post(replica_create))
        .route(
            "/v1/replicas/{volume}/snapshots/{name}",
            axum::routing::delete(replica_delete),
        )
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, body = Vec<SnapshotInfo>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.list_snapshots())).await
}

#[utoipa::path(post, path = "/v1/snapshots", tag = "snapshots", request_body = CreateSnapshot,
    responses((status = 201, body = SnapshotInfo), (status = "4XX", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateSnapshot>(&bytes, "snapshot", "volume, name") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.create_snapshot(&b.volume, &b.name), 201)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(post, path = "/v1/snapshot-groups", tag = "snapshots",
    request_body = CreateSnapshotGroup,
    responses((status = 201, body = Vec<SnapshotInfo>), (status = "4XX", body = ErrorReply)))]
pub async fn create_group(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateSnapshotGroup>(&bytes, "snapshot group", "snapshots: [{volume, name}]") {
        Ok(b) => {
            let what: Vec<(String, String)> = b
                .snapshots
                .into_iter()
                .map(|s| (s.volume, s.name))
                .collect();
            with_node(node, move |n| reply(n.create_snapshot_group(&what), 201)).await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/snapshots/{name}", tag = "snapshots",
    params(("name" = String, Path)),
    responses((status = 200, body = DeletedSnapshot), (status = "4XX", body = ErrorReply)))]
pub async fn delete(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.delete_snapshot(&name), 200)).await
}

#[utoipa::path(post, path = "/v1/replicas/{volume}/snapshots", tag = "snapshots",
    params(("volume" = String, Path)), request_body = ReplicaSnapshot,
    description = "Owner to replica holder: take this replica's copy of a snapshot of the replicated volume (the owner holds the volume's writes meanwhile).",
    responses((status = 201, body = SnapshotInfo),
        (status = 404, description = "No such replica on this node", body = ErrorReply),
        (status = 409, description = "The replica is held for another owner, or the name is taken", body = ErrorReply)))]
pub async fn replica_create(
    State(node): NodeState,
    Path(volume): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<ReplicaSnapshot>(&bytes, "replica snapshot", "name, owner") {
        Ok(b) => with_node(node, move |n| reply(n.snapshot_replica(&volume, &b), 201)).await,
        Err(r) => r,
    }
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct OwnerQuery {
    /// The node that owns the replicated volume.
    owner: String,
}

#[utoipa::path(delete, path = "/v1/replicas/{volume}/snapshots/{name}", tag = "snapshots",
    params(("volume" = String, Path), ("name" = String, Path), OwnerQuery),
    description = "Owner to replica holder: delete this replica's copy of a snapshot.",
    responses((status = 200, body = Deleted),
        (status = 404, description = "No such replica, or no such snapshot of it", body = ErrorReply),
        (status = 409, description = "The replica is held for another owner", body = ErrorReply)))]
pub async fn replica_delete(
    State(node): NodeState,
    Path((volume, name)): Path<(String, String)>,
    Query(q): Query<OwnerQuery>,
) -> Response {
    with_node(node, move |n| {
        reply(
            n.delete_replica_snapshot(&volume, &name, &q.owner)
                .map(|()| Deleted { deleted: name }),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/clones", tag = "snapshots", request_body = CloneVolume,
    responses((status = 201, body = VolumeInfo), (status = "4XX", body = ErrorReply),
        (status = 507, description = "The pool has no room", body = ErrorReply)))]
pub async fn clone(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CloneVolume>(&bytes, "clone", "snapshot, name, force") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.clone_volume(&b.snapshot, &b.name, b.force), 201)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(post, path = "/v1/volumes/{name}/rollback", tag = "snapshots",
    params(("name" = String, Path)), request_body = Rollback,
    responses((status = 200, body = VolumeInfo), (status = "4XX", body = ErrorReply)))]
pub async fn rollback(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<Rollback>(&bytes, "rollback", "to") {
        Ok(b) => with_node(node, move |n| reply(n.rollback_volume(&name, &b.to), 200)).await,
        Err(r) => r,
    }
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct ChangesQuery {
    /// The older snapshot to compare with.
    since: String,
}

#[utoipa::path(get, path = "/v1/volumes/{name}/changes", tag = "snapshots",
    params(("name" = String, Path), ChangesQuery),
    responses((status = 200, body = ChangedExtents), (status = "4XX", body = ErrorReply)))]
pub async fn changes(
    State(node): NodeState,
    Path(name): Path<String>,
    Query(q): Query<ChangesQuery>,
) -> Response {
    with_node(node, move |n| {
        reply(n.changed_extents(&name, &q.since), 200)
    })
    .await
}
