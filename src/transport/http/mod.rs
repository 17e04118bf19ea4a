//! The HTTP adapter: Prometheus scrapes, health, OIP model metadata and
//! `POST .../infer` through the same engine as MQTT; who may call what is
//! in `auth`, the listener itself in `server`.

mod auth;
mod server;

pub use auth::{Access, AccessError, Token};
pub use server::{Listener, serve};

use crate::engine::{Engine, Envelope};
use crate::protocol::{Encoding, ErrorReply, InferError};
use crate::rollout::{Asker, RolloutError};
use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio::sync::watch;

#[derive(Clone)]
struct AppState {
    engine: Arc<Engine>,
    metrics: Option<PrometheusHandle>,
    /// True while the MQTT session is up with our subscriptions.
    mqtt_ready: watch::Receiver<bool>,
    /// The longest a request body may take to arrive.
    body_timeout: std::time::Duration,
}

pub fn router(
    engine: Arc<Engine>,
    metrics: Option<PrometheusHandle>,
    mqtt_ready: watch::Receiver<bool>,
    access: Access,
    body_timeout: std::time::Duration,
) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .route("/v2/health/live", get(|| async { axum::Json(serde_json::json!({"live": true})) }))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer_version))
        .route("/v2/feedback", post(feedback))
        .route("/cache/stats", get(cache_stats))
        .route("/cache/purge", post(cache_purge))
        .route("/models/status", get(models_status))
        .route("/models/promote", post(models_promote))
        .route("/models/rollback", post(models_rollback))
        .route("/models/rollout", post(models_rollout))
        .with_state(AppState { engine, metrics, mqtt_ready, body_timeout })
        .layer(axum::middleware::from_fn_with_state(Arc::new(access), auth::guard))
}

async fn cache_stats(State(state): State<AppState>) -> Response {
    axum::Json(state.engine.cache().stats()).into_response()
}

#[derive(serde::Deserialize)]
struct PurgeQuery {
    model: Option<String>,
}

async fn cache_purge(State(state): State<AppState>, Query(q): Query<PurgeQuery>) -> Response {
    match state.engine.cache().purge(q.model.as_deref()).await {
        Ok(n) => axum::Json(serde_json::json!({"purged_disk_entries": n, "model": q.model})).into_response(),
        Err(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(serde_json::json!({"error": e.to_string()})))
                .into_response()
        }
    }
}

#[derive(serde::Deserialize)]
struct ModelQuery {
    model: Option<String>,
    version: Option<String>,
    /// `/models/rollout`: canary (default), shadow or ab; the steps as
    /// `5,25,100` and gate settings as `key=value,...`.
    mode: Option<String>,
    steps: Option<String>,
    gates: Option<String>,
}

fn rollout_error(e: &RolloutError) -> Response {
    let status = match e.code() {
        "unknown_model" => StatusCode::NOT_FOUND,
        "conflict" => StatusCode::CONFLICT,
        "invalid_payload" => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, axum::Json(serde_json::json!({"error": e.to_string()}))).into_response()
}

fn no_rollout() -> Response {
    let body = serde_json::json!({"error": "this process keeps no deployment state"});
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

async fn models_status(State(state): State<AppState>, Query(q): Query<ModelQuery>) -> Response {
    if state.engine.rollout().is_none() {
        return no_rollout();
    }
    match state.engine.models_report(q.model.as_deref()) {
        Ok(report) => axum::Json(report).into_response(),
        Err(e) => rollout_error(&e),
    }
}

async fn models_promote(State(state): State<AppState>, Query(q): Query<ModelQuery>) -> Response {
    let Some(rollout) = state.engine.rollout() else { return no_rollout() };
    let model = q.model.unwrap_or_default();
    let available = state.engine.registry().available();
    match rollout
        .promote(&model, q.version.as_deref(), available, Asker::named("models promote (http)"))
        .await
    {
        Ok(decision) => axum::Json(decision).into_response(),
        Err(e) => rollout_error(&e),
    }
}

async fn models_rollback(State(state): State<AppState>, Query(q): Query<ModelQuery>) -> Response {
    let Some(rollout) = state.engine.rollout() else { return no_rollout() };
    let model = q.model.unwrap_or_default();
    let available = state.engine.registry().available();
    match rollout.rollback(&model, available, Asker::named("models rollback (http)")).await {
        Ok(decision) => axum::Json(decision).into_response(),
        Err(e) => rollout_error(&e),
    }
}

/// `POST /models/rollout?model=M&version=V`, or with a config candidate
/// (TOML, at most `MAX_CHANGE_BYTES`) as the body and no version: a config
/// rollout on stable's version.
async fn models_rollout(State(state): State<AppState>, Query(q): Query<ModelQuery>, body: Body) -> Response {
    if state.engine.rollout().is_none() {
        return no_rollout();
    }
    let limit = crate::config::serving::MAX_CHANGE_BYTES;
    let read = tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, limit + 1)).await;
    let config = match read {
        Ok(Ok(bytes)) if bytes.is_empty() => None,
        Ok(Ok(bytes)) if bytes.len() <= limit => match String::from_utf8(bytes.to_vec()) {
            Ok(text) => Some(text),
            Err(_) => return rollout_error(&RolloutError::BadConfig("the body is not UTF-8 text".into())),
        },
        _ => {
            let why = format!("the body (a config candidate) is unreadable or over {limit} bytes");
            return rollout_error(&RolloutError::BadConfig(why));
        }
    };
    let model = q.model.unwrap_or_default();
    let overrides = (q.steps.as_deref(), q.gates.as_deref());
    let asked = (model.as_str(), q.version.as_deref(), config.as_deref());
    let by = Asker::named("models rollout (http)");
    match state.engine.start_rollout(asked, q.mode.as_deref(), overrides, by).await {
        Ok(decision) => axum::Json(decision).into_response(),
        Err(e) => rollout_error(&e),
    }
}

