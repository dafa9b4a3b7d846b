//! Address blocks of the veth pairs and the reaper that frees them.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use super::rtnl::Rtnl;
use crate::sync::lock;

/// Veth address blocks. A block stays taken after its session's teardown
/// until the kernel has removed the session's host link ("draining"), so an
/// address is never on two links at once.
pub(super) struct Alloc {
    pub(super) used: Vec<bool>,
    pub(super) next: usize,
    pub(super) draining: usize,
}

pub(super) struct Blocks {
    pub(super) state: Mutex<Alloc>,
    pub(super) changed: Condvar,
}

impl Blocks {
    pub(super) fn release(&self, slot: usize, was_draining: bool) {
        let mut a = lock(&self.state);
        if let Some(u) = a.used.get_mut(slot) {
            *u = false;
        }
        if was_draining {
            a.draining = a.draining.saturating_sub(1);
        }
        self.changed.notify_all();
    }
}

/// A torn-down session for the reaper.
pub(super) struct Reap {
    pub(super) slot: usize,
    pub(super) host_if: String,
    /// Our last reference to the namespace besides the (gone) mount. Closing
    /// a netfilter socket can wait for an RCU barrier (nf_tables flushes its
    /// destroy list on socket release, ~10 ms measured under churn), so the
    /// reaper closes it, not the caller.
    /// (The session's sockets, its netfilter one among them.)
    pub(super) held: Option<Box<dyn Send>>,
}

impl Reap {
    fn start(self) -> (usize, String, Instant) {
        drop(self.held);
        (self.slot, self.host_if, Instant::now())
    }
}

/// How long the kernel gets to remove a dead session's host link on its
/// own (namespace cleanup) before the reaper deletes it explicitly.
pub(super) const REAP_GRACE: Duration = Duration::from_secs(2);

/// Background thread: waits until the host links of torn-down sessions are
/// gone, then frees their address blocks. Teardown itself only unmounts the
/// namespace; the kernel destroys namespace, TAP, veth pair and session
/// table asynchronously and in batches, which is much cheaper than deleting
/// a veth synchronously (one RCU grace period each, ~30 ms measured here).
pub(super) fn reaper(blocks: Arc<Blocks>, mut rtnl: Rtnl, rx: Receiver<Reap>) {
    let mut pending: Vec<(usize, String, Instant)> = Vec::new();
    let mut open = true;
    while open || !pending.is_empty() {
        let got = if pending.is_empty() {
            rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(Duration::from_millis(5))
        };
        match got {
            Ok(r) => pending.push(r.start()),
            Err(RecvTimeoutError::Disconnected) => {
                open = false;
                if !pending.is_empty() {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        while let Ok(r) = rx.try_recv() {
            pending.push(r.start());
        }
        pending.retain(|(slot, name, since)| {
            let gone = match rtnl.link_index(name) {
                Ok(None) => true,
                Ok(Some(_)) if since.elapsed() > REAP_GRACE => {
                    // Something still holds the namespace (a VMM that was not
                    // killed?): cut the session off from the host side.
                    log::warn!("session link {name} outlived its namespace; deleting it");
                    match rtnl.del_link(name) {
                        Ok(()) => true,
                        Err(e) => {
                            log::error!("{e}");
                            false
                        }
                    }
                }
                Ok(Some(_)) => false,
                Err(e) => {
                    log::error!("reaper: {e}");
                    false
                }
            };
            if gone {
                blocks.release(*slot, true);
            }
            !gone
        });
    }
}
