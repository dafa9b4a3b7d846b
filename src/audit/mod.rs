//! The audit log (issue #26): per session, what the host saw happen.
//!
//! Every layer records through a [`Log`] (cheap to clone; a disabled one
//! does nothing): `log.record(owner, session, kind, fields)` never blocks.
//! Records go over a bounded channel to one writer thread (kind
//! `Audit`), which numbers them per session, chains them by hash, appends
//! them to `<dir>/<owner>/<session>.jsonl` (O_APPEND, 0600), fsyncs in
//! batches, rotates by size, enforces the rate limits and the per-session
//! cap, prunes by age and total size, and hands each line to the
//! configured sinks (syslog, HTTP; [`sink`]).
//!
//! What a full queue drops is counted per session and written as a
//! `dropped` record once there is room; what a rate limit suppresses is
//! summed in a `summary` record at most once a second; past the cap one
//! `truncated` record ends the session's file set.
//!
//! The chain: see [`chain`]. A file set verifies with [`verify`] (the CLI's
//! `agent-sandbox audit verify`).

pub mod chain;
pub mod sink;
pub mod verify;
mod writer;

use crossbeam_channel::{bounded, Sender, TrySendError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use chain::GENESIS;

/// (owner, session): one file set.
pub(crate) type Key = (String, String);
/// The last record per file set: (seq, hash).
pub(crate) type Heads = Arc<Mutex<HashMap<Key, (u64, String)>>>;
/// The metric family drops are counted in (`metrics.audit_dropped`).
pub type DropMetric = prometheus_client::metrics::family::Family<
    Vec<(&'static str, String)>,
    prometheus_client::metrics::counter::Counter,
>;

/// Audit settings: the `audit` section of the config file (every key
/// optional) and the `--audit*` flags of `serve`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// On by default: the file sink costs a few appends per request.
    pub enabled: bool,
    /// `None`: `<state dir>/audit`.
    pub dir: Option<PathBuf>,
    /// A session's current file is rotated past this many bytes.
    pub rotate_bytes: u64,
    /// Files older than this (by modification time) are removed.
    pub retention_secs: u64,
    /// All audit files together are kept under this; oldest go first.
    pub retention_bytes: u64,
    /// One session's file set stops (a `truncated` record) at this size.
    pub max_session_bytes: u64,
    /// Token bucket per session for the high-volume kinds (`proc`, `file`,
    /// `stdin`, `pty_input`, `egress`): records per second ...
    pub rate_per_sec: f64,
    /// ... and the burst.
    pub rate_burst: f64,
    /// Records waiting for the writer; over it they are dropped (counted).
    pub queue: usize,
    /// Every record also as an RFC 5424 datagram to `syslog_socket`.
    pub syslog: bool,
    /// The syslog socket (journald's and syslog daemons' `/dev/log`).
    pub syslog_socket: PathBuf,
    /// Every record also POSTed as NDJSON to this URL (batched, retried).
    pub http_url: Option<String>,
    /// Records waiting for the HTTP sink; over it they are dropped.
    pub http_queue: usize,
    /// Every foreground command also asks the guest agent for what it did
    /// (its process tree, the files it changed): `proc` and `file` records.
    pub guest: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            enabled: true,
            dir: None,
            rotate_bytes: 16 << 20,
            retention_secs: 30 * 24 * 3600,
            retention_bytes: 4 << 30,
            max_session_bytes: 256 << 20,
            rate_per_sec: 200.0,
            rate_burst: 2000.0,
            queue: 16384,
            syslog: false,
            syslog_socket: PathBuf::from("/dev/log"),
            http_url: None,
            http_queue: 16384,
            guest: true,
        }
    }
}

impl Settings {
    pub fn validate(&self) -> Result<(), String> {
        if self.rotate_bytes < 4096 {
            return Err("audit.rotate_bytes: at least 4096".into());
        }
        if self.max_session_bytes < self.rotate_bytes.min(65536) {
            return Err("audit.max_session_bytes: at least 64 KiB".into());
        }
        if !(self.rate_per_sec > 0.0 && self.rate_burst >= 1.0) {
            return Err("audit.rate_per_sec must be > 0 and audit.rate_burst >= 1".into());
        }
        if self.queue == 0 || self.http_queue == 0 {
            return Err("audit.queue and audit.http_queue must be positive".into());
        }
        if let Some(u) = &self.http_url {
            if !u.starts_with("http://") && !u.starts_with("https://") {
                return Err(format!("audit.http_url {u:?}: want an http:// URL"));
            }
        }
        if let Some(d) = &self.dir {
            if !d.is_absolute() {
                return Err(format!("audit.dir {}: not an absolute path", d.display()));
            }
        }
        Ok(())
    }

