//! The session on a socket: the only part of it that touches the network
//! or the clock. Each wakeup reads what the socket has, fires the timers
//! that are due, and writes everything the session has ready from one
//! buffer, so a burst of replies and acknowledgements costs one write, not
//! one per packet.
//!
//! `next` is cancel safe (the owner selects on it beside its channels):
//! a write cut short keeps its unwritten bytes in the buffer, a read
//! either happened whole or not at all.

use super::{Closed, Event, Session};
use bytes::BytesMut;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

/// What a connection runs over: TCP, or TLS on it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Bytes a read takes from the socket at most: one wakeup's worth.
const READ_CHUNK: usize = 64 << 10;

/// Packets the session may hold for a write before the driver stops
/// reading (a broker that does not read cannot grow them past it).
const MAX_QUEUED: usize = 4096;

/// How long the DISCONNECT that says why may take to write.
const GOODBYE_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(200);

pub struct Driver {
    session: Session,
    host: String,
    port: u16,
    tls: Option<Arc<rustls::ClientConfig>>,
    read: Option<ReadHalf<Box<dyn Io>>>,
    write: Option<WriteHalf<Box<dyn Io>>>,
    read_buf: BytesMut,
    write_buf: BytesMut,
    writes: u64,
}

impl Driver {
    /// A driver for `session` to the broker at `host`:`port`, over TLS
    /// with `tls`.
    pub fn new(session: Session, host: String, port: u16, tls: Option<Arc<rustls::ClientConfig>>) -> Driver {
        Driver {
            session,
            host,
            port,
            tls,
            read: None,
            write: None,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::new(),
            writes: 0,
        }
    }

    /// The session, to publish, subscribe and acknowledge through; what it
    /// queues goes at the next `next`.
    pub fn session(&mut self) -> &mut Session {
        &mut self.session
    }

    /// Writes to the socket so far (each one buffer of packets).
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// CONNACK heard on the open connection.
    pub fn is_connected(&self) -> bool {
        self.session.is_connected()
    }

    pub fn is_open(&self) -> bool {
        self.write.is_some()
    }

    /// Opens a connection (TCP with Nagle off, then TLS for mqtts) and
    /// queues the CONNECT; the CONNACK comes through `next`. On an error
    /// the caller waits (`Backoff`) and tries again.
    pub async fn connect(&mut self) -> std::io::Result<()> {
        self.close();
        let timeout = self.session.connect_timeout();
        let connecting = TcpStream::connect((self.host.as_str(), self.port));
        let tcp = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no TCP connection in time"))??;
        // Nagle against delayed ACKs costs 44-88 ms a request (shared/PRODUCT.md).
        tcp.set_nodelay(true)?;
        let io: Box<dyn Io> = match &self.tls {
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                let handshake = tokio_rustls::TlsConnector::from(config.clone()).connect(name, tcp);
                let tls = tokio::time::timeout(timeout, handshake).await.map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "no TLS handshake in time")
                })??;
                Box::new(tls)
            }
            None => Box::new(tcp),
        };
        let (read, write) = tokio::io::split(io);
        (self.read, self.write) = (Some(read), Some(write));
        self.session.connect(Instant::now());
        Ok(())
    }

    /// Runs the connection until the session has something to say; with
    /// no connection open, says so (`Closed::Lost`): the caller connects.
    pub async fn next(&mut self) -> Event {
        loop {
            if let Some(event) = self.session.poll_event() {
                if let Event::Closed(_) = event {
                    self.goodbye().await;
                }
                return event;
            }
            if self.write.is_none() {
                return Event::Closed(Closed::Lost("not connected"));
            }
            // One buffer at a time: what waits meanwhile stays in the
            // session, where an acknowledgement a dropped connection never
            // carried is known to be owed (bytes handed to the socket are
            // as good as written: the session cannot tell them from those
            // the network lost).
            if self.write_buf.is_empty() {
                self.session.poll_transmit(&mut self.write_buf);
            }
            let deadline = self.session.poll_timeout().map(tokio::time::Instant::from_std);
            let (Some(read), Some(write)) = (self.read.as_mut(), self.write.as_mut()) else { continue };
            let wants_write = !self.write_buf.is_empty();
            let may_read = self.session.queued() < MAX_QUEUED;
            tokio::select! {
                written = write.write_buf(&mut self.write_buf), if wants_write => match written {
                    Ok(0) | Err(_) => return self.lost("the write failed"),
                    Ok(n) => {
                        self.writes += 1;
                        self.session.wrote(Instant::now(), n);
                    }
                },
                read = read.read_buf(&mut self.read_buf), if may_read => match read {
                    Ok(0) => return self.lost("the broker closed the connection"),
                    Err(_) => return self.lost("the read failed"),
                    Ok(_) => {
                        self.session.handle_read(Instant::now(), &self.read_buf);
                        self.read_buf.clear();
                    }
                },
                _ = sleep_until(deadline) => self.session.handle_timeout(Instant::now()),
            }
        }
    }

    /// Closes the connection the session gave up on, writing only the
    /// DISCONNECT that says why (briefly: the peer may be gone). What else
    /// waits stays in the session: an acknowledgement not written is owed.
    /// The socket is dropped first, so a cancelled write leaves nothing.
    async fn goodbye(&mut self) {
        let mut bytes = BytesMut::new();
        self.session.poll_goodbye(&mut bytes);
        let write = self.write.take();
        self.close();
        if let Some(mut write) = write.filter(|_| !bytes.is_empty()) {
            let _ = tokio::time::timeout(GOODBYE_TIMEOUT, write.write_all(&bytes)).await;
        }
    }

    /// Writes everything the session has ready, reading nothing (a node's
    /// last words before it disconnects).
    pub async fn flush(&mut self) {
        loop {
            if self.write_buf.is_empty() {
                self.session.poll_transmit(&mut self.write_buf);
            }
            let Some(write) = self.write.as_mut().filter(|_| !self.write_buf.is_empty()) else { return };
            match write.write_buf(&mut self.write_buf).await {
                Ok(0) | Err(_) => return self.close(),
                Ok(n) => {
                    self.writes += 1;
                    self.session.wrote(Instant::now(), n);
                }
            }
        }
    }

    /// Leaves the broker cleanly (DISCONNECT, so no will is published)
    /// and closes the connection.
    pub async fn disconnect(&mut self) {
        self.session.disconnect();
        self.goodbye().await;
    }

    fn lost(&mut self, why: &'static str) -> Event {
        self.close();
        Event::Closed(Closed::Lost(why))
    }

    /// Drops the socket; the session keeps its publishes for the next one.
    pub fn close(&mut self) {
        (self.read, self.write) = (None, None);
        self.read_buf.clear();
        self.write_buf.clear();
        self.session.handle_closed();
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
