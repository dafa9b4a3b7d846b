//! The per-session DNS forwarder behind a domain allowlist.
//!
//! It listens on the TAP address (the guest's gateway) port 53, UDP and
//! TCP, with sockets opened inside the session namespace, and runs on one
//! small thread per session that lives in the host namespace, so its
//! upstream queries leave from the host like the daemon's own traffic
//! (they are not subject to the session's egress rules, and a resolver on
//! the host's loopback works). Allowed names are forwarded to the
//! configured upstream resolvers; their A records are put into the
//! session's nftables set with a timeout of the record's TTL (clamped)
//! *before* the guest gets the answer, so its first connect already
//! passes. Everything else is answered locally (see [`dns::classify`]).
//!
//! Blocking I/O: one query at a time per session; a slow upstream delays
//! only this session's next query.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::cidr::Cidr;
use super::dns::{self, Action, Query};
use super::firewall::SET;
use super::nft::Nft;
use super::policy::DnsNames;
use super::{netns, NetError, Result};
use crate::sync::lock;

/// Queries served per TCP connection, and its idle timeout: a guest holding
/// a connection open only delays its own UDP queries, by at most this.
const TCP_QUERIES: usize = 16;
const TCP_IDLE: Duration = Duration::from_millis(1000);

/// Forwarder settings (from [`super::NetConfig`]).
#[derive(Debug, Clone)]
pub(super) struct FwdConfig {
    pub upstreams: Vec<SocketAddr>,
    pub timeout: Duration,
    pub ttl_min: u32,
    pub ttl_max: u32,
    pub max_addrs: usize,
    pub table: String,
    /// Never added to the set (the firewall drops them anyway).
    pub blocked: Vec<Cidr>,
    pub exceptions: Vec<Cidr>,
}

/// State shared with `set_policy`: the allowed names, and when each
/// address we put into the kernel set expires there.
pub(super) struct Shared {
    pub allowed: Arc<DnsNames>,
    pub known: HashMap<Ipv4Addr, Instant>,
}

