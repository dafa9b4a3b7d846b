//! Connections from the daemon to a guest's TCP port (preview URLs,
//! issue #26): the daemon dials the guest, the guest never the daemon.
//!
//! A socket belongs to the network namespace it was made in, so one
//! thread per session (`guest-conn-<id>`) lives in the session namespace
//! under the `Proxy` seccomp filter and makes them: callers anywhere in
//! the daemon send it a port and get a connected `TcpStream` back, which
//! they then use from their own thread (no thread but this one enters the
//! namespace). It is started on the first request and ends when the last
//! handle to it is gone.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{netns, NetError, Result};

/// The longest a connect to the guest may take: on the TAP, a listening
/// port answers at once and a closed one resets at once.
pub const MAX_CONNECT: Duration = Duration::from_secs(3);

type Ask = (u16, Duration, Sender<io::Result<TcpStream>>);

/// A handle to a session's guest connector (cheap to clone).
#[derive(Clone)]
pub struct GuestConnector {
    id: String,
    tx: Sender<Ask>,
}

impl std::fmt::Debug for GuestConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GuestConnector({})", self.id)
    }
}

impl GuestConnector {
    /// The connector of session `id`, whose namespace is `ns` and guest
    /// `guest`.
    pub(super) fn start(id: &str, ns: &File, guest: Ipv4Addr) -> Result<GuestConnector> {
        let ns = ns
            .try_clone()
            .map_err(|e| NetError::io(format!("session {id}: dup netns fd"), e))?;
        // Asks wait here while one connect runs (at most MAX_CONNECT).
        let (tx, rx) = bounded::<Ask>(64);
        let sid = id.to_string();
        std::thread::Builder::new()
            .name(format!("guest-conn-{id}"))
            .spawn(move || {
                if let Err(e) = netns::enter(&ns, "session netns") {
                    log::error!("session {sid}: guest connector: {e}");
                    return;
                }
                drop(ns);
                if let Err(e) = crate::harden::install_current(crate::harden::ThreadKind::Proxy) {
                    log::error!("session {sid}: guest connector: {e}");
                    return;
                }
                serve(&rx, guest);
            })
            .map_err(|e| NetError::io(format!("session {id}: spawn guest connector"), e))?;
        Ok(GuestConnector {
            id: id.to_string(),
            tx,
        })
    }

    /// A connection to the guest's `port` (within `timeout`, at most
    /// [`MAX_CONNECT`]).
    pub fn connect(&self, port: u16, timeout: Duration) -> io::Result<TcpStream> {
        let (tx, rx) = bounded(1);
        let t = timeout.min(MAX_CONNECT);
        self.tx
            .send_timeout((port, t, tx), t)
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "guest connector busy or gone"))?;
        rx.recv_timeout(t + MAX_CONNECT).map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer from the guest connector",
            )
        })?
    }
}

fn serve(rx: &Receiver<Ask>, guest: Ipv4Addr) {
    for (port, t, reply) in rx.iter() {
        let r = TcpStream::connect_timeout(&SocketAddr::from((guest, port)), t);
        let _ = reply.send(r);
    }
}
