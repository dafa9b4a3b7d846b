//! The writer thread: numbering, chaining, appending, fsync in batches,
//! rotation, rate limits, the per-session cap, retention.

use super::sink::Sinks;
use super::{chain, high_volume, owner_dir, Counters, Inner, Log, Msg, Rec, Settings};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Key;
type Metric = super::DropMetric;

/// fsync at least this often while records come in ...
const SYNC_EVERY: Duration = Duration::from_millis(100);
/// ... or after this many records, whichever is first.
const SYNC_RECORDS: usize = 256;
/// A record's body is cut to its bare facts above this (so the tail
/// reader below always finds a whole last line).
const MAX_RECORD: usize = 60 << 10;
const TAIL: u64 = 128 << 10;
/// A session's file is closed after this long without a record.
const IDLE_CLOSE: Duration = Duration::from_secs(60);
const RETENTION_EVERY: Duration = Duration::from_secs(60);
/// Room kept under the cap for the final `truncated` record.
const CAP_RESERVE: u64 = 1024;

pub(super) fn prepare_dir(dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("audit dir {}: {e}", dir.display()))
}

/// `<session>.<n>.jsonl` by `n`, then `<session>.jsonl`.
pub(super) fn files_of(dir: &Path, session: &str) -> Vec<PathBuf> {
    let mut rotated: Vec<(u64, PathBuf)> = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(n) = rotated_number(name, session) {
                rotated.push((n, e.path()));
            }
        }
    }
    rotated.sort();
    let mut out: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    let cur = dir.join(format!("{session}.jsonl"));
    if cur.exists() {
        out.push(cur);
    }
    out
}

fn rotated_number(name: &str, session: &str) -> Option<u64> {
    name.strip_prefix(session)?
        .strip_prefix('.')?
        .strip_suffix(".jsonl")?
        .parse()
        .ok()
}

/// The last whole record of the newest file that has one: (seq, hash, kind).
pub(super) fn last_of(files: &[PathBuf]) -> std::io::Result<Option<(u64, String, String)>> {
    for f in files.iter().rev() {
        let mut file = File::open(f)?;
        let len = file.metadata()?.len();
        let from = len.saturating_sub(TAIL);
        file.seek(SeekFrom::Start(from))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        let text = String::from_utf8_lossy(&buf);
        if let Some(line) = text.lines().rev().find(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
            if let (Some(seq), Some((_, hash))) =
                (v.get("seq").and_then(Value::as_u64), chain::split(line))
            {
                let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
                return Ok(Some((seq, hash.to_string(), kind.to_string())));
            }
        }
    }
    Ok(None)
}

struct State {
    dir: PathBuf,
    session: String,
    owner: String,
    file: File,
    seq: u64,
    prev: String,
    cur_bytes: u64,
    set_bytes: u64,
    next_rotated: u64,
    tokens: f64,
    refilled: Instant,
    suppressed: BTreeMap<&'static str, u64>,
    last_summary: Instant,
    sink_dropped: u64,
    truncated: bool,
    dirty: bool,
    used: Instant,
}

pub(super) struct Writer {
    s: Settings,
    dir: PathBuf,
    counters: Arc<Counters>,
    heads: super::Heads,
    sinks: Sinks,
    metric: Option<Metric>,
    open: HashMap<Key, State>,
    since_sync: usize,
    last_sync: Instant,
    last_tick: Instant,
    last_retention: Option<Instant>,
    /// Open failures logged (all are counted as drops).
    open_errors: u64,
}

impl Writer {
    pub(super) fn new(
        s: Settings,
        dir: PathBuf,
        counters: Arc<Counters>,
        heads: super::Heads,
        sinks: Sinks,
        metric: Option<Metric>,
    ) -> Writer {
        Writer {
            s,
            dir,
            counters,
            heads,
            sinks,
            metric,
            open: HashMap::new(),
            since_sync: 0,
            last_sync: Instant::now(),
            last_tick: Instant::now(),
            last_retention: None,
            open_errors: 0,
        }
    }

