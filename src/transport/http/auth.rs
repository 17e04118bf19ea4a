//! Who may call what over HTTP: bearer tokens read from files, one for
//! inference and metadata (`http.token_file`) and one for administration
//! (`http.admin_token_file`). Health is always open; `/metrics` is open
//! unless `http.protect_metrics`. Without an admin token, status and cache
//! administration is answered to a loopback peer, but rollout commands are
//! refused: `ssh -L`, socat and a reverse proxy on the host are loopback
//! peers too, and a rollout command changes what every device is answered.

use crate::config::HttpConfig;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("{key} = {path}: cannot read: {source}")]
    Read { key: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{key} = {path}: the file is empty; put the token on its first line")]
    Empty { key: &'static str, path: PathBuf },
}

/// A token kept only as its SHA-256, so comparing takes the same time
/// whatever the guess (and the token itself is not kept in memory). The
/// MQTT control topic uses it too.
#[derive(Clone, PartialEq)]
pub struct Token([u8; 32]);

impl Token {
    pub fn of(text: &str) -> Token {
        Token(Sha256::digest(text.as_bytes()).into())
    }

    pub fn read(key: &'static str, path: &PathBuf) -> Result<Token, AccessError> {
        let text = std::fs::read_to_string(path).map_err(|source| AccessError::Read {
            key,
            path: path.clone(),
            source,
        })?;
        let token = text.lines().next().unwrap_or_default().trim();
        if token.is_empty() {
            return Err(AccessError::Empty { key, path: path.clone() });
        }
        Ok(Token::of(token))
    }
}

/// The tokens in force.
#[derive(Clone)]
pub struct Access {
    infer: Option<Token>,
    admin: Option<Token>,
    protect_metrics: bool,
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Open,
    Infer,
    /// Status and cache: the admin token, or without one a loopback peer.
    Admin,
    /// What changes which version serves: the admin token, always.
    Deploy,
}

impl Access {
    pub fn from_config(config: &HttpConfig) -> Result<Access, AccessError> {
        let read = |key, file: &Option<PathBuf>| file.as_ref().map(|p| Token::read(key, p)).transpose();
        Ok(Access {
            infer: read("http.token_file", &config.token_file)?,
            admin: read("http.admin_token_file", &config.admin_token_file)?,
            protect_metrics: config.protect_metrics,
        })
    }

    fn class(&self, path: &str) -> Class {
        if path.starts_with("/v2/health/") {
            Class::Open
        } else if path == "/metrics" {
            match (self.protect_metrics, &self.infer) {
                (false, _) => Class::Open,
                (true, Some(_)) => Class::Infer,
                // Protected with only the admin token configured.
                (true, None) => Class::Admin,
            }
        } else if path.starts_with("/cache/") || path == "/models/status" {
            Class::Admin
        } else if path.starts_with("/models/") {
            // promote, rollback, rollout, and any command added later.
            Class::Deploy
        } else {
            Class::Infer
        }
    }

    /// `None` when the request may go on, else the refusal.
    fn check(&self, path: &str, headers: &HeaderMap, peer: SocketAddr) -> Option<Response> {
        let presented = bearer(headers).map(Token::of);
        let admin_ok = self.admin.is_some() && presented == self.admin;
        match self.class(path) {
            Class::Open => None,
            Class::Infer => match &self.infer {
                None => None,
                Some(token) if presented.as_ref() == Some(token) || admin_ok => None,
                Some(_) => Some(unauthorized("send Authorization: Bearer with the token in http.token_file")),
            },
            Class::Admin => match &self.admin {
                Some(_) if admin_ok => None,
                Some(_) => {
                    Some(unauthorized("send Authorization: Bearer with the token in http.admin_token_file"))
                }
                // `::ffff:127.0.0.1` too, when listening on `[::]`.
                None if peer.ip().to_canonical().is_loopback() && !proxied(headers) => None,
                None => Some(forbidden(peer)),
            },
            Class::Deploy => match &self.admin {
                Some(_) if admin_ok => None,
                Some(_) => {
                    Some(unauthorized("send Authorization: Bearer with the token in http.admin_token_file"))
                }
                None => Some(no_admin_token()),
            },
        }
    }
}

/// The middleware: refuses what `access` does not allow.
pub async fn guard(
    State(access): State<Arc<Access>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    match access.check(request.uri().path(), request.headers(), peer) {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// A reverse proxy on this host makes every peer look local: its headers
/// give it away.
fn proxied(headers: &HeaderMap) -> bool {
    ["forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip"].iter().any(|h| headers.contains_key(*h))
}

fn unauthorized(fix: &str) -> Response {
    let body = serde_json::json!({"error": format!("missing or wrong bearer token: {fix}")});
    (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], axum::Json(body)).into_response()
}

fn forbidden(peer: SocketAddr) -> Response {
    let body = serde_json::json!({"error": format!(
        "{peer}: without http.admin_token_file, administration (cache, models status) is answered only to a loopback \
         peer that did not come through a proxy; run edgeinfer cache or models on the node itself, or set \
         http.admin_token_file"
    )});
    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
}

fn no_admin_token() -> Response {
    let body = serde_json::json!({"error": NO_ADMIN_TOKEN});
    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
}

/// Why rollout commands are refused without an admin token, and the fix.
const NO_ADMIN_TOKEN: &str = "rollout commands over HTTP (models promote, rollback, rollout) need the token in \
     http.admin_token_file, and none is set: a loopback peer may be anyone reaching this host through ssh -L, \
     socat or a proxy. Set http.admin_token_file (edgeinfer models sends the token from its --config); with no \
     node running, edgeinfer models changes the state file in node.state_dir itself";

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn tokens_guard_inference_and_administration_and_loopback_needs_no_proxy_header() {
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let remote: SocketAddr = "10.0.0.9:5000".parse().unwrap();
        let status = |a: &Access, path: &str, h: &[(&str, &str)], peer| {
            a.check(path, &headers(h), peer).map_or(200, |r| r.status().as_u16())
        };
        let open = Access { infer: None, admin: None, protect_metrics: false };
        assert_eq!(status(&open, "/v2/models/digits/infer", &[], remote), 200);
        assert_eq!(status(&open, "/cache/purge", &[], local), 200);
        assert_eq!(status(&open, "/cache/purge", &[], remote), 403);
        assert_eq!(status(&open, "/cache/purge", &[("x-forwarded-for", "10.0.0.9")], local), 403);
        assert_eq!(status(&open, "/models/status", &[], local), 200);
        assert_eq!(status(&open, "/models/status", &[], remote), 403);

        let closed =
            Access { infer: Some(Token::of("inf")), admin: Some(Token::of("adm")), protect_metrics: true };
        assert_eq!(status(&closed, "/v2/models/digits/infer", &[], local), 401);
        assert_eq!(
            status(&closed, "/v2/models/digits/infer", &[("authorization", "Bearer inf")], remote),
            200
        );
        assert_eq!(status(&closed, "/v2/models/digits", &[("authorization", "bearer adm")], remote), 200);
        assert_eq!(status(&closed, "/v2/models/digits", &[("authorization", "Bearer nope")], remote), 401);
        assert_eq!(status(&closed, "/cache/stats", &[("authorization", "Bearer inf")], local), 401);
        assert_eq!(status(&closed, "/cache/stats", &[("authorization", "Bearer adm")], remote), 200);
        assert_eq!(status(&closed, "/models/promote", &[("authorization", "Bearer inf")], local), 401);
        assert_eq!(status(&closed, "/models/promote", &[("authorization", "Bearer adm")], remote), 200);
        assert_eq!(status(&closed, "/models/status", &[], local), 401, "a token set is needed by all");
        assert_eq!(status(&closed, "/metrics", &[], local), 401);
        let admin_only = Access { infer: None, admin: Some(Token::of("adm")), protect_metrics: true };
        assert_eq!(status(&admin_only, "/metrics", &[], local), 401, "protected by the admin token");
        assert_eq!(status(&admin_only, "/metrics", &[("authorization", "Bearer adm")], remote), 200);
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5000".parse().unwrap();
        assert_eq!(status(&open, "/cache/stats", &[], mapped), 200, "loopback over an IPv6 listener");
        assert_eq!(status(&closed, "/v2/health/ready", &[], remote), 200);
    }

    #[test]
    fn without_an_admin_token_rollout_commands_are_refused_even_to_loopback() {
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let open = Access { infer: None, admin: None, protect_metrics: false };
        for path in ["/models/promote", "/models/rollback", "/models/rollout", "/models/anything"] {
            let refused = open.check(path, &headers(&[]), local).map(|r| r.status().as_u16());
            assert_eq!(refused, Some(403), "{path}");
        }
        let closed = Access { infer: None, admin: Some(Token::of("adm")), protect_metrics: false };
        let with = |h: &[(&str, &str)]| closed.check("/models/rollout", &headers(h), local);
        assert!(with(&[("authorization", "Bearer adm")]).is_none());
        assert_eq!(with(&[]).map(|r| r.status().as_u16()), Some(401));
    }
}
