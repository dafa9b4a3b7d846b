//! The process tree of audited execs, from the kernel's process events
//! connector (netlink `NETLINK_CONNECTOR`, group `CN_IDX_PROC`).
//!
//! One socket and one listener thread, made on the first audited exec.
//! The agent subscribes (`PROC_CN_MCAST_LISTEN`) while at least one audited
//! exec runs and unsubscribes when the last ends, so the kernel emits
//! nothing for unaudited work.
//!
//! Attribution is by descent: an exec's root process is tracked from its
//! fork event on, and every process forked by a tracked one (by thread
//! group id) joins the same exec. The root's pid is known only once the
//! spawn returns, so while an exec is between its start and that point,
//! events of untracked processes are kept in a short buffer and replayed
//! when the root is named. A tracked pid leaves on its exit, so a reused
//! pid is not misattributed. What it misses: processes that left the tree
//! by other means than fork (none can join it otherwise), events the
//! kernel dropped when the socket's buffer overran (noted), and anything
//! after the exec's answer (noted as still running).

use crate::proto::audit::limits;
use crate::proto::{ProcEvent, ProcEventKind};
use crate::sync::lock;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_CN_MCAST_IGNORE: u32 = 2;
const NLMSG_HDRLEN: usize = 16;
const CN_MSG_LEN: usize = 20;
const NLMSG_DONE: u16 = 3;
const NLMSG_ERROR: u16 = 2;
const NLMSG_NOOP: u16 = 1;

const WHAT_NONE: u32 = 0;
const WHAT_FORK: u32 = 0x1;
const WHAT_EXEC: u32 = 0x2;
const WHAT_UID: u32 = 0x4;
const WHAT_EXIT: u32 = 0x8000_0000;

/// Untracked events kept while an exec's root is not yet named.
const RECENT_MAX: usize = 4096;
/// Receive buffer asked for: a fork flood queues thousands of events.
const RCVBUF: libc::c_int = 8 << 20;
/// Argument bytes recorded per exec over all its events; after that only
/// argv\[0] (keeps the record far below the frame limit).
const ARGV_BUDGET: usize = 192 * 1024;

/// One decoded connector event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Raw {
    /// Reply to a subscription change; `err` non-zero if refused.
    Ack {
        err: u32,
    },
    Fork {
        ts: u64,
        parent_tgid: i32,
        child_pid: i32,
        child_tgid: i32,
    },
    Exec {
        ts: u64,
        pid: i32,
        tgid: i32,
    },
    Uid {
        ts: u64,
        pid: i32,
        tgid: i32,
        ruid: u32,
        euid: u32,
    },
    Exit {
        ts: u64,
        pid: i32,
        tgid: i32,
        /// Wait status (`code << 8 | signal`).
        status: u32,
        parent_tgid: i32,
    },
    Other,
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off + 4)?;
    Some(u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    u32_at(b, off).map(|v| v as i32)
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    let s = b.get(off..off + 8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_ne_bytes(a))
}

/// One `struct proc_event` (linux/cn_proc.h): what, cpu, timestamp_ns,
/// then the union at offset 16.
pub fn parse_proc_event(b: &[u8]) -> Option<Raw> {
    let what = u32_at(b, 0)?;
    let ts = u64_at(b, 8)?;
    let d = 16;
    Some(match what {
        WHAT_NONE => Raw::Ack { err: u32_at(b, d)? },
        WHAT_FORK => Raw::Fork {
            ts,
            parent_tgid: i32_at(b, d + 4)?,
            child_pid: i32_at(b, d + 8)?,
            child_tgid: i32_at(b, d + 12)?,
        },
        WHAT_EXEC => Raw::Exec {
            ts,
            pid: i32_at(b, d)?,
            tgid: i32_at(b, d + 4)?,
        },
        WHAT_UID => Raw::Uid {
            ts,
            pid: i32_at(b, d)?,
            tgid: i32_at(b, d + 4)?,
            ruid: u32_at(b, d + 8)?,
            euid: u32_at(b, d + 12)?,
        },
        WHAT_EXIT => Raw::Exit {
            ts,
            pid: i32_at(b, d)?,
            tgid: i32_at(b, d + 4)?,
            status: u32_at(b, d + 8)?,
            // Kernels before 4.18 end the struct before the parent.
            parent_tgid: i32_at(b, d + 20).unwrap_or(0),
        },
        _ => Raw::Other,
    })
}

