//! The HTTP listener: hyper's HTTP/1 server, one task per connection, with
//! a bound on connections, a header-read timeout (which also closes idle
//! keep-alive connections) and optional TLS.

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tower_service::Service;

/// How the listener treats connections.
pub struct Listener {
    pub tcp: tokio::net::TcpListener,
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Connections served at once; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// The longest a request's headers (or a TLS handshake) may take, and
    /// an idle connection may stay open.
    pub header_timeout: Duration,
    /// The longest one connection lives (a client that stops reading an
    /// answer would otherwise hold its slot); clients reconnect.
    pub connection_lifetime: Duration,
}

/// Serves until `shutdown` resolves, then lets requests in progress finish
/// (at most 2 s).
pub async fn serve(listener: Listener, router: Router, shutdown: impl Future<Output = ()>) {
    let permits = Arc::new(Semaphore::new(listener.max_connections));
    let tls = listener.tls.map(tokio_rustls::TlsAcceptor::from);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let permit = match permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                metrics::counter!(crate::telemetry::HTTP_CONNECTIONS_WAITED).increment(1);
                tokio::select! {
                    _ = &mut shutdown => break,
                    permit = permits.clone().acquire_owned() => permit.expect("never closed"),
                }
            }
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.tcp.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: wait instead of spinning.
                    tracing::warn!("HTTP accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                router.clone().call(request.map(axum::body::Body::new))
            });
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new()).header_read_timeout(listener.header_timeout);
        let header_timeout = listener.header_timeout;
        let lifetime = listener.connection_lifetime;
        match &tls {
            None => {
                let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
                tokio::spawn(async move {
                    // A client that stops reading its answer holds no slot for ever.
                    let _ = tokio::time::timeout(lifetime, connection).await;
                    drop(permit);
                });
            }
            Some(tls) => {
                let tls = tls.clone();
                let watcher = graceful.watcher();
                tokio::spawn(async move {
                    match tokio::time::timeout(header_timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let connection =
                                watcher.watch(http.serve_connection(TokioIo::new(stream), service));
                            let _ = tokio::time::timeout(lifetime, connection).await;
                        }
                        Ok(Err(e)) => tracing::debug!("HTTP TLS handshake from {peer}: {e}"),
                        Err(_) => tracing::debug!("HTTP TLS handshake from {peer}: timed out"),
                    }
                    drop(permit);
                });
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), graceful.shutdown()).await;
}