    pub(super) fn run(mut self, rx: Receiver<Msg>, inner: Weak<Inner>) {
        self.retention();
        loop {
            match rx.recv_timeout(SYNC_EVERY) {
                Ok(Msg::Rec(r)) => self.handle(r),
                Ok(Msg::Flush(done)) => {
                    // What was recorded before the flush is in the queue
                    // ahead of it, or in the drop map.
                    self.drops(&inner);
                    self.tick(true);
                    self.sync();
                    let _ = done.send(());
                }
                Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    while let Ok(Msg::Rec(r)) = rx.try_recv() {
                        self.handle(r);
                    }
                    self.drops(&inner);
                    self.tick(true);
                    self.sync();
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if self.since_sync >= SYNC_RECORDS || self.last_sync.elapsed() >= SYNC_EVERY {
                self.drops(&inner);
                self.sync();
            }
            if self.last_tick.elapsed() >= Duration::from_secs(1) {
                self.tick(false);
            }
            if self
                .last_retention
                .is_none_or(|t| t.elapsed() >= RETENTION_EVERY)
            {
                self.retention();
                self.close_idle();
            }
        }
    }

    fn count_drop(&self, what: &str) {
        count(self.metric.as_ref(), what)
    }

    /// `dropped` records for what a full queue (or a sink) lost.
    fn drops(&mut self, inner: &Weak<Inner>) {
        let Some(i) = inner.upgrade() else { return };
        let queue = Log::take_drops(&i);
        let sink = self.sinks.take_failed();
        drop(i);
        for ((owner, session), n) in queue {
            let f = json!({"dropped": n, "reason": "queue_full"});
            self.write_to(&owner, &session, "dropped", super::now_ms(), f, true);
        }
        for ((owner, session), n) in sink {
            let f = json!({"dropped": n, "reason": "sink_http"});
            self.write_to(&owner, &session, "dropped", super::now_ms(), f, false);
        }
    }

    /// Once a second: the summaries of suppressed records, sink drops.
    fn tick(&mut self, all: bool) {
        self.last_tick = Instant::now();
        let due: Vec<Key> = self
            .open
            .iter()
            .filter(|(_, st)| {
                (!st.suppressed.is_empty() || st.sink_dropped > 0)
                    && (all || st.last_summary.elapsed() >= Duration::from_secs(1))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in due {
            self.summary(&k);
        }
    }

    fn summary(&mut self, k: &Key) {
        let Some(st) = self.open.get_mut(k) else {
            return;
        };
        st.last_summary = Instant::now();
        let suppressed = std::mem::take(&mut st.suppressed);
        let sink = std::mem::take(&mut st.sink_dropped);
        if !suppressed.is_empty() {
            let total: u64 = suppressed.values().sum();
            let f = json!({
                "suppressed": suppressed, "total": total,
                "ratePerSec": self.s.rate_per_sec, "burst": self.s.rate_burst,
            });
            self.append(k, "summary", super::now_ms(), obj(f), true);
        }
        if sink > 0 {
            let f = json!({"dropped": sink, "reason": "sink_queue_full"});
            self.append(k, "dropped", super::now_ms(), obj(f), false);
        }
    }

    fn handle(&mut self, r: Rec) {
        let k = (r.owner.clone(), r.session.clone());
        if !self.ensure(&k) {
            return;
        }
        let rate = self.s.rate_per_sec;
        let burst = self.s.rate_burst;
        let Some(st) = self.open.get_mut(&k) else {
            return;
        };
        st.used = Instant::now();
        if st.truncated {
            self.counters.capped.fetch_add(1, Ordering::Relaxed);
            self.count_drop("cap");
            return;
        }
        if high_volume(r.kind) {
            let now = Instant::now();
            st.tokens =
                (st.tokens + now.duration_since(st.refilled).as_secs_f64() * rate).min(burst);
            st.refilled = now;
            if st.tokens < 1.0 {
                *st.suppressed.entry(r.kind).or_insert(0) += 1;
                self.counters.suppressed.fetch_add(1, Ordering::Relaxed);
                count(self.metric.as_ref(), "rate");
                if st.last_summary.elapsed() >= Duration::from_secs(1) {
                    self.summary(&k);
                }
                return;
            }
            st.tokens -= 1.0;
        }
        if st.last_summary.elapsed() >= Duration::from_secs(1)
            && (!st.suppressed.is_empty() || st.sink_dropped > 0)
        {
            self.summary(&k);
        }
        self.append(&k, r.kind, r.ts, r.fields, true);
    }

    fn write_to(
        &mut self,
        owner: &str,
        session: &str,
        kind: &'static str,
        ts: u64,
        f: Value,
        fwd: bool,
    ) {
        let k = (owner.to_string(), session.to_string());
        if self.ensure(&k) {
            self.append(&k, kind, ts, obj(f), fwd);
        }
    }

    /// The session's state, opened from its files if needed.
    fn ensure(&mut self, k: &Key) -> bool {
        if self.open.contains_key(k) {
            return true;
        }
        match self.open_state(k) {
            Ok(st) => {
                self.open.insert(k.clone(), st);
                true
            }
            Err(e) => {
                self.open_errors += 1;
                if self.open_errors <= 16 {
                    log::error!("audit: session {}/{}: {e}", k.0, k.1);
                }
                self.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
                self.count_drop("io");
                false
            }
        }
    }

    fn open_state(&self, (owner, session): &Key) -> Result<State, String> {
        if !super::plain_name(session) {
            return Err(format!("session id {session:?} cannot name a file"));
        }
        let dir = self.dir.join(owner_dir(owner));
        prepare_dir(&dir)?;
        let files = files_of(&dir, session);
        let last = last_of(&files).map_err(|e| format!("read {}: {e}", dir.display()))?;
        let set_bytes = files
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum();
        let next_rotated = files
            .iter()
            .filter_map(|f| {
                f.file_name()?
                    .to_str()
                    .and_then(|n| rotated_number(n, session))
            })
            .max()
            .unwrap_or(0)
            + 1;
        let cur = dir.join(format!("{session}.jsonl"));
        let file = open_append(&cur)?;
        let cur_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        let (seq, prev, truncated) = match last {
            Some((seq, hash, kind)) => (seq, hash, kind == "truncated"),
            None => (0, chain::GENESIS.to_string(), false),
        };
        Ok(State {
            dir,
            session: session.clone(),
            owner: owner.clone(),
            file,
            seq,
            prev,
            cur_bytes,
            set_bytes,
            next_rotated,
            tokens: self.s.rate_burst,
            refilled: Instant::now(),
            suppressed: BTreeMap::new(),
            last_summary: Instant::now(),
            sink_dropped: 0,
            truncated,
            dirty: false,
            used: Instant::now(),
        })
    }

    /// Numbers, chains and appends one record (rotating first, or ending
    /// the file set with `truncated` at the cap).
    fn append(
        &mut self,
        k: &Key,
        kind: &'static str,
        ts: u64,
        fields: Map<String, Value>,
        fwd: bool,
    ) {
        let max = self.s.max_session_bytes;
        let rotate = self.s.rotate_bytes;
        let Some(st) = self.open.get_mut(k) else {
            return;
        };
        if st.truncated {
            return;
        }
        let mut body = build(st, kind, ts, &fields);
        if body.len() > MAX_RECORD {
            let f = obj(json!({"oversize": body.len(), "fieldsLeftOut": true}));
            body = build(st, kind, ts, &f);
        }
        let mut line_len = body.len() as u64 + 76;
        if st.set_bytes + line_len + CAP_RESERVE > max {
            let kind = "truncated";
            let f = obj(
                json!({"maxSessionBytes": max, "reason": "the session's audit files reached their cap; later records are dropped (counted)"}),
            );
            body = build(st, kind, ts, &f);
            line_len = body.len() as u64 + 76;
            st.truncated = true;
        }
        if st.cur_bytes > 0 && st.cur_bytes + line_len > rotate {
            if let Err(e) = rotate_file(st) {
                log::error!("audit: rotate {}/{}: {e}", st.owner, st.session);
            }
        }
        let hash = chain::hash_of(&st.prev, body.as_bytes());
        let mut line = chain::seal(&body, &hash);
        line.push('\n');
        if let Err(e) = st.file.write_all(line.as_bytes()) {
            log::error!("audit: write {}/{}: {e}", st.owner, st.session);
            self.counters.queue_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        st.seq += 1;
        st.prev = hash.clone();
        st.cur_bytes += line.len() as u64;
        st.set_bytes += line.len() as u64;
        st.dirty = true;
        self.since_sync += 1;
        self.counters.written.fetch_add(1, Ordering::Relaxed);
        crate::sync::lock(&self.heads).insert(k.clone(), (st.seq, hash));
        if fwd && !self.sinks.send(k, line.trim_end()) {
            st.sink_dropped += 1;
        }
    }

    fn sync(&mut self) {
        for st in self.open.values_mut().filter(|s| s.dirty) {
            if let Err(e) = st.file.sync_data() {
                log::error!("audit: fsync {}/{}: {e}", st.owner, st.session);
            }
            st.dirty = false;
        }
        self.since_sync = 0;
        self.last_sync = Instant::now();
    }

    fn close_idle(&mut self) {
        let idle: Vec<Key> = self
            .open
            .iter()
            .filter(|(_, s)| s.used.elapsed() >= IDLE_CLOSE && s.suppressed.is_empty() && !s.dirty)
            .map(|(k, _)| k.clone())
            .collect();
        for k in idle {
            self.open.remove(&k);
        }
    }

    /// Files past the age, then the oldest while all together are over
    /// the size; never a file the writer appends to now.
    fn retention(&mut self) {
        self.last_retention = Some(Instant::now());
        let current: Vec<PathBuf> = self
            .open
            .values()
            .map(|s| s.dir.join(format!("{}.jsonl", s.session)))
            .collect();
        let mut all: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        let Ok(owners) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for o in owners.flatten() {
            let Ok(rd) = std::fs::read_dir(o.path()) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().and_then(|x| x.to_str()) != Some("jsonl") {
                    continue;
                }
                if let Ok(m) = e.metadata() {
                    all.push((m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), p));
                }
            }
        }
        all.sort();
        let max_age = Duration::from_secs(self.s.retention_secs);
        let now = std::time::SystemTime::now();
        let mut total: u64 = all.iter().map(|(_, n, _)| n).sum();
        for (t, n, p) in all {
            if current.contains(&p) {
                continue;
            }
            let old = now.duration_since(t).is_ok_and(|a| a > max_age);
            if old || total > self.s.retention_bytes {
                match std::fs::remove_file(&p) {
                    Ok(()) => {
                        total = total.saturating_sub(n);
                        log::info!("audit: retention removed {}", p.display());
                    }
                    Err(e) => log::warn!("audit: retention: remove {}: {e}", p.display()),
                }
            }
        }
    }
}

fn count(metric: Option<&Metric>, what: &str) {
    if let Some(m) = metric {
        m.get_or_create(&vec![("where", what.to_string())]).inc();
    }
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// The record without its hash member: the log's own fields first, the
/// event's, then `prev` (which the hash covers like everything else).
fn build(st: &State, kind: &str, ts: u64, fields: &Map<String, Value>) -> String {
    const OWN: &[&str] = &["seq", "ts", "session", "owner", "kind", "prev", "hash"];
    let mut m = Map::new();
    for (k, v) in fields {
        if !OWN.contains(&k.as_str()) {
            m.insert(k.clone(), v.clone());
        }
    }
    let head = json!({"seq": st.seq + 1, "ts": ts, "session": st.session, "owner": st.owner, "kind": kind});
    let head = head.to_string();
    let rest = Value::Object(m).to_string();
    let prev = json!(st.prev).to_string();
    let mut s = String::with_capacity(head.len() + rest.len() + 80);
    s.push_str(&head[..head.len() - 1]);
    if rest.len() > 2 {
        s.push(',');
        s.push_str(&rest[1..rest.len() - 1]);
    }
    s.push_str(",\"prev\":");
    s.push_str(&prev);
    s.push('}');
    s
}

fn open_append(p: &Path) -> Result<File, String> {
    OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(p)
        .map_err(|e| format!("open {}: {e}", p.display()))
}

/// The current file becomes `<session>.<n>.jsonl`; the chain goes on in a
/// new current file (its first `prev` is the old file's last hash).
fn rotate_file(st: &mut State) -> Result<(), String> {
    st.file.sync_data().map_err(|e| format!("fsync: {e}"))?;
    let cur = st.dir.join(format!("{}.jsonl", st.session));
    let to = st
        .dir
        .join(format!("{}.{}.jsonl", st.session, st.next_rotated));
    std::fs::rename(&cur, &to).map_err(|e| format!("rename to {}: {e}", to.display()))?;
    st.next_rotated += 1;
    st.file = open_append(&cur)?;
    st.cur_bytes = 0;
    st.dirty = false;
    Ok(())
}
