//! The metrics listener: `GET /metrics` (Prometheus text), `/healthz` and `/readyz`,
//! plain HTTP and read-only, on a thread of its own running a single-threaded tokio
//! runtime (never on a reactor core). It starts before the node opens its pools, so
//! `/healthz` answers and `/readyz` says "starting" while they open.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tracing::{error, info};

use crate::Node;

/// What the handlers read: the node once it has started, and whether its exports are
/// listening.
#[derive(Default)]
struct Shared {
    node: OnceLock<Arc<Node>>,
    serving: AtomicBool,
}

/// A running metrics listener.
pub struct MetricsListener {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

/// The content type of the Prometheus text format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

impl MetricsListener {
    /// Bind `listen` (e.g. "127.0.0.1:9464") and serve on a new thread.
    pub fn start(listen: &str) -> std::io::Result<MetricsListener> {
        let std_listener = std::net::TcpListener::bind(listen).map_err(|e| {
            std::io::Error::new(e.kind(), format!("metrics listener {listen}: {e}"))
        })?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(shared.clone());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        std::thread::Builder::new()
            .name("tessera-metrics".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => return error!(error = %e, "metrics listener cannot start"),
                    };
                    if let Err(e) = axum::serve(listener, app).await {
                        error!(error = %e, "metrics listener stopped");
                    }
                })
            })?;
        info!(address = %addr, "metrics listener: /metrics, /healthz, /readyz");
        Ok(MetricsListener { shared, addr })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The node has started (its pools are open): metrics are served from it.
    pub fn attach(&self, node: Arc<Node>) {
        let _ = self.shared.node.set(node);
    }

    /// The exports are listening (true), or the node is stopping (false).
    pub fn set_serving(&self, serving: bool) {
        self.shared.serving.store(serving, SeqCst);
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let Some(node) = s.node.get().cloned() else {
        // Nothing to read yet: the families exist once the node has started.
        return (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            "# The node is starting.\n",
        )
            .into_response();
    };
    // Rendering takes the pools' and registries' locks (briefly): off the runtime's
    // thread, so a slow render never holds up /healthz.
    match tokio::task::spawn_blocking(move || crate::metrics::render(&node)).await {
        Ok(text) => ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], text).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    let node = s.node.get().cloned();
    let serving = s.serving.load(SeqCst);
    let (ready, body) = match tokio::task::spawn_blocking(move || {
        crate::metrics::readiness(node.as_deref(), serving)
    })
    .await
    {
        Ok(r) => r,
        Err(e) => (
            false,
            serde_json::json!({"ready": false, "reasons": [format!("readiness check failed: {e}")]}),
        ),
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{body}\n"),
    )
        .into_response()
}
