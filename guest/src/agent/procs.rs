//! Process table, the single reaper, background output buffers, and the
//! worker pool.

use super::mailbox::{Mailbox, Msg};
use crate::proto::{limits, ExitStatus, ProcInfo, ResourceUsage};
use crate::sync::lock;
use crossbeam_channel::{Receiver, Sender};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bounded output history of a background process. Old chunks are dropped
/// when it is full, so a chatty process never grows agent memory.
pub struct Ring {
    chunks: VecDeque<(u64, u16, Vec<u8>)>,
    /// Sequence number of the first byte still held.
    pub start: u64,
    /// Sequence number one past the last byte pushed.
    pub end: u64,
    held: usize,
    cap: usize,
}

impl Ring {
    pub fn new(cap: usize) -> Ring {
        Ring {
            chunks: VecDeque::new(),
            start: 0,
            end: 0,
            held: 0,
            cap,
        }
    }

    pub fn push(&mut self, channel: u16, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.chunks.push_back((self.end, channel, data.to_vec()));
        self.end += data.len() as u64;
        self.held += data.len();
        while self.held > self.cap {
            match self.chunks.pop_front() {
                Some((_, _, c)) => {
                    self.held -= c.len();
                    self.start += c.len() as u64;
                }
                None => break,
            }
        }
    }

    /// Up to `max` bytes starting at `cursor` (which must be >= start),
    /// all from one channel.
    pub fn read(&self, cursor: u64, max: usize) -> Option<(u16, &[u8])> {
        if cursor >= self.end || cursor < self.start {
            return None;
        }
        let idx = self
            .chunks
            .partition_point(|(seq, _, c)| seq + c.len() as u64 <= cursor);
        let (seq, ch, c) = self.chunks.get(idx)?;
        let off = (cursor - seq) as usize;
        let n = (c.len() - off).min(max);
        Some((*ch, &c[off..off + n]))
    }

    /// Channel of the byte at `cursor`.
    pub fn channel_at(&self, cursor: u64) -> Option<u16> {
        self.read(cursor, 1).map(|(c, _)| c)
    }
}

pub struct Attacher {
    pub mailbox: Mailbox,
    /// Set while a Notify is queued, so a busy process sends one, not many.
    pub pending: Arc<AtomicBool>,
}

pub struct ProcState {
    pub exit: Option<ExitStatus>,
    pub ring: Ring,
    pub attachers: Vec<Attacher>,
}

impl ProcState {
    pub fn notify_attachers(&self) {
        for a in &self.attachers {
            if !a.pending.swap(true, Ordering::AcqRel) {
                a.mailbox.send(Msg::Notify);
            }
        }
    }
}

pub struct Proc {
    pub id: u64,
    pub pid: i32,
    pub argv: Vec<String>,
    pub tag: Option<String>,
    pub background: bool,
    pub pty: bool,
    pub started_unix_ms: u64,
    pub started: Instant,
    /// The pump's inbox: stdin, signals of exit, resize.
    pub mailbox: Mailbox,
    pub state: Mutex<ProcState>,
}

impl Proc {
    pub fn info(&self) -> ProcInfo {
        ProcInfo {
            proc: self.id,
            pid: self.pid,
            argv: self.argv.clone(),
            tag: self.tag.clone(),
            background: self.background,
            pty: self.pty,
            started_unix_ms: self.started_unix_ms,
            // Without the audit record: a listing of many processes would
            // not fit one frame with theirs (the exec's answer carries it).
            exit: lock(&self.state).exit.clone().map(|mut e| {
                e.audit = None;
                e
            }),
        }
    }
}

#[derive(Default)]
struct Table {
    by_pid: HashMap<i32, Arc<Proc>>,
    by_id: BTreeMap<u64, Arc<Proc>>,
    /// Exit statuses (with when they were reaped) that arrived before their
    /// spawner registered the pid (a child of the fork fallback can exit
    /// before `spawn` returns), and of orphans we adopted as PID 1. An
    /// orphan's pid is reused by later children, so an entry is claimed
    /// only by a child spawned before it was reaped (see `register`).
    unclaimed: HashMap<i32, (Reaped, Instant)>,
    unclaimed_order: VecDeque<(i32, Instant)>,
    finished: VecDeque<u64>,
}

const MAX_UNCLAIMED: usize = 4096;

