//! The per-request side of a host connection: the shared writer every
//! handler answers on, the mailbox the reader routes a request's frames
//! to, and `Req`, the request a handler holds. Handlers (`exec`, `procs`,
//! `files`) depend on this module only, never on `conn`, which runs the
//! reader and dispatches to them.

use crate::proto::{encode_json, encode_window, ErrorBody, ErrorCode, Event, Kind, Response};
use crate::sync::lock;
use crossbeam_channel::{Receiver, Sender};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub struct Writer {
    /// Shared by every logical connection on one stream: a host hello
    /// mid-connection starts a new `Writer` on the same stream, and the
    /// mutex keeps the old one's last frame from interleaving with it.
    out: Arc<Mutex<File>>,
    broken: AtomicBool,
}

impl Writer {
    pub fn new(out: File) -> Writer {
        Writer::on(Arc::new(Mutex::new(out)))
    }

    /// A writer on a stream an earlier logical connection also wrote to.
    pub(super) fn on(out: Arc<Mutex<File>>) -> Writer {
        Writer {
            out,
            broken: AtomicBool::new(false),
        }
    }

    /// Writes one encoded frame. Returns false once the connection is gone.
    pub fn send(&self, frame: &[u8]) -> bool {
        if self.broken.load(Ordering::Acquire) {
            return false;
        }
        let mut out = lock(&self.out);
        // Checked again under the lock: after a reset, no frame of the old
        // connection may follow the new hello.
        if self.broken.load(Ordering::Acquire) {
            return false;
        }
        if let Err(e) = out.write_all(frame) {
            log::debug!("connection write failed: {e}");
            self.broken.store(true, Ordering::Release);
            return false;
        }
        true
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    pub fn mark_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    pub fn json<T: serde::Serialize>(&self, kind: Kind, id: u64, v: &T) -> bool {
        self.send(&encode_json(kind, id, v))
    }

    pub fn error(&self, id: u64, err: &ErrorBody) -> bool {
        self.json(Kind::Error, id, err)
    }

    pub fn window(&self, id: u64, channel: u16, credit: u32) -> bool {
        self.send(&encode_window(id, channel, credit))
    }
}

/// Messages delivered to a request handler (or a process pump).
#[derive(Debug)]
pub enum Msg {
    /// Host data for this request.
    Data {
        channel: u16,
        bytes: Vec<u8>,
    },
    Eof {
        channel: u16,
    },
    /// Host grants more credit on an output channel.
    Window {
        channel: u16,
        credit: u32,
    },
    Cancel,
    /// The connection this request arrived on is gone.
    Closed,
    /// Stdin forwarded from an attach request; credit goes back to `grant`.
    Stdin {
        bytes: Vec<u8>,
        grant: Grant,
    },
    CloseStdin,
    Resize {
        rows: u16,
        cols: u16,
    },
    /// Raw wait status from the reaper, and the child's rusage.
    Exited(i32, Option<crate::proto::ResourceUsage>),
    /// New output in a background process's buffer.
    Notify,
}

/// Where to send `Window` frames for stdin bytes once they are consumed.
#[derive(Clone)]
pub struct Grant {
    pub writer: Arc<Writer>,
    pub id: u64,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grant({})", self.id)
    }
}

/// A handler's inbox, plus the eventfd that wakes it when it sleeps in poll.
#[derive(Clone)]
pub struct Mailbox {
    tx: Sender<Msg>,
    waker: Option<Arc<super::sys::Waker>>,
}

impl Mailbox {
    pub fn new(waker: Option<Arc<super::sys::Waker>>) -> (Mailbox, Receiver<Msg>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (Mailbox { tx, waker }, rx)
    }

    pub fn send(&self, m: Msg) {
        if self.tx.send(m).is_ok() {
            if let Some(w) = &self.waker {
                w.wake();
            }
        }
    }
}

pub struct ConnShared {
    pub writer: Arc<Writer>,
    routes: Mutex<HashMap<u64, Mailbox>>,
}

impl ConnShared {
    pub(super) fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Mailbox>> {
        lock(&self.routes)
    }
}

/// A request being handled. Ends exactly once, with `respond` or `fail`;
/// if a handler returns (or panics) without doing so, Drop fails it.
pub struct Req {
    pub id: u64,
    pub conn: Arc<ConnShared>,
    pub rx: Receiver<Msg>,
    done: bool,
}

impl Req {
    /// A request already routed to the mailbox `rx` belongs to.
    pub(super) fn new(id: u64, conn: Arc<ConnShared>, rx: Receiver<Msg>) -> Req {
        Req {
            id,
            conn,
            rx,
            done: false,
        }
    }

    pub fn writer(&self) -> &Arc<Writer> {
        &self.conn.writer
    }

    fn finish(&mut self) -> bool {
        if self.done {
            return false;
        }
        self.done = true;
        // Unroute first: frames the host still sends for this id are then
        // dropped as stale instead of piling up in a dead mailbox.
        self.conn.routes().remove(&self.id);
        true
    }

    pub fn respond(&mut self, r: &Response) {
        if self.finish() {
            self.conn.writer.json(Kind::Response, self.id, r);
        }
    }

    pub fn fail(&mut self, e: ErrorBody) {
        if self.finish() {
            self.conn.writer.error(self.id, &e);
        }
    }

    pub fn event(&self, e: &Event) -> bool {
        self.conn.writer.json(Kind::Event, self.id, e)
    }

    pub fn grant(&self) -> Grant {
        Grant {
            writer: self.conn.writer.clone(),
            id: self.id,
        }
    }
}

impl Drop for Req {
    fn drop(&mut self) {
        if !self.done {
            self.fail(ErrorBody::new(
                ErrorCode::Io,
                "request handler ended without an answer",
            ));
        }
    }
}

impl ConnShared {
    pub(super) fn new(writer: Writer) -> Arc<ConnShared> {
        Arc::new(ConnShared {
            writer: Arc::new(writer),
            routes: Mutex::new(HashMap::new()),
        })
    }

    /// Ends this logical connection: later frames of its handlers are
    /// dropped and every request in flight is told the host is gone.
    pub(super) fn close(&self) {
        self.writer.mark_broken();
        let routes: Vec<Mailbox> = self.routes().drain().map(|(_, m)| m).collect();
        for m in routes {
            m.send(Msg::Closed);
        }
    }
}