async fn scrape(State(state): State<AppState>) -> Response {
    match &state.metrics {
        Some(handle) => {
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::telemetry::render(handle))
                .into_response()
        }
        None => (StatusCode::NOT_FOUND, "metrics are not recorded in this process\n").into_response(),
    }
}

async fn ready(State(state): State<AppState>) -> Response {
    let models = !state.engine.serving().is_empty();
    let mqtt = *state.mqtt_ready.borrow();
    let body = axum::Json(
        serde_json::json!({"ready": models && mqtt, "models_loaded": models, "mqtt_connected": mqtt}),
    );
    let status = if models && mqtt { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, body).into_response()
}

#[derive(Serialize)]
struct TensorMetadata {
    name: String,
    datatype: &'static str,
    shape: Vec<i64>,
}

#[derive(Serialize)]
struct ModelMetadata {
    name: String,
    versions: Vec<String>,
    platform: &'static str,
    inputs: Vec<TensorMetadata>,
    outputs: Vec<TensorMetadata>,
    /// The deployment record: the version serving, and per version its
    /// files' hashes and when it was deployed, by what.
    #[serde(skip_serializing_if = "Option::is_none")]
    deployment: Option<Deployment>,
}

#[derive(Serialize)]
struct Deployment {
    serving: String,
    records: Vec<crate::rollout::VersionRecord>,
}

fn error_response(err: &InferError) -> Response {
    let status = StatusCode::from_u16(err.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, axum::Json(ErrorReply::new("", err))).into_response()
}

async fn metadata(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    let registry = state.engine.registry();
    // The inputs and outputs of the version that serves.
    let m = match state.engine.serving_model(&model) {
        Ok(m) => m,
        Err(e) => return error_response(&e),
    };
    let spec = |t: &crate::model::TensorSpec| TensorMetadata {
        name: t.name.clone(),
        datatype: t.datatype.as_str(),
        shape: t.shape.clone(),
    };
    axum::Json(ModelMetadata {
        name: m.name().to_string(),
        versions: registry.versions(m.name()),
        deployment: state.engine.rollout().and_then(|rollout| {
            let node = |model: &str| state.engine.node_serving(model);
            let report = rollout.current().report(
                &registry.available(),
                &registry.fingerprints(),
                Some(m.name()),
                &node,
            );
            let model = report.ok()?.into_iter().next()?;
            Some(Deployment { serving: model.serving, records: model.records })
        }),
        platform: "tract_onnx",
        inputs: vec![spec(&m.manifest.input)],
        outputs: m.manifest.outputs.iter().map(spec).collect(),
    })
    .into_response()
}

async fn model_ready(State(state): State<AppState>, Path(model): Path<String>) -> Response {
    match state.engine.serving_model(&model) {
        Ok(m) => axum::Json(serde_json::json!({"name": m.name(), "ready": true})).into_response(),
        Err(e) => error_response(&e),
    }
}

async fn infer(
    State(state): State<AppState>,
    Path(model): Path<String>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(&state, &model, None, peer, &headers, body).await
}

async fn infer_version(
    State(state): State<AppState>,
    Path((model, version)): Path<(String, String)>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(&state, &model, Some(&version), peer, &headers, body).await
}