#[derive(Default)]
pub struct Procs {
    table: Mutex<Table>,
    next_id: AtomicU64,
}

impl Procs {
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Tracks a started child whose spawn began at `spawned`. The SIGCHLD
    /// reaper may have collected it already (it can exit before `spawn`
    /// returns; pidfd children included: kernels deliver SIGCHLD for a
    /// clone with exit signal 0 too, seen on 6.18); a status waiting under
    /// its pid counts only if it was reaped after `spawned`, since earlier
    /// ones are an old orphan's whose pid this child reuses. (An orphan
    /// reaped in the instant between `spawned` and the clone, whose pid the
    /// clone then reuses, would still pass: that needs the pid space to
    /// wrap onto that very pid within the spawn.)
    pub fn register(&self, p: Arc<Proc>, spawned: Instant) {
        let mut t = lock(&self.table);
        t.by_id.insert(p.id, p.clone());
        let waiting = t.unclaimed.remove(&p.pid);
        if waiting.is_some() {
            t.unclaimed_order.retain(|&(x, _)| x != p.pid);
        }
        match waiting {
            Some(((status, usage), reaped)) if reaped >= spawned => {
                p.mailbox.send(Msg::Exited(status, usage));
            }
            _ => {
                t.by_pid.insert(p.pid, p);
            }
        }
    }

    /// Called by the reaper for every child it collects.
    pub fn reaped(&self, pid: i32, status: i32, usage: Option<ResourceUsage>) {
        let mut t = lock(&self.table);
        if let Some(p) = t.by_pid.remove(&pid) {
            p.mailbox.send(Msg::Exited(status, usage));
            return;
        }
        let now = Instant::now();
        t.unclaimed.insert(pid, ((status, usage), now));
        t.unclaimed_order.push_back((pid, now));
        while t.unclaimed_order.len() > MAX_UNCLAIMED {
            if let Some((old, at)) = t.unclaimed_order.pop_front() {
                // A reused pid's newer status stays.
                if t.unclaimed.get(&old).is_some_and(|&(_, a)| a == at) {
                    t.unclaimed.remove(&old);
                }
            }
        }
    }

    /// The pump reaped `pid` itself (through its pidfd).
    pub fn forget_pid(&self, pid: i32) {
        lock(&self.table).by_pid.remove(&pid);
    }

    pub fn get(&self, id: u64) -> Option<Arc<Proc>> {
        lock(&self.table).by_id.get(&id).cloned()
    }

    pub fn list(&self) -> Vec<ProcInfo> {
        let procs: Vec<Arc<Proc>> = lock(&self.table).by_id.values().cloned().collect();
        procs.iter().map(|p| p.info()).collect()
    }

    /// The process's pump is done. Foreground processes leave the table;
    /// background ones stay listable (the newest few) so a caller can still
    /// read their exit status and output.
    pub fn finished(&self, p: &Proc) {
        let mut t = lock(&self.table);
        if !p.background {
            t.by_id.remove(&p.id);
            return;
        }
        t.finished.push_back(p.id);
        while t.finished.len() > limits::MAX_FINISHED_PROCS {
            if let Some(old) = t.finished.pop_front() {
                t.by_id.remove(&old);
            }
        }
    }

    /// Ids of processes still running.
    pub fn running_pids(&self) -> Vec<i32> {
        lock(&self.table).by_pid.keys().copied().collect()
    }
}

/// Collects every exited child (ours and, as PID 1, adopted orphans).
pub fn reap_all(procs: &Procs) {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: rusage is plain data filled by the kernel.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: status and ru are valid out pointers.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut ru) };
        if pid <= 0 {
            return;
        }
        procs.reaped(pid, status, Some(super::sys::rusage_usage(&ru)));
    }
}

/// A reaped child: raw wait status and rusage.
type Reaped = (i32, Option<ResourceUsage>);

