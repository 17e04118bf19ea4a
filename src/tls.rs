//! rustls settings: the client side shared by the MQTT connection, the
//! cloud tier and the trace exporter (the system's roots or a PEM bundle),
//! their pooled HTTP client, and the HTTP listener's server side; one
//! crypto stack (ring).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key} = {path}: {why}")]
    Pem { key: &'static str, path: PathBuf, why: String },
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// A client certificate and key for mutual TLS, with the config keys that named them.
pub struct Identity<'a> {
    pub cert_key: &'static str,
    pub cert: &'a Path,
    pub key_key: &'static str,
    pub key: &'a Path,
}

/// Trusts `ca_file` (named by config key `ca_key`) or, without one, the
/// system's roots; `require_roots`: finding none is an error (a client that
/// will only speak plain TCP passes false).
pub fn client_config(
    ca_key: &'static str,
    ca_file: Option<&Path>,
    identity: Option<Identity<'_>>,
    require_roots: bool,
) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in read_certs(ca_key, path)? {
                roots.add(cert).map_err(|e| TlsError::Pem {
                    key: ca_key,
                    path: path.into(),
                    why: e.to_string(),
                })?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    if roots.is_empty() && require_roots {
        return Err(TlsError::Setup(format!(
            "no CA certificates: set {ca_key} to the PEM bundle that signed the server's certificate"
        )));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_root_certificates(roots);
    Ok(match identity {
        Some(id) => {
            let chain = read_certs(id.cert_key, id.cert)?;
            let key = read_key(id.key_key, id.key)?;
            builder.with_client_auth_cert(chain, key).map_err(|e| TlsError::Setup(e.to_string()))?
        }
        None => builder.with_no_client_auth(),
    })
}

/// The HTTP listener's certificate chain and key (`http.tls_cert_file`,
/// `http.tls_key_file`).
pub fn server_config(identity: Identity<'_>) -> Result<rustls::ServerConfig, TlsError> {
    let chain = read_certs(identity.cert_key, identity.cert)?;
    let key = read_key(identity.key_key, identity.key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Setup(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Setup(format!("{}: {e}", identity.cert_key)))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

fn read_key(key: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        key,
        path: path.into(),
        why: format!("no PEM private key ({e})"),
    })
}

fn read_certs(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |why: String| TlsError::Pem { key, path: path.into(), why };
    let certs: Result<Vec<_>, _> =
        CertificateDer::pem_file_iter(path).map_err(|e| pem(e.to_string()))?.collect();
    let certs = certs.map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// A pooled HTTP/1 client for http and https URLs on `tls` (the cloud
/// tier's, the trace exporter's): no Nagle delay, connections kept a minute.
pub fn https_client(
    tls: rustls::ClientConfig,
    connect_timeout: std::time::Duration,
) -> hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Full<bytes::Bytes>,
> {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(std::time::Duration::from_secs(60))
        .build(https)
}
