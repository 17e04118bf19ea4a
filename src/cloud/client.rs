//! One Open Inference Protocol call: `POST {url}/v2/models/{model}/infer`,
//! JSON both ways, over http or https (rustls) on a pooled connection.

use super::CloudError;
use crate::protocol::{InferRequest, InferResponse};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use std::time::Duration;

/// Larger answers than this are refused rather than buffered.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

pub struct Http {
    base: String,
    /// `Bearer TOKEN`, ready for the header.
    authorization: Option<String>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl Http {
    pub fn new(
        base: &str,
        token: Option<&crate::config::Secret>,
        tls: rustls::ClientConfig,
        connect_timeout: Duration,
    ) -> Http {
        let client = crate::tls::https_client(tls, connect_timeout);
        Http {
            base: base.trim_end_matches('/').to_string(),
            authorization: token.map(|t| format!("Bearer {}", t.0)),
            client,
        }
    }

    pub fn url(&self, model: &str) -> String {
        format!("{}/v2/models/{model}/infer", self.base)
    }

    /// One attempt, without a timeout of its own (the caller's bounds it);
    /// `traceparent` continues the request's trace on the cloud tier.
    pub async fn infer(
        &self,
        model: &str,
        request: &InferRequest,
        traceparent: Option<String>,
    ) -> Result<InferResponse, CloudError> {
        let url = self.url(model);
        let body = serde_json::to_vec(request).map_err(|e| CloudError::Invalid(e.to_string()))?;
        let mut builder = hyper::Request::post(&url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "application/json");
        if let Some(auth) = &self.authorization {
            builder = builder.header(hyper::header::AUTHORIZATION, auth);
        }
        if let Some(traceparent) = traceparent {
            builder = builder.header("traceparent", traceparent);
        }
        let request =
            builder.body(Full::new(Bytes::from(body))).map_err(|e| CloudError::Invalid(e.to_string()))?;
        let response = self
            .client
            .request(request)
            .await
            .map_err(|e| CloudError::Unreachable { url: url.clone(), reason: error_chain(&e) })?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| CloudError::Unreachable { url: url.clone(), reason: e.to_string() })?
            .to_bytes();
        if !status.is_success() {
            let text: String = String::from_utf8_lossy(&body).chars().take(300).collect();
            return Err(CloudError::Status { url, status: status.as_u16(), body: text });
        }
        serde_json::from_slice(&body).map_err(|e| CloudError::Invalid(format!("{url}: {e}")))
    }
}

/// hyper's errors say "client error (Connect)"; the cause says why.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
