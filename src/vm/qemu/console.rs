//! A VM's console: QEMU's stdout/stderr read by a thread of the daemon,
//! logged to `console.log` (rotated), the tail kept for error messages,
//! and the agent's READY line noticed.

use std::collections::VecDeque;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::{lock, READY_MARKER};

/// Bytes of console output kept in memory for error messages.
pub(super) const CONSOLE_TAIL: usize = 8 * 1024;

/// `console.log` grows to this, then becomes `console.log.1` (replacing
/// the one before) and a new `console.log` starts: a guest flooding its
/// serial port costs the host at most twice this on disk.
pub const CONSOLE_LOG_MAX: u64 = 1 << 20;

/// Console output of one VM: appended to `console.log` in the run dir, the
/// tail kept in memory for error messages, and the READY line noticed.
#[derive(Default)]
pub(super) struct Console {
    pub(super) state: Mutex<ConsoleState>,
    pub(super) cv: Condvar,
}

#[derive(Default)]
pub(super) struct ConsoleState {
    tail: VecDeque<u8>,
    ready: bool,
    /// The VMM closed its stdout/stderr: it has exited.
    eof: bool,
}

/// The console's file in the run dir, bounded by rotation
/// ([`CONSOLE_LOG_MAX`]).
pub(super) struct ConsoleLog {
    path: PathBuf,
    file: fs::File,
    size: u64,
}

impl ConsoleLog {
    pub(super) fn open(path: PathBuf) -> io::Result<ConsoleLog> {
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)?;
        let size = file.metadata()?.len();
        Ok(ConsoleLog { path, file, size })
    }

    /// Appends, rotating first when `chunk` would take the file past the
    /// cap. An error stops the logging (the in-memory tail goes on).
    pub(super) fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        if self.size > 0 && self.size + chunk.len() as u64 > CONSOLE_LOG_MAX {
            let mut old = self.path.clone().into_os_string();
            old.push(".1");
            fs::rename(&self.path, &old)?;
            *self = ConsoleLog::open(self.path.clone())?;
        }
        self.file.write_all(chunk)?;
        self.size += chunk.len() as u64;
        Ok(())
    }
}

impl Console {
    pub(super) fn run(self: Arc<Self>, mut from: fs::File, mut log: Option<ConsoleLog>) {
        let mut buf = [0u8; 4096];
        let mut window: Vec<u8> = Vec::new();
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(l) = log.as_mut() {
                if let Err(e) = l.write(chunk) {
                    log::warn!("{}: {e}; console no longer logged", l.path.display());
                    log = None;
                }
            }
            let mut st = lock(&self.state);
            st.tail.extend(chunk);
            let over = st.tail.len().saturating_sub(CONSOLE_TAIL);
            st.tail.drain(..over);
            if !st.ready {
                // Look across read boundaries without rescanning everything.
                window.extend_from_slice(chunk);
                if window
                    .windows(READY_MARKER.len())
                    .any(|w| w == READY_MARKER)
                {
                    st.ready = true;
                    self.cv.notify_all();
                }
                let keep = window.len().saturating_sub(READY_MARKER.len());
                window.drain(..keep);
            }
        }
        lock(&self.state).eof = true;
        self.cv.notify_all();
    }

    pub(super) fn tail(&self) -> String {
        let st = lock(&self.state);
        let bytes: Vec<u8> = st.tail.iter().copied().collect();
        drop(st);
        crate::vm::console::tail_text(&bytes)
    }

    /// Wait until the VMM's output has been read to its end.
    pub(super) fn wait_eof(&self, deadline: Instant) {
        let mut st = lock(&self.state);
        while !st.eof {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            st = match self.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// Wait for READY; `Ok(false)` if the VMM exited first.
    pub(super) fn wait_ready(&self, deadline: Instant) -> std::result::Result<bool, ()> {
        let mut st = lock(&self.state);
        loop {
            if st.ready {
                return Ok(true);
            }
            if st.eof {
                return Ok(false);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(());
            }
            st = match self.cv.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::qemu::CONSOLE_LOG;

    #[test]
    fn console_log_rotates_within_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONSOLE_LOG);
        let mut log = ConsoleLog::open(path.clone()).unwrap();
        let chunk = [b'x'; 4096];
        // Five times the cap: the flood a guest can make.
        for _ in 0..(5 * CONSOLE_LOG_MAX as usize / chunk.len()) {
            log.write(&chunk).unwrap();
        }
        let cur = fs::metadata(&path).unwrap().len();
        let old = fs::metadata(dir.path().join("console.log.1"))
            .unwrap()
            .len();
        assert!(
            cur <= CONSOLE_LOG_MAX && old <= CONSOLE_LOG_MAX,
            "{cur} {old}"
        );
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn console_tail_is_escaped() {
        let c = Console::default();
        lock(&c.state)
            .tail
            .extend(b"boot ok\nsession a/b: destroyed\x1b[31m\n".iter());
        let t = c.tail();
        assert!(!t.contains('\x1b'), "{t:?}");
        assert!(t.contains("\\u{1b}[31m"), "{t:?}");
    }
}