pub(super) struct Forwarder {
    pub shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

pub(super) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned right away.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(NetError::io("eventfd".into(), io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Forwarder {
    /// Bind `listen`:53 (UDP, TCP) and a netfilter socket inside the
    /// session namespace `ns`, then serve from a thread that moves into
    /// `host_ns` (`None`: stays in the caller's namespace).
    pub fn start(
        id: &str,
        ns: &File,
        listen: Ipv4Addr,
        host_ns: Option<File>,
        cfg: FwdConfig,
        allowed: DnsNames,
        audit: crate::audit::Slot,
    ) -> Result<Forwarder> {
        if cfg.upstreams.is_empty() {
            return Err(NetError::invalid(format!(
                "session {id}: a DNS resolver needs dns_upstreams in the network config"
            )));
        }
        let what = format!("session {id} DNS forwarder");
        let (udp, tcp, nft) = netns::within(ns, &what, || {
            let ctx = |w: &str, e| NetError::io(format!("{what}: {w} {listen}:53"), e);
            let udp = UdpSocket::bind((listen, 53)).map_err(|e| ctx("bind udp", e))?;
            let tcp = TcpListener::bind((listen, 53)).map_err(|e| ctx("bind tcp", e))?;
            udp.set_nonblocking(true)
                .map_err(|e| ctx("nonblocking udp", e))?;
            tcp.set_nonblocking(true)
                .map_err(|e| ctx("nonblocking tcp", e))?;
            Ok((udp, tcp, Nft::open(&what)?))
        })?;
        let shared = Arc::new(Mutex::new(Shared {
            allowed: Arc::new(allowed),
            known: HashMap::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new(eventfd()?);
        let mut w = Worker {
            id: id.to_string(),
            cfg,
            udp,
            tcp,
            nft,
            shared: shared.clone(),
            stop: stop.clone(),
            wake: wake.clone(),
            audit,
        };
        let thread = std::thread::Builder::new()
            .name(format!("dns-{id}"))
            .spawn(move || {
                // Its own allowlist, narrower than the session thread's
                // that starts it (no-op when the daemon is not hardened).
                if let Err(e) = crate::harden::install_current(crate::harden::ThreadKind::Dns) {
                    log::error!("{}: {e}; not serving", w.id);
                    return;
                }
                if let Some(h) = host_ns {
                    if let Err(e) = netns::enter(&h, "host netns") {
                        log::error!("{}: {e}; not serving", w.id);
                        return;
                    }
                }
                w.run();
            })
            .map_err(|e| NetError::io(format!("spawn DNS thread of session {id}"), e))?;
        Ok(Forwarder {
            shared,
            stop,
            wake,
            thread: Some(thread),
        })
    }

    /// Ask the thread to stop (it closes its sockets within one poll).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8-byte write to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        // Not joined: it may be waiting for an upstream (bounded by the
        // timeout), and teardown must not wait for that.
        self.thread.take();
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    id: String,
    cfg: FwdConfig,
    udp: UdpSocket,
    tcp: TcpListener,
    nft: Nft,
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    wake: Arc<OwnedFd>,
    /// The session refused names are recorded for (`egress`, `via: dns`).
    audit: crate::audit::Slot,
}

pub(super) fn random_u16() -> u16 {
    let mut b = [0u8; 2];
    // SAFETY: writes at most 2 bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 2, 0) };
    if n != 2 {
        // Not expected on Linux ≥ 3.17; fall back to the clock's low bits.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        return (t ^ std::process::id()) as u16;
    }
    u16::from_ne_bytes(b)
}

impl Worker {
    fn run(&mut self) {
        let mut buf = vec![0u8; dns::MAX_QUERY + 1];
        while !self.stop.load(Ordering::SeqCst) {
            let mut fds = [
                libc::pollfd {
                    fd: self.udp.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.tcp.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.wake.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: valid pollfd array.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!("{}: DNS poll: {e}; stopping", self.id);
                    return;
                }
                continue;
            }
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            if fds[0].revents != 0 {
                // Drain what is queued; each datagram gets one answer.
                while let Ok((len, peer)) = self.udp.recv_from(&mut buf) {
                    if len > dns::MAX_QUERY {
                        continue; // oversized: dropped, it could only be junk
                    }
                    let msg = buf[..len].to_vec();
                    if let Some(r) = self.handle(&msg, false) {
                        let _ = self.udp.send_to(&r, peer);
                    }
                }
            }
            if fds[1].revents != 0 {
                loop {
                    match self.tcp.accept() {
                        Ok((c, _)) => self.serve_tcp(c),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            // E.g. out of descriptors: do not spin on it.
                            log::warn!("{}: DNS accept: {e}", self.id);
                            std::thread::sleep(Duration::from_millis(50));
                            break;
                        }
                    }
                }
            }
        }
    }

    fn serve_tcp(&mut self, mut c: TcpStream) {
        if c.set_nonblocking(false).is_err()
            || c.set_read_timeout(Some(TCP_IDLE)).is_err()
            || c.set_write_timeout(Some(TCP_IDLE)).is_err()
        {
            return;
        }
        for _ in 0..TCP_QUERIES {
            let mut l = [0u8; 2];
            if c.read_exact(&mut l).is_err() {
                return;
            }
            let len = usize::from(u16::from_be_bytes(l));
            if len == 0 || len > dns::MAX_QUERY {
                return;
            }
            let mut msg = vec![0u8; len];
            if c.read_exact(&mut msg).is_err() {
                return;
            }
            let Some(r) = self.handle(&msg, true) else {
                return;
            };
            let Ok(rl) = u16::try_from(r.len()) else {
                return;
            };
            let mut out = rl.to_be_bytes().to_vec();
            out.extend_from_slice(&r);
            if c.write_all(&out).is_err() {
                return;
            }
        }
    }

    fn handle(&mut self, msg: &[u8], tcp: bool) -> Option<Vec<u8>> {
        let allowed = lock(&self.shared).allowed.clone();
        let refused = std::cell::RefCell::new(None);
        let action = dns::classify_by(msg, |n| {
            let ok = allowed.allows(n);
            if !ok {
                *refused.borrow_mut() = Some(n.to_string());
            }
            ok
        });
        match action {
            Action::Drop => None,
            Action::Reply(r) => {
                log::debug!("{}: DNS answered locally (rcode {})", self.id, r[3] & 0x0f);
                let tag = lock(&self.audit).clone();
                if let (Some(t), Some(name)) = (tag, refused.into_inner()) {
                    t.record(
                        "egress",
                        serde_json::json!({
                            "decision": "refused", "via": "dns", "name": name,
                            "reason": "NotListed", "rcode": r.get(3).map(|b| b & 0x0f),
                        }),
                    );
                }
                Some(r)
            }
            Action::Forward(q) => Some(self.resolve(&q, tcp)),
        }
    }

    fn resolve(&mut self, q: &Query, tcp: bool) -> Vec<u8> {
        let ups = self.cfg.upstreams.clone();
        for up in ups {
            let id = random_u16();
            let query = dns::upstream_query(q, id);
            let mut resp = if tcp {
                tcp_exchange(up, &query, self.cfg.timeout)
            } else {
                udp_exchange(up, &query, id, self.cfg.timeout)
            };
            // Truncated over UDP: ask the same upstream over TCP for the
            // full answer (the guest may still get TC below).
            if matches!(&resp, Ok(r) if r.len() > 3 && r[2] & 0x02 != 0) {
                if let Ok(r) = tcp_exchange(up, &query, self.cfg.timeout) {
                    resp = Ok(r);
                }
            }
            let resp = match resp {
                Ok(r) => r,
                Err(e) => {
                    log::warn!("{}: DNS upstream {up}: {e}", self.id);
                    continue;
                }
            };
            let ans = match dns::parse_response(&resp, id, q, self.cfg.ttl_max) {
                Ok(a) => a,
                Err(e) => {
                    log::warn!("{}: DNS upstream {up}: bad response: {e}", self.id);
                    continue;
                }
            };
            // Fail closed the other way round: no answer before the
            // addresses are in the set (else the guest's connect fails).
            // Resolving every name opens nothing: the mode's rules decide.
            let opens = lock(&self.shared).allowed.opens_firewall();
            if opens {
                if let Err(e) = self.allow(&ans.addrs) {
                    log::error!("{}: adding DNS answers to the set: {e}", self.id);
                    return dns::reply(q, dns::RCODE_SERVFAIL);
                }
            }
            if !tcp && ans.reply.len() > q.udp_limit {
                return dns::truncated_reply(q);
            }
            return ans.reply;
        }
        dns::reply(q, dns::RCODE_SERVFAIL)
    }

    /// Put the addresses into the session's set, each for its clamped TTL.
    fn allow(&mut self, addrs: &[(Ipv4Addr, u32)]) -> Result<()> {
        let c = &self.cfg;
        let now = Instant::now();
        let mut sh = lock(&self.shared);
        let mut put = Vec::new();
        for &(a, ttl) in addrs {
            let blocked = c.blocked.iter().any(|b| b.contains(a))
                && !c.exceptions.iter().any(|b| b.contains(a));
            if blocked {
                log::info!(
                    "{}: DNS answer {a} is in the blocked set; not allowed",
                    self.id
                );
                continue;
            }
            let secs = ttl.clamp(c.ttl_min, c.ttl_max);
            let until = now + Duration::from_secs(u64::from(secs));
            // Already there for at least as long: nothing to do.
            if sh.known.get(&a).is_some_and(|t| *t >= until) || put.iter().any(|(p, _)| *p == a) {
                continue;
            }
            put.push((a, u64::from(secs) * 1000));
        }
        if put.is_empty() {
            return Ok(());
        }
        if sh.known.len() + put.len() > c.max_addrs {
            sh.known.retain(|_, t| *t > now);
            if sh.known.len() + put.len() > c.max_addrs {
                return Err(NetError::invalid(format!(
                    "session {}: more than {} resolved addresses live",
                    self.id, c.max_addrs
                )));
            }
        }
        let mut b = self.nft.batch();
        b.put_set_elems(&c.table, SET, &put);
        self.nft.commit(b)?;
        for (a, ms) in put {
            sh.known.insert(a, now + Duration::from_millis(ms));
        }
        Ok(())
    }
}

pub(super) fn udp_exchange(
    up: SocketAddr,
    q: &[u8],
    id: u16,
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    let bind: SocketAddr = if up.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    // A fresh socket per query: a random source port, and only the
    // upstream's datagrams reach it (connected).
    let s = UdpSocket::bind(bind)?;
    s.connect(up)?;
    s.send(q)?;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 65535];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer"));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.recv(&mut buf)?;
        if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

fn tcp_exchange(up: SocketAddr, q: &[u8], timeout: Duration) -> io::Result<Vec<u8>> {
    let mut c = TcpStream::connect_timeout(&up, timeout)?;
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    let mut out = (q.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(q);
    c.write_all(&out)?;
    let mut l = [0u8; 2];
    c.read_exact(&mut l)?;
    let mut r = vec![0u8; usize::from(u16::from_be_bytes(l))];
    c.read_exact(&mut r)?;
    Ok(r)
}
