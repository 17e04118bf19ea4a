//! The cloud tier: any Open Inference Protocol server, reached only when
//! `[cloud] enabled = true`. Calls are bounded (concurrency, the request's
//! deadline), retried with jitter while time remains, and kept off a dead
//! uplink by a circuit breaker. Async escalations wait in the spool.

mod breaker;
mod client;
pub mod spool;

pub use breaker::State as BreakerState;
pub use spool::{Settled, Spool, SpoolEntry};

use crate::config::Config;
use crate::protocol::{InferRequest, InferResponse, RequestParameters, Tier};
use crate::telemetry;
use breaker::Breaker;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum CloudError {
    #[error("the cloud tier failed repeatedly; its circuit breaker is open (next try in {0} ms)")]
    BreakerOpen(u64),
    #[error("the deadline left no time to ask the cloud tier")]
    NoTime,
    #[error("cloud.max_concurrency calls to the cloud tier are already in flight")]
    Busy,
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("the cloud tier did not answer in time")]
    Timeout,
    #[error("{url} answered HTTP {status}: {body}")]
    Status { url: String, status: u16, body: String },
    #[error("the cloud tier's answer is not an Open Inference Protocol response: {0}")]
    Invalid(String),
    #[error("cloud setup: {0}")]
    Setup(String),
}

impl CloudError {
    /// Worth another attempt: the network or the server, not the request.
    /// These are also what the circuit breaker counts as failures (any other
    /// answer proves the uplink works).
    pub(crate) fn retryable(&self) -> bool {
        match self {
            CloudError::Unreachable { .. } | CloudError::Timeout => true,
            CloudError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }

    fn outcome(&self) -> &'static str {
        match self {
            CloudError::BreakerOpen(_) => "breaker_open",
            CloudError::NoTime => "no_time",
            CloudError::Busy => "busy",
            CloudError::Unreachable { .. } => "unreachable",
            CloudError::Timeout => "timeout",
            CloudError::Status { .. } => "http_error",
            CloudError::Invalid(_) | CloudError::Setup(_) => "invalid",
        }
    }
}

#[derive(Debug, Clone)]
pub struct CloudOptions {
    pub url: String,
    /// Redacted in `Debug`.
    pub token: Option<crate::config::Secret>,
    pub ca_file: Option<std::path::PathBuf>,
    pub connect_timeout: Duration,
    pub timeout: Duration,
    pub max_concurrency: usize,
    pub retries: u32,
    pub breaker_failures: u32,
    pub breaker_open: Duration,
    pub reserve: Duration,
    pub fallback: bool,
}

impl CloudOptions {
    /// `None` unless `cloud.enabled`: then nothing is built that could connect.
    pub fn from_config(config: &Config) -> Result<Option<CloudOptions>, CloudError> {
        let c = &config.cloud;
        if !c.enabled {
            return Ok(None);
        }
        let token = match (&c.token, &c.token_file) {
            (Some(t), _) => Some(t.0.trim().to_string()),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    CloudError::Setup(format!("cloud.token_file = {}: cannot read: {e}", path.display()))
                })?;
                Some(text.trim().to_string())
            }
            (None, None) => None,
        };
        let token = token.filter(|t| !t.is_empty()).map(crate::config::Secret);
        Ok(Some(CloudOptions {
            url: c.url.clone(),
            token,
            ca_file: c.ca_file.clone(),
            connect_timeout: Duration::from_millis(c.connect_timeout_ms),
            timeout: Duration::from_millis(c.timeout_ms),
            max_concurrency: c.max_concurrency,
            retries: c.retries,
            breaker_failures: c.breaker_failures,
            breaker_open: Duration::from_millis(c.breaker_open_ms),
            reserve: Duration::from_millis(c.reserve_ms),
            fallback: c.fallback,
        }))
    }
}

pub struct Cloud {
    http: client::Http,
    breaker: Breaker,
    permits: tokio::sync::Semaphore,
    pub options: CloudOptions,
}

