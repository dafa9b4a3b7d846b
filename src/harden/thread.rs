//! Starting threads with their own seccomp filter.
//!
//! A new thread inherits its creator's filter, and filters only narrow. So a
//! session thread started by an HTTP worker could never do more than HTTP
//! workers may. [`spawn`] therefore hands the start to a broker thread that
//! holds only the baseline filter (started by `harden::apply`); the new
//! thread installs the filter of its kind before running its body. Before
//! `apply` (tools, tests without hardening) threads start directly.

use crossbeam_channel::{bounded, unbounded, Sender};
use std::io;
use std::sync::OnceLock;
use std::thread::{Builder, JoinHandle};

use super::seccomp::{self, Mode, ThreadKind};
use super::HardenError;

type Job = Box<dyn FnOnce() + Send>;

static BROKER: OnceLock<Sender<Job>> = OnceLock::new();

pub(crate) fn start_broker() -> Result<(), HardenError> {
    if BROKER.get().is_some() {
        return Ok(());
    }
    let (tx, rx) = unbounded::<Job>();
    Builder::new()
        .name("thread-broker".into())
        .spawn(move || {
            // No filter of its own: every thread it starts inherits its
            // filter, so it must keep exactly the baseline.
            for job in rx.iter() {
                job();
            }
        })
        .map_err(|e| HardenError::Sys {
            what: "spawn thread-broker".into(),
            source: e,
        })?;
    let _ = BROKER.set(tx);
    Ok(())
}

/// Start a thread of `kind`: `builder` as for `std::thread`, `f` runs after
/// the kind's filter is installed. If installing fails the thread ends
/// without running `f` and the error is logged (the filter is part of the
/// thread's contract; running without it would be a silent downgrade).
pub fn spawn<F, T>(kind: ThreadKind, builder: Builder, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let body = move || -> T {
        if let Err(e) = seccomp::install_current(kind) {
            log::error!("thread of kind {}: {e}; stopping the process", kind.name());
            // A thread that cannot confine itself must not run unconfined.
            std::process::abort();
        }
        f()
    };
    let Some(broker) = BROKER.get().filter(|_| seccomp::mode() != Mode::Off) else {
        return builder.spawn(body);
    };
    let (reply_tx, reply_rx) = bounded::<io::Result<JoinHandle<T>>>(1);
    let job: Job = Box::new(move || {
        let _ = reply_tx.send(builder.spawn(body));
    });
    broker
        .send(job)
        .map_err(|_| io::Error::other("thread broker is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("thread broker dropped the request"))?
}
