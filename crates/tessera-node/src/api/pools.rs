//! `/v1/pools`: pools, their rebuild, scrub and resync jobs, device replacement and
//! hot spares.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;
use tessera_api::{
    CacheInfo, CacheModeRequest, CacheRequest, CreatePool, Deleted, ErrorReply, PoolEntry,
    PoolInfo, RebuildRequest, RebuildStatus, ReplaceReply, ReplaceRequest, ScrubRequest,
    ScrubStatus, SizeArg, SpareList, SpareRequest, UpdatePool,
};
use tessera_http::Response;

use super::{body, parse_body, reply, size_of, with_node, NodeState};
use crate::error::Error;
use crate::node::Node;

pub fn routes() -> Router<Arc<Node>> {
    Router::new()
        .route("/v1/pools", get(list).post(create))
        .route(
            "/v1/pools/{name}",
            get(detail).patch(update).delete(destroy),
        )
        .route(
            "/v1/pools/{name}/rebuild",
            get(rebuild_status).post(rebuild_start).delete(rebuild_stop),
        )
        .route("/v1/pools/{name}/replace", post(replace))
        .route(
            "/v1/pools/{name}/spares",
            get(spares_list).post(spares_add).delete(spares_remove),
        )
        .route(
            "/v1/pools/{name}/scrub",
            get(scrub_status).post(scrub_start).delete(scrub_stop),
        )
        .route("/v1/pools/{name}/resync", get(resync_status))
        .route(
            "/v1/pools/{name}/cache",
            get(cache_show)
                .post(cache_add)
                .patch(cache_mode)
                .delete(cache_remove),
        )
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools",
    responses((status = 200, description = "Every pool, online or offline", body = Vec<PoolEntry>)))]
pub async fn list(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.list_pools())).await
}

#[utoipa::path(post, path = "/v1/pools", tag = "pools", request_body = CreatePool,
    responses((status = 201, body = PoolInfo), (status = "4XX", body = ErrorReply),
        (status = "5XX", body = ErrorReply)))]
pub async fn create(State(node): NodeState, bytes: Bytes) -> Response {
    let b: CreatePool = match body(
        &bytes,
        "pool",
        "name, devices, layout, copies, stripe_size, unit_size, force, overcommit, cache, cache_mode, cache_unit, cache_admit_hits, dedup",
    ) {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The request, typed: the layout with its copies, the sizes in bytes.
    let args = || -> Result<_, Error> {
        let mut layout = b.layout.unwrap_or_default();
        if let Some(c) = b.copies {
            layout = layout.with_copies(c)?;
        }
        let size = |what, s: &Option<SizeArg>| s.as_ref().map(|s| size_of(what, s)).transpose();
        let stripe = size("stripe size", &b.stripe_size)?;
        let unit = size("unit size", &b.unit_size)?;
        Ok((layout, stripe, unit))
    };
    let (layout, stripe, unit) = match args() {
        Ok(a) => a,
        Err(e) => return reply::<(), _>(Err(e), 201),
    };
    // A bad ratio is refused before anything is created; a good one is set on the new
    // (empty) pool as `PATCH` would.
    if let Some(Err(e)) = b.overcommit.map(tessera_pool::validate_overcommit) {
        return reply::<(), _>(Err(e), 201);
    }
    with_node(node, move |n| {
        let created = n
            .create_pool(&b.name, &b.devices, layout, stripe, unit, b.force)
            .and_then(|info| match b.overcommit {
                Some(r) => n.update_pool(
                    &info.name,
                    &UpdatePool {
                        overcommit: Some(r),
                        ..UpdatePool::default()
                    },
                ),
                None => Ok(info),
            })
            .and_then(|info| {
                if !b.dedup {
                    return Ok(info);
                }
                // A pool asked for with dedup that cannot have it is not left behind.
                n.enable_pool_dedup(&info.name).inspect_err(|_| {
                    let _ = n.destroy_pool(&info.name);
                })
            })
            .and_then(|info| {
                if b.cache.is_empty() {
                    return Ok(info);
                }
                let req = CacheRequest {
                    devices: b.cache.clone(),
                    mode: b.cache_mode.clone(),
                    force: b.force,
                    unit: b.cache_unit.clone(),
                    admit_hits: b.cache_admit_hits,
                };
                // A pool asked for with a cache that cannot be had is not left behind.
                match n.add_pool_cache(&info.name, &req) {
                    Ok(_) => n.pool_detail(&info.name),
                    Err(e) => {
                        let _ = n.destroy_pool(&info.name);
                        Err(e)
                    }
                }
            });
        reply(created, 201)
    })
    .await
}

#[utoipa::path(patch, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    request_body = UpdatePool,
    responses((status = 200, body = PoolInfo), (status = "4XX", body = ErrorReply)))]