/// The header a device names itself with, for a rollout's split.
const DEVICE_HEADER: &str = "x-device-id";
/// The longest `X-Device-Id` taken: a device's name, not a payload.
const DEVICE_ID_MAX_BYTES: usize = 128;

/// The device a request comes from: its `X-Device-Id`, else the peer's IP
/// address (not the port: a device that reconnects keeps its place in a
/// rollout). A header that cannot name a device (empty, too long, not
/// visible ASCII) is refused rather than ignored, so a device that means to
/// name itself is not quietly split by its address instead.
fn device_of(headers: &HeaderMap, peer: IpAddr) -> Result<String, InferError> {
    // `::ffff:10.0.0.9` and `10.0.0.9` are one device.
    let Some(value) = headers.get(DEVICE_HEADER) else { return Ok(peer.to_canonical().to_string()) };
    let named = value.to_str().ok().map(str::trim).filter(|v| !v.is_empty());
    match named {
        Some(device) if device.len() <= DEVICE_ID_MAX_BYTES => Ok(device.to_string()),
        _ => Err(InferError::invalid_payload(format!(
            "X-Device-Id must be 1 to {DEVICE_ID_MAX_BYTES} bytes of visible ASCII; \
             send the device's name, or leave the header out to be known by your address"
        ))),
    }
}

async fn handle(
    state: &AppState,
    model: &str,
    version: Option<&str>,
    peer: SocketAddr,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let encoding = Encoding::from_content_type(content_type);
    let limit = state.engine.max_payload_bytes();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let trace = crate::trace::Caller { traceparent: header("traceparent"), tracestate: header("tracestate") };
    let envelope = Envelope { version, transport: "http", trace, ..Envelope::model(model) };
    let device = match device_of(headers, peer.ip()) {
        Ok(device) => device,
        Err(e) => {
            return reply_response(state.engine.reject(envelope, String::new(), encoding, e), None, encoding);
        }
    };
    let envelope = Envelope { device: Some(&device), ..envelope };
    let mut status = None;
    let reply = match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => state.engine.handle(envelope, &bytes, encoding).await,
        Ok(Err(_)) => state.engine.reject(
            envelope,
            String::new(),
            encoding,
            InferError::too_large(format!(
                "the request body is larger than limits.max_payload_bytes = {limit}; send fewer rows per request"
            )),
        ),
        Err(_) => {
            status = Some(StatusCode::REQUEST_TIMEOUT);
            let waited = state.body_timeout.as_millis();
            state.engine.reject(
                envelope,
                String::new(),
                encoding,
                InferError::invalid_payload(format!(
                    "the request body did not arrive within http.body_timeout_ms = {waited}; send it at once"
                )),
            )
        }
    };
    reply_response(reply, status, encoding)
}

/// `POST /v2/feedback`: 200 with what became of it (joined, or why not),
/// or the error reply naming the field and the fix.
async fn feedback(State(state): State<AppState>, body: Body) -> Response {
    use crate::engine::feedback::{self, MAX_MESSAGE_BYTES};
    let bytes = match tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, MAX_MESSAGE_BYTES))
        .await
    {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => {
            feedback::refused("invalid");
            let message =
                format!("feedback larger than {MAX_MESSAGE_BYTES} bytes: send id, label or outcome, weight");
            return error_response(&InferError::too_large(message));
        }
        Err(_) => {
            let waited = state.body_timeout.as_millis();
            let message =
                format!("the body did not arrive within http.body_timeout_ms = {waited}; send it at once");
            return error_response(&InferError::invalid_payload(message));
        }
    };
    match state.engine.take_feedback(&bytes, feedback::Addressed::Node).await {
        Ok((id, joined)) => axum::Json(feedback::reply_body(&id, &joined)).into_response(),
        Err((id, err)) => {
            let status =
                StatusCode::from_u16(err.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, axum::Json(ErrorReply::new(id, &err))).into_response()
        }
    }
}

/// The engine's reply with the status its outcome calls for, unless the
/// transport already chose one.
fn reply_response(reply: crate::engine::Reply, status: Option<StatusCode>, encoding: Encoding) -> Response {
    let status = status.unwrap_or(match reply.outcome {
        Ok(()) => StatusCode::OK,
        Err(code) => StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    });
    let mut response =
        (status, [(header::CONTENT_TYPE, encoding.content_type())], reply.payload).into_response();
    // The device can log the trace its request joined.
    if let Some(trace) = &reply.trace
        && let Ok(value) = header::HeaderValue::from_str(&trace.traceresponse())
    {
        response.headers_mut().insert("traceresponse", value);
    }
    response
}