    /// The directory files go to, given the daemon's state dir.
    pub fn dir_in(&self, state_dir: &Path) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| state_dir.join("audit"))
    }
}

/// The kinds a guest can make many of: rate-limited per session.
pub fn high_volume(kind: &str) -> bool {
    matches!(kind, "proc" | "file" | "stdin" | "pty_input" | "egress")
}

/// One record on its way to the writer.
pub(crate) struct Rec {
    owner: String,
    session: String,
    kind: &'static str,
    ts: u64,
    fields: Map<String, Value>,
}

pub(crate) enum Msg {
    Rec(Rec),
    /// Everything before it is written (and fsynced); then the answer.
    Flush(Sender<()>),
    Stop,
}

/// Counters shared by the handles and the writer.
#[derive(Default)]
pub struct Counters {
    /// Records a full queue dropped.
    pub queue_dropped: AtomicU64,
    /// Records a rate limit suppressed.
    pub suppressed: AtomicU64,
    /// Records the per-session cap refused.
    pub capped: AtomicU64,
    /// Records a sink could not take (full queue or gave up).
    pub sink_dropped: AtomicU64,
    /// Records written to files.
    pub written: AtomicU64,
}

struct Inner {
    tx: Sender<Msg>,
    dir: PathBuf,
    /// Drops per (owner, session) since the writer last looked.
    drops: Mutex<HashMap<Key, u64>>,
    counters: Arc<Counters>,
    /// The last written record per session file set: (seq, hash).
    heads: Heads,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    metric: Option<DropMetric>,
}

/// The handle every layer records through. `Log::disabled()` (also the
/// `Default`) records nothing.
#[derive(Clone, Default)]
pub struct Log {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Some(i) => write!(f, "audit::Log({})", i.dir.display()),
            None => f.write_str("audit::Log(disabled)"),
        }
    }
}

/// A [`Log`] bound to one session: what a layer that knows only its
/// sandbox (the egress proxy) records through.
#[derive(Clone, Debug)]
pub struct Tag {
    pub log: Log,
    pub owner: String,
    pub session: String,
}

impl Tag {
    pub fn record(&self, kind: &'static str, fields: Value) {
        self.log.record(&self.owner, &self.session, kind, fields)
    }
}

/// Where a sandbox's layers find the session they record for (set when a
/// session takes the sandbox; empty while it waits in a pool).
pub type Slot = Arc<Mutex<Option<Tag>>>;

/// Unix time in ms.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A file-name-safe form of an owner (key id): kept when it is already
/// `[A-Za-z0-9_-]{1,64}`, else its sha256 prefix, so two owners never
/// share a directory and no name escapes it.
pub fn owner_dir(owner: &str) -> String {
    if plain_name(owner) {
        owner.to_string()
    } else {
        format!("h-{}", &chain::sha256_hex(owner.as_bytes())[..32])
    }
}