pub async fn update(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<UpdatePool>(&bytes, "pool update", "overcommit, dedup") {
        Ok(b) => with_node(node, move |n| reply(n.update_pool(&name, &b), 200)).await,
        Err(r) => r,
    }
}

#[utoipa::path(get, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    responses((status = 200, body = PoolInfo), (status = 404, body = ErrorReply)))]
pub async fn detail(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.pool_detail(&name), 200)).await
}

#[utoipa::path(delete, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path)),
    responses((status = 200, body = Deleted), (status = "4XX", body = ErrorReply)))]
pub async fn destroy(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.destroy_pool(&name).map(|()| Deleted {
                deleted: name.clone(),
            }),
            200,
        )
    })
    .await
}

#[utoipa::path(get, path = "/v1/pools/{name}/rebuild", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = RebuildStatus), (status = 404, body = ErrorReply)))]
pub async fn rebuild_status(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.pools()
                .get(&name)
                .and_then(|p| n.jobs().rebuild_status(&p)),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/pools/{name}/rebuild", tag = "pools",
    params(("name" = String, Path)), request_body = RebuildRequest,
    responses((status = 202, description = "Started", body = RebuildStatus),
        (status = "4XX", body = ErrorReply)))]
pub async fn rebuild_start(
    State(node): NodeState,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<RebuildRequest>(&bytes, "rebuild", "device, force") {
        Ok(b) => {
            with_node(node, move |n| {
                let r = n
                    .pools()
                    .get(&name)
                    .and_then(|p| n.jobs().start_rebuild(&p, b.device, b.force));
                reply(r, 202)
            })
            .await
        }
        Err(r) => r,
    }
}

#[utoipa::path(delete, path = "/v1/pools/{name}/rebuild", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = RebuildStatus), (status = "4XX", body = ErrorReply)))]
pub async fn rebuild_stop(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.pools().get(&name).and_then(|p| n.jobs().stop_rebuild(&p)),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/pools/{name}/replace", tag = "pools",
    params(("name" = String, Path)), request_body = ReplaceRequest,
    responses((status = 200, body = ReplaceReply), (status = "4XX", body = ErrorReply)))]
pub async fn replace(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match parse_body::<ReplaceRequest>(&bytes) {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.replace_device(&name, b.device, &b.with, b.force), 200)
            })
            .await
        }
        Err(_) => Response::error(
            400,
            "replace needs {\"device\": index, \"with\": \"device spec\"}",
        ),
    }
}

#[utoipa::path(get, path = "/v1/pools/{name}/spares", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = SpareList), (status = 404, body = ErrorReply)))]
pub async fn spares_list(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.list_spares(&name), 200)).await
}

#[utoipa::path(post, path = "/v1/pools/{name}/spares", tag = "pools",
    params(("name" = String, Path)), request_body = SpareRequest,
    responses((status = 201, body = SpareList), (status = "4XX", body = ErrorReply)))]
pub async fn spares_add(
    State(node): NodeState,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Response {
    match parse_body::<SpareRequest>(&bytes) {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.add_spare(&name, &b.device, b.force), 201)
            })
            .await
        }
        Err(_) => Response::error(400, "adding a spare needs {\"device\": \"device spec\"}"),
    }
}

/// `DELETE .../spares?device=SPEC`: the spec may hold slashes, so it comes in the body or
/// the query, never in the path.
#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct SpareQuery {
    /// The spare's device spec, when the body does not give it.
    device: Option<String>,
}

#[utoipa::path(delete, path = "/v1/pools/{name}/spares", tag = "pools",
    params(("name" = String, Path), SpareQuery), request_body = SpareRequest,
    responses((status = 200, body = SpareList), (status = "4XX", body = ErrorReply)))]
pub async fn spares_remove(
    State(node): NodeState,
    Path(name): Path<String>,
    Query(query): Query<SpareQuery>,
    bytes: Bytes,
) -> Response {
    let from_body = parse_body::<SpareRequest>(&bytes).ok().map(|b| b.device);
    match from_body.or(query.device) {
        Some(d) => with_node(node, move |n| reply(n.remove_spare(&name, &d), 200)).await,
        None => Response::error(400, "removing a spare needs {\"device\": \"device spec\"}"),
    }
}