impl Cloud {
    pub fn new(options: CloudOptions) -> Result<Cloud, CloudError> {
        let https = options.url.starts_with("https://");
        let tls = crate::tls::client_config("cloud.ca_file", options.ca_file.as_deref(), None, https)
            .map_err(|e| CloudError::Setup(e.to_string()))?;
        let http = client::Http::new(&options.url, options.token.as_ref(), tls, options.connect_timeout);
        metrics::gauge!(telemetry::CLOUD_BREAKER).set(BreakerState::Closed.gauge());
        Ok(Cloud {
            http,
            breaker: Breaker::new(options.breaker_failures, options.breaker_open),
            permits: tokio::sync::Semaphore::new(options.max_concurrency),
            options,
        })
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    /// How long until the breaker lets a probe through (zero unless open).
    pub fn retry_in(&self) -> Duration {
        self.breaker.retry_in(Instant::now())
    }

    /// Asks `cloud_model` for `req`'s answer by `deadline` (or within
    /// `cloud.timeout_ms` without one), retrying while time remains.
    /// `edge_model` labels the metrics.
    pub async fn infer(
        &self,
        edge_model: &str,
        cloud_model: &str,
        req: &InferRequest,
        deadline: Option<Instant>,
    ) -> Result<InferResponse, CloudError> {
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.options.timeout);
        let mut attempt = 0;
        loop {
            let result = self.attempt(edge_model, cloud_model, req, deadline).await;
            metrics::counter!(
                telemetry::CLOUD_REQUESTS,
                "model" => edge_model.to_string(),
                "outcome" => result.as_ref().map(|_| "ok").unwrap_or_else(|e| e.outcome())
            )
            .increment(1);
            let error = match result {
                Ok(response) => return Ok(response),
                Err(e) => e,
            };
            if !error.retryable() || attempt >= self.options.retries {
                return Err(error);
            }
            // Full jitter over a doubling ceiling, so a fleet does not retry in step.
            let ceiling = Duration::from_millis(20).saturating_mul(1 << attempt.min(10));
            let pause = ceiling.mul_f64(fastrand::f64());
            if Instant::now() + pause + Duration::from_millis(1) >= deadline {
                return Err(error);
            }
            tokio::time::sleep(pause).await;
            attempt += 1;
        }
    }

    async fn attempt(
        &self,
        edge_model: &str,
        cloud_model: &str,
        req: &InferRequest,
        deadline: Instant,
    ) -> Result<InferResponse, CloudError> {
        let now = Instant::now();
        let Some(left) = deadline.checked_duration_since(now).filter(|d| !d.is_zero()) else {
            return Err(CloudError::NoTime);
        };
        // Dropped without a report (Busy below, or this future dropped by
        // the request's deadline), an admitted probe is abandoned.
        let admitted = self.breaker.permit(now);
        if admitted.refused() {
            return Err(CloudError::BreakerOpen(self.breaker.retry_in(now).as_millis() as u64));
        }
        let Ok(_permit) = self.permits.try_acquire() else {
            return Err(CloudError::Busy);
        };
        let body = cloud_request(req, left);
        let started = Instant::now();
        // A span of the request's trace, which the cloud tier continues.
        let mut traced = crate::trace::outgoing("cloud.call");
        let traceparent = traced.as_ref().map(crate::trace::Open::traceparent);
        let result = match tokio::time::timeout(left, self.http.infer(cloud_model, &body, traceparent)).await
        {
            Ok(r) => r,
            Err(_) => Err(CloudError::Timeout),
        };
        if let Some(span) = &mut traced {
            span.set(opentelemetry::KeyValue::new("edgeinfer.cloud.model", cloud_model.to_string()));
            let outcome = result.as_ref().map(|_| "ok").unwrap_or_else(|e| e.outcome());
            span.set(opentelemetry::KeyValue::new("edgeinfer.cloud.outcome", outcome));
            span.error = result.as_ref().err().map(CloudError::to_string);
        }
        metrics::histogram!(telemetry::CLOUD_LATENCY, "model" => edge_model.to_string())
            .record(started.elapsed().as_secs_f64());
        let failed = result.as_ref().err().is_some_and(CloudError::retryable);
        if let Some(state) = admitted.report(!failed, Instant::now()) {
            metrics::gauge!(telemetry::CLOUD_BREAKER).set(state.gauge());
            match state {
                BreakerState::Open => tracing::warn!(
                    "cloud tier {}: circuit breaker open after {} failures ({}); retrying in {} ms",
                    self.options.url,
                    self.options.breaker_failures,
                    result.as_ref().err().map(|e| e.to_string()).unwrap_or_default(),
                    self.options.breaker_open.as_millis()
                ),
                BreakerState::Closed => tracing::info!("cloud tier {}: reachable again", self.options.url),
                BreakerState::HalfOpen => {}
            }
        }
        result
    }
}

/// What the cloud is asked: the device's request as it came (the cloud
/// model does its own preprocessing), answered by its own edge tier only
/// (another edgeinfer must not escalate further), within the time left.
fn cloud_request(req: &InferRequest, left: Duration) -> InferRequest {
    InferRequest {
        id: req.id.clone(),
        reply_to: None,
        inputs: req.inputs.clone(),
        outputs: req.outputs.clone(),
        parameters: RequestParameters {
            tier: Some(Tier::Fast),
            deadline_ms: Some(left.as_millis().max(1) as u64),
            cache: req.parameters.cache,
            top_k: req.parameters.top_k,
            model_version: None,
            enrich: None,
        },
    }
}
