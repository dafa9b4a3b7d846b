//! The reaper: ends sessions that are idle past their timeout or older than
//! their lifetime.

use super::registry::Manager;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Runs until `stop` receives a message or disconnects.
pub fn spawn(mgr: Arc<Manager>, stop: Receiver<()>) -> std::io::Result<JoinHandle<()>> {
    let every = mgr.cfg.reap_interval;
    crate::harden::thread::spawn(
        crate::harden::ThreadKind::Reaper,
        std::thread::Builder::new().name("reaper".into()),
        move || loop {
            match stop.recv_timeout(every) {
                Err(RecvTimeoutError::Timeout) => {
                    let n = mgr.reap();
                    if n > 0 {
                        log::info!("reaper: closed {n} session(s)");
                    }
                }
                _ => return,
            }
        },
    )
}