/// Every proc event in one datagram (netlink messages, each a `cn_msg`
/// with its payload). Malformed parts end the walk.
pub fn parse_datagram(buf: &[u8]) -> Vec<Raw> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + NLMSG_HDRLEN <= buf.len() {
        let Some(len) = u32_at(buf, off).map(|l| l as usize) else {
            break;
        };
        if len < NLMSG_HDRLEN || off + len > buf.len() {
            break;
        }
        let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        let msg = &buf[off + NLMSG_HDRLEN..off + len];
        if ty != NLMSG_ERROR && ty != NLMSG_NOOP && msg.len() >= CN_MSG_LEN {
            let idx = u32_at(msg, 0);
            let val = u32_at(msg, 4);
            let dlen = u16::from_ne_bytes([msg[16], msg[17]]) as usize;
            if idx == Some(CN_IDX_PROC) && val == Some(CN_VAL_PROC) {
                if let Some(ev) = msg
                    .get(CN_MSG_LEN..CN_MSG_LEN + dlen)
                    .and_then(parse_proc_event)
                {
                    out.push(ev);
                }
            }
        }
        // NLMSG_ALIGN(len)
        off += (len + 3) & !3;
    }
    out
}

/// A subscription change message.
fn mcast_msg(op: u32) -> Vec<u8> {
    let total = NLMSG_HDRLEN + CN_MSG_LEN + 4;
    let mut m = Vec::with_capacity(total);
    m.extend_from_slice(&(total as u32).to_ne_bytes());
    m.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // ack
    m.extend_from_slice(&4u16.to_ne_bytes()); // len
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&op.to_ne_bytes());
    m
}

/// Bounded argv from a NUL-separated `/proc/PID/cmdline`.
pub fn parse_cmdline(raw: &[u8], max_args: usize, max_bytes: usize) -> (Vec<String>, bool) {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    if raw.is_empty() {
        return (Vec::new(), false);
    }
    let mut truncated = false;
    let mut out = Vec::new();
    for (i, a) in raw.split(|b| *b == 0).enumerate() {
        if i >= max_args {
            truncated = true;
            break;
        }
        let mut s = String::from_utf8_lossy(a).into_owned();
        truncated |= crate::proto::audit::cut(&mut s, max_bytes);
        out.push(s);
    }
    (out, truncated)
}

/// Real and effective uid from `/proc/PID/status`.
pub fn parse_status_uids(status: &str) -> Option<(u32, u32)> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    let mut it = line["Uid:".len()..].split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Exit code or signal from a wait status.
pub fn exit_of(status: u32) -> (Option<i32>, Option<i32>) {
    let sig = (status & 0x7f) as i32;
    if sig == 0 {
        (Some(((status >> 8) & 0xff) as i32), None)
    } else {
        (None, Some(sig))
    }
}

fn read_argv(pid: i32) -> Option<(Vec<String>, bool)> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(parse_cmdline(&raw, limits::MAX_ARGV, limits::MAX_ARG_BYTES))
}