/// `[A-Za-z0-9_-]{1,64}`: safe as a file name (session ids always are).
pub fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Log {
    pub fn disabled() -> Log {
        Log { inner: None }
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Starts the writer (and the sinks) for `s`, files under `dir`;
    /// `metrics`: the family drops are counted in (label `where`).
    pub fn start(s: &Settings, dir: PathBuf, metric: Option<DropMetric>) -> Result<Log, String> {
        if !s.enabled {
            return Ok(Log::disabled());
        }
        s.validate()?;
        writer::prepare_dir(&dir)?;
        let (tx, rx) = bounded(s.queue);
        let counters = Arc::new(Counters::default());
        let heads = Arc::new(Mutex::new(HashMap::new()));
        let sinks = sink::Sinks::start(s, counters.clone(), metric.clone())?;
        let inner = Arc::new(Inner {
            tx,
            dir: dir.clone(),
            drops: Mutex::new(HashMap::new()),
            counters: counters.clone(),
            heads: heads.clone(),
            thread: Mutex::new(None),
            metric: metric.clone(),
        });
        let weak = Arc::downgrade(&inner);
        let w = writer::Writer::new(s.clone(), dir, counters, heads, sinks, metric);
        let h = crate::harden::thread::spawn(
            crate::harden::ThreadKind::Audit,
            std::thread::Builder::new().name("audit-writer".into()),
            move || w.run(rx, weak),
        )
        .map_err(|e| format!("start the audit writer: {e}"))?;
        *crate::sync::lock(&inner.thread) = Some(h);
        Ok(Log { inner: Some(inner) })
    }

    /// Records one event of `session` (owned by `owner`): never blocks; a
    /// full queue drops it (counted, and reported in the session's file as
    /// a `dropped` record once there is room). `fields` is a JSON object
    /// (anything else is kept under `value`); `seq`, `ts`, `owner`,
    /// `session`, `kind`, `prev` and `hash` are the log's own and win over
    /// fields of those names.
    pub fn record(&self, owner: &str, session: &str, kind: &'static str, fields: Value) {
        let Some(i) = &self.inner else { return };
        let fields = match fields {
            Value::Object(m) => m,
            Value::Null => Map::new(),
            v => {
                let mut m = Map::new();
                m.insert("value".into(), v);
                m
            }
        };
        let rec = Rec {
            owner: owner.to_string(),
            session: session.to_string(),
            kind,
            ts: now_ms(),
            fields,
        };
        match i.tx.try_send(Msg::Rec(rec)) {
            Ok(()) => {}
            Err(TrySendError::Full(Msg::Rec(r))) | Err(TrySendError::Disconnected(Msg::Rec(r))) => {
                i.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
                if let Some(m) = &i.metric {
                    m.get_or_create(&vec![("where", "queue".to_string())]).inc();
                }
                *crate::sync::lock(&i.drops)
                    .entry((r.owner, r.session))
                    .or_insert(0) += 1;
            }
            Err(_) => {}
        }
    }

    /// Waits (at most `t`) until everything recorded so far is written and
    /// fsynced. False on timeout or a disabled log.
    pub fn flush(&self, t: Duration) -> bool {
        let Some(i) = &self.inner else { return false };
        let (tx, rx) = bounded(1);
        let deadline = std::time::Instant::now() + t;
        loop {
            match i.tx.try_send(Msg::Flush(tx.clone())) {
                Ok(()) => break,
                Err(TrySendError::Full(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(_) => return false,
            }
        }
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            .is_ok()
    }

    /// The files of `owner`'s `session`, oldest first (rotated ones, then
    /// the current one); empty when there are none (or the log is off).
    pub fn files(&self, owner: &str, session: &str) -> Vec<PathBuf> {
        match &self.inner {
            Some(i) => writer::files_of(&i.dir.join(owner_dir(owner)), session),
            None => Vec::new(),
        }
    }

    /// The last record written for the session: (seq, hash). Read from the
    /// writer's state, else from the files.
    pub fn head(&self, owner: &str, session: &str) -> Option<(u64, String)> {
        let i = self.inner.as_ref()?;
        let known = crate::sync::lock(&i.heads)
            .get(&(owner.to_string(), session.to_string()))
            .cloned();
        known.or_else(|| {
            writer::last_of(&self.files(owner, session))
                .ok()
                .flatten()
                .map(|(seq, hash, _)| (seq, hash))
        })
    }

    pub fn counters(&self) -> Option<Arc<Counters>> {
        self.inner.as_ref().map(|i| i.counters.clone())
    }

    /// Writes what is queued and stops the writer (the daemon's end).
    pub fn stop(&self) {
        let Some(i) = &self.inner else { return };
        let _ = i.tx.send_timeout(Msg::Stop, Duration::from_secs(5));
        if let Some(h) = crate::sync::lock(&i.thread).take() {
            let _ = h.join();
        }
    }

    /// Takes the per-session drop counts (the writer's side).
    fn take_drops(inner: &Inner) -> HashMap<Key, u64> {
        std::mem::take(&mut *crate::sync::lock(&inner.drops))
    }
}

#[cfg(test)]
mod tests;