/// Decodes a raw wait status.
pub fn exit_status(raw: i32, started: Instant, timed_out: bool) -> ExitStatus {
    let (code, signal) = if libc::WIFEXITED(raw) {
        (Some(libc::WEXITSTATUS(raw)), None)
    } else if libc::WIFSIGNALED(raw) {
        (None, Some(libc::WTERMSIG(raw)))
    } else {
        (None, None)
    };
    ExitStatus {
        code,
        signal,
        timed_out,
        duration_us: started.elapsed().as_micros() as u64,
        usage: None,
        oom_killed: false,
        audit: None,
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads are reused across requests: waking an idle worker is cheaper
/// than creating a thread, and exec latency is the hot path. A request
/// never waits for a busy worker: with none idle, a new one is started.
pub struct Pool {
    tx: Sender<Job>,
    rx: Receiver<Job>,
    idle: Arc<AtomicUsize>,
}

const IDLE_EXIT: Duration = Duration::from_secs(30);

impl Default for Pool {
    fn default() -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        Pool {
            tx,
            rx,
            idle: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl Pool {
    pub fn execute(&self, job: Job) {
        // Claim an idle worker if there is one.
        let mut n = self.idle.load(Ordering::Acquire);
        while n > 0 {
            match self
                .idle
                .compare_exchange(n, n - 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    if self.tx.send(job).is_err() {
                        log::error!("worker pool channel closed");
                    }
                    return;
                }
                Err(cur) => n = cur,
            }
        }
        let rx = self.rx.clone();
        let idle = self.idle.clone();
        let spawned = std::thread::Builder::new()
            .name("agent-worker".into())
            .stack_size(512 * 1024)
            .spawn(move || {
                job();
                worker_loop(rx, idle);
            });
        if let Err(e) = spawned {
            log::error!("cannot start worker thread: {e}");
        }
    }
}

fn worker_loop(rx: Receiver<Job>, idle: Arc<AtomicUsize>) {
    loop {
        idle.fetch_add(1, Ordering::AcqRel);
        loop {
            match rx.recv_timeout(IDLE_EXIT) {
                Ok(job) => {
                    // The submitter already took us off the idle count.
                    job();
                    break;
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    // Leave only if no submitter has claimed this idle slot.
                    let mut n = idle.load(Ordering::Acquire);
                    loop {
                        if n == 0 {
                            break;
                        }
                        match idle.compare_exchange(n, n - 1, Ordering::AcqRel, Ordering::Acquire) {
                            Ok(_) => return,
                            Err(cur) => n = cur,
                        }
                    }
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_drops_oldest_and_reads_across_chunks() {
        let mut r = Ring::new(10);
        r.push(1, b"hello");
        r.push(2, b"world");
        assert_eq!(r.read(0, 100), Some((1, &b"hello"[..])));
        assert_eq!(r.read(7, 100), Some((2, &b"rld"[..])));
        r.push(1, b"!!");
        assert_eq!(r.start, 5);
        assert_eq!(r.end, 12);
        assert_eq!(r.read(3, 100), None);
        assert_eq!(r.read(10, 1), Some((1, &b"!"[..])));
    }

    fn proc(id: u64, pid: i32) -> (Arc<Proc>, Receiver<Msg>) {
        let (mailbox, rx) = Mailbox::new(None);
        let p = Proc {
            id,
            pid,
            argv: vec!["x".into()],
            tag: None,
            background: false,
            pty: false,
            started_unix_ms: 0,
            started: Instant::now(),
            mailbox,
            state: Mutex::new(ProcState {
                exit: None,
                ring: Ring::new(0),
                attachers: Vec::new(),
            }),
        };
        (Arc::new(p), rx)
    }

    fn exited(rx: &Receiver<Msg>) -> Option<i32> {
        match rx.try_recv() {
            Ok(Msg::Exited(s, _)) => Some(s),
            _ => None,
        }
    }

    /// An adopted orphan's status waits under its pid; a later child that
    /// reuses the pid must not take it as its own exit.
    #[test]
    fn an_orphans_status_is_never_a_later_childs_exit() {
        let procs = Procs::default();
        procs.reaped(100, 9, None);
        let spawned = Instant::now();
        let (b, rx_b) = proc(2, 100);
        procs.register(b, Instant::now());
        assert_eq!(exited(&rx_b), None);
        // Reaped while registered: delivered.
        procs.reaped(100, 0, None);
        assert_eq!(exited(&rx_b), Some(0));
        // A child reaped before it was registered (exited during its spawn): claimed.
        procs.reaped(101, 256, None);
        let (c, rx_c) = proc(3, 101);
        procs.register(c, spawned);
        assert_eq!(exited(&rx_c), Some(256));
    }
}
