//! `/v1/volumes`: thin volumes, their QoS limits and their I/O statistics.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::routing::get;
use axum::Router;
use tessera_api::{
    AddReplica, CreateReplica, CreateVolume, Deleted, ErrorReply, QosLimits, RemovedReplica,
    ReplicaTarget, ResizeVolume, SizeArg, VolumeInfo, VolumeStats,
};
use tessera_http::Response;
use tessera_pool::VolumeOptions;

use super::{body, reply, with_node, NodeState};
use crate::error::Error;
use crate::node::Node;

const QOS_FIELDS: &str = "iops, read_iops, write_iops, bps, read_bps, write_bps, burst_ms, one_time_burst_ms, weight, reads_first";

fn size(s: &SizeArg) -> Result<u64, Error> {
    match s {
        SizeArg::Bytes(n) => Ok(*n),
        SizeArg::Text(t) => {
            tessera_device::parse_size(t).map_err(|e| Error::invalid(e.to_string()))
        }
    }
}

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/volumes", get(list).post(create))
        .route(
            "/v1/volumes/{name}",
            get(detail).patch(resize).delete(delete),
        )
        .route("/v1/replicas", axum::routing::post(replica_create))
        .route(
            "/v1/replicas/{volume}",
            axum::routing::delete(replica_delete),
        )
        .route(
            "/v1/volumes/{name}/qos",
            get(qos_get).put(qos_put).delete(qos_clear),
        )
        .route("/v1/volumes/{name}/stats", get(stats))
        .route(
            "/v1/volumes/{name}/replicas",
            axum::routing::post(volume_replica_add),
        )
        .route(
            "/v1/volumes/{name}/replicas/{replica}",
            axum::routing::delete(volume_replica_remove),
        )
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes",
    responses((status = 200, body = Vec<VolumeInfo>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.list_volumes())).await
}

#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", request_body = CreateVolume,
    responses((status = 201, body = VolumeInfo), (status = "4XX", body = ErrorReply),
        (status = 507, description = "The pool has no room", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateVolume>(
        &bytes,
        "volume",
        "name, pool, size, replicas, replica_count, force, dedup",
    ) {
        Ok(b) => {
            with_node(node, move |n| {
                let made = size(&b.size).and_then(|s| {
                    if b.dedup.is_some() && (b.replica_count.is_some() || !b.replicas.is_empty()) {
                        return Err(Error::invalid(
                            "dedup is chosen per pool for a replicated volume: leave it out",
                        ));
                    }
                    if let Some(count) = b.replica_count {
                        if !b.pool.is_empty() || !b.replicas.is_empty() {
                            return Err(Error::invalid(
                                "give replica_count alone: placement chooses the pools",
                            ));
                        }
                        let places = n.place_replicas(usize::try_from(count).unwrap_or(0))?;
                        n.create_replicated_volume(&b.name, s, &places, b.force)
                    } else if b.replicas.is_empty() {
                        let opts = VolumeOptions {
                            force: b.force,
                            dedup: b.dedup,
                        };
                        n.create_volume_opts(&b.name, &b.pool, s, opts)
                    } else if !b.pool.is_empty() {
                        Err(Error::invalid(
                            "give either pool or replicas (NODE:POOL each), not both",
                        ))
                    } else {
                        n.create_replicated_volume(&b.name, s, &b.replicas, b.force)
                    }
                });
                reply(made, 201)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(get, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path)),
    responses((status = 200, body = VolumeInfo), (status = 404, body = ErrorReply)))]
pub async fn detail(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.volume(&name), 200)).await
}

#[utoipa::path(patch, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path)), request_body = ResizeVolume,
    responses((status = 200, body = VolumeInfo), (status = "4XX", body = ErrorReply)))]
