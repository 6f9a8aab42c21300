//! The management API: HTTP/JSON routes over [`Node`], one handler per resource
//! (documented in docs/api.md). Requests and replies are the types of `tessera_api`;
//! this module is the only place where they become JSON, and where a [`Error`] becomes an
//! HTTP status ([`status_of`]).

mod background;
mod exports;
mod groups;
mod nvmf;
mod pools;
mod volumes;

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tessera_http::{Request, Response};

use crate::error::Error;
use crate::node::Node;

/// The HTTP status of a refused or failed operation.
pub fn status_of(e: &Error) -> u16 {
    match e {
        Error::NotFound(_) => 404,
        Error::AlreadyExists(_) | Error::Busy(_) => 409,
        Error::Invalid(_) => 400,
        Error::NoSpace(_) => 507,
        Error::Corrupt(_) | Error::Io(_) => 500,
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

/// The request body as `T`; a body that does not fit is a 400 naming the fields
/// (`fields`).
fn body<T: DeserializeOwned>(req: &Request, what: &str, fields: &str) -> Result<T, Response> {
    req.body_as::<T>()
        .map_err(|e| Response::error(400, &format!("bad {what}: {e} (fields: {fields})")))
}

fn no_route(req: &Request) -> Response {
    Response::error(
        404,
        &format!("no such API route: {} {}", req.method, req.path),
    )
}

pub fn handle(node: &Arc<Node>, req: &Request) -> Response {
    if matches!(req.method.as_str(), "POST" | "PATCH" | "PUT") {
        if let Err(e) = req.body_as::<serde::de::IgnoredAny>() {
            return Response::error(400, &format!("request body is not valid JSON: {e}"));
        }
    }
    let parts: Vec<&str> = req.path.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["v1", "status"] if req.method == "GET" => Response::json(200, &node.status()),
        ["v1", "pools", rest @ ..] => pools::handle(node, req, rest),
        ["v1", "volumes", rest @ ..] => volumes::handle(node, req, rest),
        ["v1", "exports", rest @ ..] => exports::handle(node, req, rest),
        ["v1", "groups", rest @ ..] => groups::handle(node, req, rest),
        ["v1", "background", rest @ ..] => background::handle(node, req, rest),
        ["v1", "nvmf", rest @ ..] => nvmf::handle(node, req, rest),
        ["v1", ..] => no_route(req),
        _ => Response::error(404, "the Tessera API lives under /v1/"),
    }
}
