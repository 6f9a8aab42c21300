//! The management API: an axum router over [`Node`], one module per resource (documented
//! in docs/api.md, described by the OpenAPI document [`openapi`] generated from the
//! handlers and the types of `tessera_api`). This module is the only place where those
//! types become JSON and where an [`Error`] becomes an HTTP status ([`status_of`]). Every
//! call into the node runs on the API runtime's blocking pool ([`tessera_http::blocking`]).

mod background;
mod cluster;
mod exports;
mod groups;
mod iscsi;
mod nvmf;
mod pools;
mod snapshots;
mod volumes;

use std::sync::Arc;

use axum::extract::State;
use axum::http::Uri;
use axum::routing::get;
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tessera_api::{NodeStatus, SizeArg};
use tessera_http::{blocking, Response};
use utoipa::OpenApi;

use crate::error::Error;
use crate::node::Node;

/// The HTTP status of a refused or failed operation.
pub fn status_of(e: &Error) -> u16 {
    match e {
        Error::NotFound(_) => 404,
        Error::AlreadyExists(_) | Error::Busy(_) => 409,
        Error::Invalid(_) | Error::Rejected(_) => 400,
        Error::NoSpace(_) => 507,
        Error::Corrupt(_) | Error::Io { .. } => 500,
        Error::Unavailable(_) => 503,
    }
}

/// `ok` with the value, or the error's status with `{"error": message}`.
fn reply<T: Serialize, E: Into<Error>>(r: Result<T, E>, ok: u16) -> Response {
    match r {
        Ok(v) => Response::json(ok, &v),
        Err(e) => {
            let e = e.into();
            Response::error(status_of(&e), &e.to_string())
        }
    }
}

/// Parses a body as JSON into `T`. An empty (or all-whitespace) body is read as JSON
/// `null` (so a body type whose fields all have defaults may be left out).
fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> serde_json::Result<T> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return serde_json::from_str("null").or_else(|_| serde_json::from_str("{}"));
    }
    serde_json::from_slice(bytes)
}

/// The request body as `T`; a body that does not fit is a 400 naming the fields
/// (`fields`).
fn body<T: DeserializeOwned>(bytes: &[u8], what: &str, fields: &str) -> Result<T, Response> {
    parse_body::<T>(bytes)
        .map_err(|e| Response::error(400, &format!("bad {what}: {e} (fields: {fields})")))
}

/// A size of a request in bytes; `what` names it in the error.
fn size_of(what: &str, s: &SizeArg) -> Result<u64, Error> {
    match s {
        SizeArg::Bytes(n) => Ok(*n),
        SizeArg::Text(t) => {
            tessera_device::parse_size(t).map_err(|e| Error::invalid(format!("{what}: {e}")))
        }
    }
}

/// The node, as every handler gets it.
type NodeState = State<Arc<Node>>;

/// Runs `call` with the node on the blocking pool.
async fn with_node<F>(node: Arc<Node>, call: F) -> Response
where
    F: FnOnce(&Node) -> Response + Send + 'static,
{
    blocking(move || call(&node)).await
}

#[utoipa::path(get, path = "/v1/status", tag = "node",
    responses((status = 200, description = "The node at a glance", body = NodeStatus)))]
async fn status(State(node): NodeState) -> Response {
    with_node(node, |n| Response::json(200, &n.status())).await
}

/// The OpenAPI document (served at `/openapi.json`, checked in as docs/openapi.json).
async fn openapi_json() -> Response {
    Response::json(200, &openapi())
}

async fn no_route(method: axum::http::Method, uri: Uri) -> Response {
    if uri.path().starts_with("/v1/") {
        Response::error(404, &format!("no such API route: {method} {}", uri.path()))
    } else {
        Response::error(404, "the Tessera API lives under /v1/")
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Tessera management API",
        description = "JSON over HTTP/1.1 on the node's Unix socket, or on TCP with TLS and a bearer token (docs/api.md). Every error reply is {\"error\": message}.",
        license(name = "Apache-2.0")
    ),
    paths(
        status,
        pools::list, pools::create, pools::detail, pools::destroy,
        pools::rebuild_status, pools::rebuild_start, pools::rebuild_stop,
        pools::replace, pools::spares_list, pools::spares_add, pools::spares_remove,
        pools::scrub_status, pools::scrub_start, pools::scrub_stop, pools::resync_status,
        pools::cache_show, pools::cache_add, pools::cache_mode, pools::cache_remove,
        volumes::list, volumes::create, volumes::detail, volumes::resize, volumes::delete,
        volumes::qos_get, volumes::qos_put, volumes::qos_clear, volumes::stats,
        volumes::replica_create, volumes::replica_delete, volumes::volume_replica_add,
        volumes::volume_replica_remove,
        exports::list, exports::create, exports::remove,
        groups::list, groups::detail, groups::put_group, groups::delete,
        groups::member_add, groups::member_remove,
        background::list, background::put_limits, background::reset,
        nvmf::subsystems, nvmf::controllers, nvmf::subsystem, nvmf::create, nvmf::patch,
        nvmf::remove, nvmf::namespace_add, nvmf::namespace_remove, nvmf::host_add,
        nvmf::host_remove, nvmf::cluster_paths, nvmf::cluster_path_put,
        nvmf::cluster_path_remove,
        iscsi::targets, iscsi::target, iscsi::create, iscsi::remove, iscsi::set_auth,
        snapshots::list, snapshots::create, snapshots::create_group, snapshots::delete,
        snapshots::clone, snapshots::rollback, snapshots::changes, snapshots::replica_create,
        snapshots::replica_delete,
        cluster::status, cluster::claim,
    ),
    components(schemas(tessera_api::ErrorReply)),
    modifiers(&BearerAuth),
    security((), ("bearer" = []))
)]
struct ApiDoc;

/// Declares the bearer scheme (TCP listeners; the Unix socket needs none).
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The API's OpenAPI document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    // The crate's version would make the checked-in document go stale at every release.
    doc.info.version = "1".into();
    doc
}

/// Every route of the API over `node`.
pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route("/v1/status", get(status))
        .route("/openapi.json", get(openapi_json))
        .merge(pools::routes())
        .merge(volumes::routes())
        .merge(exports::routes())
        .merge(groups::routes())
        .merge(background::routes())
        .merge(nvmf::routes())
        .merge(iscsi::routes())
        .merge(snapshots::routes())
        .merge(cluster::routes())
        .fallback(no_route)
        .layer(axum::middleware::from_fn(tessera_http::require_json_bodies))
        .with_state(node)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_checked_in_openapi_document_is_the_generated_one() {
        let generated = serde_json::to_string_pretty(&super::openapi()).unwrap() + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
        if std::env::var_os("TESSERA_BLESS_OPENAPI").is_some() {
            std::fs::write(path, &generated).unwrap();
        }
        let checked_in = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            checked_in == generated,
            "docs/openapi.json is stale: regenerate it with \
             TESSERA_BLESS_OPENAPI=1 cargo test -p tessera-node openapi"
        );
    }
}