pub async fn resize(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<ResizeVolume>(&bytes, "resize", "size, force") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(
                    size(&b.size).and_then(|s| n.resize_volume(&name, s, b.force)),
                    200,
                )
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/volumes/{name}", tag = "volumes",
    params(("name" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn delete(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.delete_volume(&name).map(|()| Deleted {
                deleted: name.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(get, path = "/v1/volumes/{name}/qos", tag = "volumes",
    params(("name" = String, Path)),
    responses((status = 200, body = QosLimits), (status = 404, body = ErrorReply)))]
pub async fn qos_get(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.volume_qos(&name), 200)).await
}

#[utoipa::path(put, path = "/v1/volumes/{name}/qos", tag = "volumes",
    params(("name" = String, Path)), request_body = QosLimits,
    responses((status = 200, body = QosLimits), (status = "4XX", body = ErrorReply)))]
pub async fn qos_put(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<QosLimits>(&bytes, "QoS limits", QOS_FIELDS) {
        Ok(l) => with_node(node, move |n| reply(n.set_volume_qos(&name, l), 200)).await,
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/volumes/{name}/qos", tag = "volumes",
    params(("name" = String, Path)),
    responses((status = 200, description = "The limits are cleared", body = QosLimits),
        (status = 404, body = ErrorReply)))]
pub async fn qos_clear(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(n.set_volume_qos(&name, QosLimits::default()), 200)
    })
    .await
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct StatsQuery {
    /// Measurement interval in milliseconds, 1..=60000 (default 1000).
    #[param(value_type = Option<u64>)]
    interval_ms: Option<String>,
}

#[utoipa::path(get, path = "/v1/volumes/{name}/stats", tag = "volumes",
    params(("name" = String, Path), StatsQuery),
    responses((status = 200, body = VolumeStats), (status = "4XX", body = ErrorReply)))]
pub async fn stats(
    State(node): NodeState,
    Path(name): Path<String>,
    Query(query): Query<StatsQuery>,
) -> Response {
    let ms = match query.interval_ms.as_deref().map(str::parse::<u64>) {
        None => 1000,
        Some(Ok(ms)) if (1..=60_000).contains(&ms) => ms,
        Some(_) => return Response::error(400, "interval_ms must be between 1 and 60000"),
    };
    with_node(node, move |n| {
        reply(n.volume_stats(&name, Duration::from_millis(ms)), 200)
    })
    .await
}

#[utoipa::path(post, path = "/v1/replicas", tag = "volumes", request_body = CreateReplica,
    description = "Node to node: hold a replica of a volume another node owns (a thin volume exported to the owner over NVMe/TCP). Idempotent.",
    responses((status = 201, body = ReplicaTarget), (status = "4XX", body = ErrorReply)))]
pub async fn replica_create(State(node): NodeState, bytes: Bytes) -> Response {
    match body::<CreateReplica>(&bytes, "replica", "volume, pool, size, owner") {
        Ok(b) => with_node(node, move |n| reply(n.create_replica(&b), 201)).await,
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/replicas/{volume}", tag = "volumes",
    params(("volume" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn replica_delete(State(node): NodeState, Path(volume): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.delete_replica(&volume).map(|()| Deleted {
                deleted: volume.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/volumes/{name}/replicas", tag = "volumes",
    params(("name" = String, Path)), request_body = AddReplica,
    description = "Give a volume one more replica on a peer node. The new replica starts empty and gets a copy of the allocated regions in the background (see the volume's replicas). A volume that is not replicated yet becomes so; it must not be exported or connected.",
    responses((status = 201, body = VolumeInfo), (status = "4XX", body = ErrorReply)))]
pub async fn volume_replica_add(
    State(node): NodeState,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<AddReplica>(&bytes, "replica", "replica") {
        Ok(b) => with_node(node, move |n| reply(n.add_replica(&name, &b.replica), 201)).await,
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/volumes/{name}/replicas/{replica}", tag = "volumes",
    params(("name" = String, Path), ("replica" = String, Path, description = "NODE:POOL")),
    description = "Remove a replica of a volume; its node is asked to delete the replica's volume. The owner's own replica and the last replica in sync cannot be removed.",
    responses((status = 200, body = RemovedReplica), (status = "4XX", body = ErrorReply)))]
pub async fn volume_replica_remove(
    State(node): NodeState,
    Path((name, replica)): Path<(String, String)>,
) -> Response {
    with_node(node, move |n| reply(n.remove_replica(&name, &replica), 200)).await
}