fn read_uids(pid: i32) -> Option<(u32, u32)> {
    parse_status_uids(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// A process of an audited exec.
struct Track {
    audit: u64,
    ppid: i32,
    uid: u32,
    euid: u32,
    /// The root is named before its fork event may have been read; until
    /// then events of an earlier holder of the pid are not its own.
    forked: bool,
}

struct Rec {
    start_ns: u64,
    events: Vec<ProcEvent>,
    dropped: u64,
    argv_bytes: usize,
    root: Option<i32>,
    overruns_at_start: u64,
}

/// An untracked event, with what only the moment could tell (argv).
struct Pending {
    raw: Raw,
    argv: Option<(Vec<String>, bool)>,
    uids: Option<(u32, u32)>,
}

#[derive(Default)]
struct State {
    recs: HashMap<u64, Rec>,
    tracked: HashMap<i32, Track>,
    recent: VecDeque<Pending>,
    /// Audits whose root is not yet named: untracked events are kept
    /// only while there is one.
    unnamed: usize,
    next_id: u64,
    /// Receive buffer overruns (ENOBUFS): events the kernel dropped.
    overruns: u64,
}

pub struct Watch {
    sock: OwnedFd,
    state: Mutex<State>,
}

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The listener, made on first use; `Err` says why there is none.
pub fn watch() -> Result<&'static Arc<Watch>, &'static str> {
    static W: OnceLock<Result<Arc<Watch>, String>> = OnceLock::new();
    W.get_or_init(|| {
        Watch::open().map_err(|e| {
            log::info!("process events connector unavailable: {e}");
            format!("process events connector unavailable ({e}): no process tree")
        })
    })
    .as_ref()
    .map_err(String::as_str)
}

impl Watch {
    fn open() -> io::Result<Arc<Watch>> {
        // SAFETY: plain socket(2).
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::NETLINK_CONNECTOR,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: valid option pointer and size; FORCE needs CAP_NET_ADMIN,
        // the plain one is the fallback.
        unsafe {
            let v = RCVBUF;
            let p = &v as *const libc::c_int as *const libc::c_void;
            let n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            if libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, p, n) < 0 {
                libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, p, n);
            }
        }
        // SAFETY: zeroed sockaddr_nl is valid; fields set below.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        sa.nl_groups = CN_IDX_PROC;
        // SAFETY: valid address of the given size.
        let r = unsafe {
            libc::bind(
                fd,
                &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let w = Watch {
            sock,
            state: Mutex::new(State::default()),
        };
        // Probe: a kernel with PROC_EVENTS acknowledges a subscription.
        w.send(PROC_CN_MCAST_LISTEN)?;
        let acked = w.wait_ack(Duration::from_secs(2));
        w.send(PROC_CN_MCAST_IGNORE)?;
        match acked {
            Some(0) => {}
            Some(err) => return Err(io::Error::from_raw_os_error(err as i32)),
            None => {
                return Err(io::Error::other(
                    "no answer to PROC_CN_MCAST_LISTEN (kernel without CONFIG_PROC_EVENTS?)",
                ))
            }
        }
        let w = Arc::new(w);
        let t = w.clone();
        std::thread::Builder::new()
            .name("proc-events".into())
            .spawn(move || t.run())?;
        Ok(w)
    }

    fn send(&self, op: u32) -> io::Result<()> {
        let m = mcast_msg(op);
        // SAFETY: zeroed sockaddr_nl is valid: the kernel (port 0).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: buffer and address valid for their lengths.
        let r = unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                m.as_ptr() as *const libc::c_void,
                m.len(),
                0,
                &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The first subscription ack within `wait` (before the listener runs).
    fn wait_ack(&self, wait: Duration) -> Option<u32> {
        let deadline = std::time::Instant::now() + wait;
        let mut buf = vec![0u8; 8192];
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut p = [libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if !matches!(super::super::sys::poll(&mut p, Some(left)), Ok(n) if n > 0) {
                continue;
            }
            let Ok(Some(n)) = self.recv(&mut buf) else {
                continue;
            };
            for ev in parse_datagram(&buf[..n]) {
                if let Raw::Ack { err } = ev {
                    return Some(err);
                }
            }
        }
    }

    /// One datagram without blocking; `Ok(None)` when none is queued.
    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: buf is valid for writes of its length.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(n as usize))
    }

    fn run(&self) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let mut p = [libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if let Err(e) = super::super::sys::poll(&mut p, None) {
                log::warn!("proc events: poll: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            let mut st = lock(&self.state);
            self.drain(&mut st, &mut buf);
        }
    }

    /// Handles every queued datagram. Runs under the state lock, so once
    /// the lock is held and the socket is empty, every event the kernel
    /// queued so far is accounted for.
    fn drain(&self, st: &mut State, buf: &mut [u8]) {
        loop {
            match self.recv(buf) {
                Ok(Some(n)) => {
                    for ev in parse_datagram(&buf[..n]) {
                        st.handle(ev, None);
                    }
                }
                Ok(None) => return,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => st.overruns += 1,
                Err(e) => {
                    log::warn!("proc events: recv: {e}");
                    return;
                }
            }
        }
    }

    /// Starts recording for an exec about to be spawned.
    pub fn begin(&self) -> io::Result<u64> {
        let mut st = lock(&self.state);
        if st.recs.is_empty() {
            self.send(PROC_CN_MCAST_LISTEN)?;
        }
        st.next_id += 1;
        let id = st.next_id;
        let overruns = st.overruns;
        st.recs.insert(
            id,
            Rec {
                start_ns: mono_ns(),
                events: Vec::new(),
                dropped: 0,
                argv_bytes: 0,
                root: None,
                overruns_at_start: overruns,
            },
        );
        st.unnamed += 1;
        Ok(id)
    }

    /// The exec's process is `pid` (just spawned by the agent, uid 0).
    pub fn root(&self, id: u64, pid: i32) {
        let mut st = lock(&self.state);
        let Some(rec) = st.recs.get_mut(&id) else {
            return;
        };
        if rec.root.is_some() {
            return;
        }
        rec.root = Some(pid);
        st.unnamed -= 1;
        st.tracked.insert(
            pid,
            Track {
                audit: id,
                ppid: 0,
                uid: 0,
                euid: 0,
                forked: false,
            },
        );
        // Replay what arrived before the root had a name, in order.
        let recent = std::mem::take(&mut st.recent);
        for p in recent {
            let Pending { raw, argv, uids } = p;
            st.handle(raw, Some((argv, uids)));
        }
    }

    /// Ends recording: the exec's events, dropped count and notes.
    pub fn end(&self, id: u64) -> (Vec<ProcEvent>, u64, Vec<String>) {
        let mut st = lock(&self.state);
        // Whatever the kernel queued up to now (the root's exit among it).
        let mut buf = vec![0u8; 64 * 1024];
        self.drain(&mut st, &mut buf);
        // The kernel reports an exit after waking the parent: the root's
        // exit event may trail its reaping by a moment.
        let root = st.recs.get(&id).and_then(|r| r.root);
        for _ in 0..50 {
            let pending = root.is_some_and(|p| st.tracked.get(&p).is_some_and(|t| t.forked));
            if !pending {
                break;
            }
            let mut p = [libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            let _ = super::super::sys::poll(&mut p, Some(Duration::from_millis(4)));
            self.drain(&mut st, &mut buf);
        }
        let mut notes = Vec::new();
        let Some(rec) = st.recs.remove(&id) else {
            return (Vec::new(), 0, notes);
        };
        if rec.root.is_none() {
            st.unnamed -= 1;
        }
        if st.unnamed == 0 {
            st.recent.clear();
        }
        let before = st.tracked.len();
        st.tracked.retain(|_, t| t.audit != id || !t.forked);
        let left = before - st.tracked.len();
        st.tracked.retain(|_, t| t.audit != id);
        if left > 0 {
            notes.push(format!(
                "{left} process(es) of the exec still running at its end: their later events are not recorded"
            ));
        }
        if st.overruns > rec.overruns_at_start {
            notes.push(format!(
                "the kernel dropped process events ({} receive buffer overrun(s)): the tree may be incomplete",
                st.overruns - rec.overruns_at_start
            ));
        }
        if st.recs.is_empty() {
            if let Err(e) = self.send(PROC_CN_MCAST_IGNORE) {
                log::warn!("proc events: unsubscribe: {e}");
            }
        }
        (rec.events, rec.dropped, notes)
    }
}

impl State {
    /// Attributes one event. `replay`: it comes from `recent`, with the
    /// argv and uids read when it arrived.
    #[allow(clippy::type_complexity)]
    fn handle(
        &mut self,
        raw: Raw,
        replay: Option<(Option<(Vec<String>, bool)>, Option<(u32, u32)>)>,
    ) {
        match raw {
            Raw::Fork {
                ts,
                parent_tgid,
                child_pid,
                child_tgid,
            } => {
                // A new thread is not a new process.
                if child_pid != child_tgid {
                    return;
                }
                let from_parent = self
                    .tracked
                    .get(&parent_tgid)
                    .filter(|t| t.forked)
                    .map(|t| (t.audit, t.uid, t.euid));
                let (audit, uid, euid) = match from_parent {
                    Some(x) => x,
                    None => match self.tracked.get_mut(&child_pid) {
                        // The named root's own fork (by the agent).
                        Some(t) if !t.forked => (t.audit, 0, 0),
                        _ => return self.keep(raw, replay),
                    },
                };
                self.tracked.insert(
                    child_pid,
                    Track {
                        audit,
                        ppid: parent_tgid,
                        uid,
                        euid,
                        forked: true,
                    },
                );
                self.record(
                    audit,
                    ts,
                    ProcEventKind::Fork,
                    child_pid,
                    parent_tgid,
                    |e| {
                        e.uid = Some(uid);
                        e.euid = (euid != uid).then_some(euid);
                    },
                );
            }
            Raw::Exec { ts, pid, tgid } => {
                let Some(t) = self.tracked.get(&tgid).filter(|t| t.forked) else {
                    return self.keep(raw, replay);
                };
                let (audit, ppid) = (t.audit, t.ppid);
                let room = self
                    .recs
                    .get(&audit)
                    .is_some_and(|r| r.events.len() < limits::MAX_PROC_EVENTS);
                // Past the cap only the count grows: no /proc reads.
                let (argv, uids) = match replay {
                    Some(x) => x,
                    None if room => (read_argv(pid), read_uids(pid)),
                    None => (None, None),
                };
                if let (Some((u, eu)), Some(t)) = (uids, self.tracked.get_mut(&tgid)) {
                    t.uid = u;
                    t.euid = eu;
                }
                let (uid, euid) = self.tracked.get(&tgid).map_or((0, 0), |t| (t.uid, t.euid));
                let budget_left = self
                    .recs
                    .get(&audit)
                    .map_or(0, |r| ARGV_BUDGET.saturating_sub(r.argv_bytes));
                let argv = argv.map(|(mut a, mut cut)| {
                    let n: usize = a.iter().map(String::len).sum();
                    if n > budget_left && a.len() > 1 {
                        a.truncate(1);
                        cut = true;
                    }
                    (a, cut)
                });
                let used: usize = argv
                    .as_ref()
                    .map_or(0, |(a, _)| a.iter().map(String::len).sum());
                if let Some(r) = self.recs.get_mut(&audit) {
                    r.argv_bytes += used;
                }
                self.record(audit, ts, ProcEventKind::Exec, tgid, ppid, |e| {
                    if let Some((a, cut)) = argv {
                        e.argv = Some(a);
                        e.argv_truncated = cut;
                    }
                    e.uid = Some(uid);
                    e.euid = (euid != uid).then_some(euid);
                });
            }
            Raw::Uid {
                ts,
                pid: _,
                tgid,
                ruid,
                euid,
            } => {
                let Some(t) = self.tracked.get_mut(&tgid).filter(|t| t.forked) else {
                    return self.keep(raw, replay);
                };
                if (t.uid, t.euid) == (ruid, euid) {
                    return;
                }
                t.uid = ruid;
                t.euid = euid;
                let (audit, ppid) = (t.audit, t.ppid);
                self.record(audit, ts, ProcEventKind::Uid, tgid, ppid, |e| {
                    e.uid = Some(ruid);
                    e.euid = (euid != ruid).then_some(euid);
                });
            }
            Raw::Exit {
                ts,
                pid,
                tgid,
                status,
                parent_tgid,
            } => {
                // A thread's end is not the process's.
                if pid != tgid {
                    return;
                }
                let Some(t) = self.tracked.get(&tgid).filter(|t| t.forked) else {
                    return self.keep(raw, replay);
                };
                let (audit, uid) = (t.audit, t.uid);
                let ppid = if parent_tgid > 0 { parent_tgid } else { t.ppid };
                self.tracked.remove(&tgid);
                let (code, signal) = exit_of(status);
                self.record(audit, ts, ProcEventKind::Exit, tgid, ppid, |e| {
                    e.uid = Some(uid);
                    e.exit_code = code;
                    e.signal = signal;
                });
            }
            Raw::Ack { .. } | Raw::Other => {}
        }
    }

    /// An event of no tracked process: kept for a replay only while an
    /// audit's root is unnamed (then the exec event's argv is read now,
    /// while the process still exists).
    #[allow(clippy::type_complexity)]
    fn keep(
        &mut self,
        raw: Raw,
        replay: Option<(Option<(Vec<String>, bool)>, Option<(u32, u32)>)>,
    ) {
        if self.unnamed == 0 {
            return;
        }
        let (argv, uids) = match (replay, &raw) {
            (Some(x), _) => x,
            (None, Raw::Exec { pid, .. }) => (read_argv(*pid), read_uids(*pid)),
            (None, _) => (None, None),
        };
        if self.recent.len() >= RECENT_MAX {
            self.recent.pop_front();
        }
        self.recent.push_back(Pending { raw, argv, uids });
    }

    fn record(
        &mut self,
        audit: u64,
        ts: u64,
        kind: ProcEventKind,
        pid: i32,
        ppid: i32,
        fill: impl FnOnce(&mut ProcEvent),
    ) {
        let Some(r) = self.recs.get_mut(&audit) else {
            return;
        };
        if r.events.len() >= limits::MAX_PROC_EVENTS {
            r.dropped += 1;
            return;
        }
        let mut e = ProcEvent {
            kind,
            pid,
            ppid,
            t_ms: ts.saturating_sub(r.start_ns) / 1_000_000,
            argv: None,
            argv_truncated: false,
            uid: None,
            euid: None,
            exit_code: None,
            signal: None,
        };
        fill(&mut e);
        r.events.push(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn datagram(events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for ev in events {
            let total = NLMSG_HDRLEN + CN_MSG_LEN + ev.len();
            out.extend_from_slice(&(total as u32).to_ne_bytes());
            out.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
            out.extend_from_slice(&[0; 10]);
            out.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
            out.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
            out.extend_from_slice(&[0; 8]);
            out.extend_from_slice(&(ev.len() as u16).to_ne_bytes());
            out.extend_from_slice(&[0; 2]);
            out.extend_from_slice(ev);
            while out.len() % 4 != 0 {
                out.push(0);
            }
        }
        out
    }

    fn ev(what: u32, ts: u64, words: &[u32]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&what.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&ts.to_ne_bytes());
        for w in words {
            b.extend_from_slice(&w.to_ne_bytes());
        }
        b
    }

    #[test]
    fn parses_connector_messages() {
        let d = datagram(&[
            ev(WHAT_FORK, 5, &[10, 10, 11, 11]),
            ev(WHAT_EXEC, 6, &[11, 11]),
            ev(WHAT_UID, 7, &[11, 11, 1000, 1000]),
            ev(WHAT_EXIT, 8, &[11, 11, 3 << 8, 17, 10, 10]),
            ev(WHAT_NONE, 0, &[0]),
            ev(0x40, 9, &[1, 1, 1, 1]),
        ]);
        let got = parse_datagram(&d);
        assert_eq!(
            got,
            vec![
                Raw::Fork {
                    ts: 5,
                    parent_tgid: 10,
                    child_pid: 11,
                    child_tgid: 11
                },
                Raw::Exec {
                    ts: 6,
                    pid: 11,
                    tgid: 11
                },
                Raw::Uid {
                    ts: 7,
                    pid: 11,
                    tgid: 11,
                    ruid: 1000,
                    euid: 1000
                },
                Raw::Exit {
                    ts: 8,
                    pid: 11,
                    tgid: 11,
                    status: 3 << 8,
                    parent_tgid: 10
                },
                Raw::Ack { err: 0 },
                Raw::Other,
            ]
        );
        // Truncated and garbage input: no panic, nothing or a prefix.
        for n in 0..d.len() {
            let _ = parse_datagram(&d[..n]);
        }
        assert!(parse_datagram(&[0xff; 40]).is_empty());
        assert_eq!(exit_of(3 << 8), (Some(3), None));
        assert_eq!(exit_of(9), (None, Some(9)));
    }

    #[test]
    fn cmdline_and_status() {
        let (a, cut) = parse_cmdline(b"sh\0-c\0echo hi\0", 16, 256);
        assert_eq!(a, vec!["sh", "-c", "echo hi"]);
        assert!(!cut);
        let many: Vec<u8> = (0..20).flat_map(|_| b"x\0".to_vec()).collect();
        let (a, cut) = parse_cmdline(&many, 16, 256);
        assert_eq!(a.len(), 16);
        assert!(cut);
        let (a, cut) = parse_cmdline(&[b'y'; 300], 16, 256);
        assert_eq!(a[0].len(), 256);
        assert!(cut);
        assert_eq!(parse_cmdline(b"", 16, 256), (vec![], false));
        let st = "Name:\tsh\nUid:\t1000\t1001\t1000\t1000\nGid:\t0\t0\t0\t0\n";
        assert_eq!(parse_status_uids(st), Some((1000, 1001)));
        assert_eq!(parse_status_uids("Name: x\n"), None);
    }

    fn state_with_audit() -> State {
        let mut st = State::default();
        st.recs.insert(
            1,
            Rec {
                start_ns: 0,
                events: Vec::new(),
                dropped: 0,
                argv_bytes: 0,
                root: None,
                overruns_at_start: 0,
            },
        );
        st.unnamed = 1;
        st
    }

    fn name_root(st: &mut State, pid: i32) {
        st.recs.get_mut(&1).unwrap().root = Some(pid);
        st.unnamed -= 1;
        st.tracked.insert(
            pid,
            Track {
                audit: 1,
                ppid: 0,
                uid: 0,
                euid: 0,
                forked: false,
            },
        );
        for p in std::mem::take(&mut st.recent) {
            st.handle(p.raw, Some((p.argv, p.uids)));
        }
    }

    fn fork(p: i32, c: i32) -> Raw {
        Raw::Fork {
            ts: 1_000_000,
            parent_tgid: p,
            child_pid: c,
            child_tgid: c,
        }
    }

    fn exit(p: i32) -> Raw {
        Raw::Exit {
            ts: 2_000_000,
            pid: p,
            tgid: p,
            status: 0,
            parent_tgid: 0,
        }
    }

    #[test]
    fn attribution_by_descent_with_replay() {
        let mut st = state_with_audit();
        // An earlier holder of pid 50 exits, then the agent (1) forks the
        // root 50, which forks 51 before the root is named.
        st.handle(exit(50), None);
        st.handle(fork(1, 50), None);
        st.handle(fork(50, 51), None);
        st.handle(fork(7, 8), None); // unrelated
        name_root(&mut st, 50);
        // Live from now on.
        st.handle(fork(51, 52), None);
        st.handle(
            Raw::Fork {
                ts: 0,
                parent_tgid: 52,
                child_pid: 53,
                child_tgid: 52,
            },
            None,
        ); // a thread
        st.handle(exit(52), None);
        st.handle(fork(8, 9), None); // unrelated
        let evs = &st.recs[&1].events;
        let got: Vec<(ProcEventKind, i32, i32)> =
            evs.iter().map(|e| (e.kind, e.pid, e.ppid)).collect();
        assert_eq!(
            got,
            vec![
                (ProcEventKind::Fork, 50, 1),
                (ProcEventKind::Fork, 51, 50),
                (ProcEventKind::Fork, 52, 51),
                (ProcEventKind::Exit, 52, 51),
            ]
        );
        assert_eq!(evs[0].t_ms, 1);
        assert!(!st.tracked.contains_key(&52), "an exited pid leaves");
        // Pid reuse after exit: not attributed.
        st.handle(fork(99, 52), None);
        assert_eq!(st.recs[&1].events.len(), 4);
    }

    #[test]
    fn root_named_before_its_fork_is_read() {
        let mut st = state_with_audit();
        name_root(&mut st, 60);
        // Still queued in the socket: the old pid 60's exit, then the fork.
        st.handle(exit(60), None);
        st.handle(fork(1, 60), None);
        st.handle(exit(60), None);
        let kinds: Vec<_> = st.recs[&1].events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, vec![ProcEventKind::Fork, ProcEventKind::Exit]);
    }

    #[test]
    fn flood_is_bounded_and_counted() {
        let mut st = state_with_audit();
        name_root(&mut st, 2);
        st.handle(fork(1, 2), None);
        for c in 3..5003 {
            st.handle(fork(2, c), None);
            st.handle(exit(c), None);
        }
        let r = &st.recs[&1];
        assert_eq!(r.events.len(), limits::MAX_PROC_EVENTS);
        assert_eq!(r.events.len() as u64 + r.dropped, 1 + 2 * 5000);
        assert_eq!(st.tracked.len(), 1, "exited children are not kept");
    }
}