#[utoipa::path(get, path = "/v1/pools/{name}/scrub", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = ScrubStatus), (status = 404, body = ErrorReply)))]
pub async fn scrub_status(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.pools().get(&name).and_then(|p| n.jobs().scrub_status(&p)),
            200,
        )
    })
    .await
}

#[utoipa::path(post, path = "/v1/pools/{name}/scrub", tag = "pools",
    params(("name" = String, Path)), request_body = ScrubRequest,
    responses((status = 202, description = "Started", body = ScrubStatus),
        (status = "4XX", body = ErrorReply)))]
pub async fn scrub_start(
    State(node): NodeState,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Response {
    match parse_body::<ScrubRequest>(&bytes) {
        Ok(b) => {
            with_node(node, move |n| {
                let r = n
                    .pools()
                    .get(&name)
                    .and_then(|p| n.jobs().start_scrub(&p, b.repair));
                reply(r, 202)
            })
            .await
        }
        Err(_) => Response::error(400, "field 'repair' must be true or false"),
    }
}

#[utoipa::path(delete, path = "/v1/pools/{name}/scrub", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = ScrubStatus), (status = "4XX", body = ErrorReply)))]
pub async fn scrub_stop(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.pools().get(&name).and_then(|p| n.jobs().stop_scrub(&p)),
            200,
        )
    })
    .await
}

#[utoipa::path(get, path = "/v1/pools/{name}/resync", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = ScrubStatus), (status = 404, body = ErrorReply)))]
pub async fn resync_status(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| {
        reply(
            n.pools()
                .get(&name)
                .and_then(|p| n.jobs().resync_status(&p)),
            200,
        )
    })
    .await
}

#[utoipa::path(get, path = "/v1/pools/{name}/cache", tag = "pools",
    params(("name" = String, Path)),
    responses((status = 200, body = CacheInfo), (status = 404, body = ErrorReply)))]
pub async fn cache_show(State(node): NodeState, Path(name): Path<String>) -> Response {
    with_node(node, move |n| reply(n.pool_cache(&name), 200)).await
}

#[utoipa::path(post, path = "/v1/pools/{name}/cache", tag = "pools",
    params(("name" = String, Path)), request_body = CacheRequest,
    responses((status = 201, body = CacheInfo), (status = "4XX", body = ErrorReply)))]
pub async fn cache_add(State(node): NodeState, Path(name): Path<String>, bytes: Bytes) -> Response {
    match body::<CacheRequest>(&bytes, "cache", "devices, mode, force, unit") {
        Ok(b) => with_node(node, move |n| reply(n.add_pool_cache(&name, &b), 201)).await,
        Err(r) => r,
    }
}

#[utoipa::path(patch, path = "/v1/pools/{name}/cache", tag = "pools",
    params(("name" = String, Path)), request_body = CacheModeRequest,
    responses((status = 200, body = CacheInfo), (status = "4XX", body = ErrorReply)))]
pub async fn cache_mode(
    State(node): NodeState,
    Path(name): Path<String>,
    bytes: Bytes,
) -> Response {
    match body::<CacheModeRequest>(&bytes, "cache mode", "mode, force") {
        Ok(b) => {
            with_node(node, move |n| {
                reply(n.set_pool_cache_mode(&name, &b.mode, b.force), 200)
            })
            .await
        }
        Err(r) => r,
    }
}

/// `DELETE /v1/pools/NAME/cache?force=true`: give up a write-back cache that cannot be
/// opened (its data is lost).
#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct CacheRemoveQuery {
    /// Accept the loss of a missing write-back cache's data.
    #[serde(default)]
    force: bool,
}

#[utoipa::path(delete, path = "/v1/pools/{name}/cache", tag = "pools",
    params(("name" = String, Path), CacheRemoveQuery),
    responses((status = 200, body = CacheInfo), (status = "4XX", body = ErrorReply)))]
pub async fn cache_remove(
    State(node): NodeState,
    Path(name): Path<String>,
    Query(q): Query<CacheRemoveQuery>,
) -> Response {
    with_node(node, move |n| {
        reply(n.remove_pool_cache(&name, q.force), 200)
    })
    .await
}
