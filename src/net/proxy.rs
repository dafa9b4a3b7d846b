//! The per-session inspection proxy behind a domain allowlist.
//!
//! An address on a CDN serves thousands of sites, so opening the addresses
//! an allowed name resolves to (the DNS set, [`super::dnsfwd`]) lets a
//! guest reach any site sharing them by naming it in TLS SNI or the HTTP
//! Host header. For sessions whose policy lists `domains` in a mode that
//! ends in drop (`allowlist`, `none`), the session table redirects the
//! guest's TCP to the proxied ports (`proxy_ports`, default 80 and 443) to
//! this proxy, on the TAP address inside the session namespace. Per
//! connection it reads the TLS ClientHello's SNI or the HTTP request's Host
//! header, refuses anything not on the list (no name, an IP literal, a name
//! not listed, a request line naming another host), resolves the name
//! itself through the session's own DNS forwarder, connects to that answer
//! on the port the guest asked for (never to the address the guest chose)
//! from the session namespace, and copies bytes both ways. Traffic passes
//! the session's TAP and veth, so their bandwidth limits apply to it.
//!
//! Plain HTTP is one request per connection: the proxy forwards one
//! request (head with `Connection: close`, and its body by its framing)
//! and nothing after it, so a second request on the same connection cannot
//! name another host. TLS is opaque after the ClientHello (a client that
//! names one host in SNI and another in the encrypted Host header is
//! domain fronting: see docs/security.md).
//!
//! Sessions with injected secrets ([`super::inject`]) go through the
//! proxy whatever their mode. For a host a secret names, TLS is
//! terminated with the session's CA, the request head checked and given
//! the value, and TLS re-originated to the host (verified against
//! `proxy_upstream_ca`). In a mode without a domain list (`internet`,
//! `denylist`, `allowlist` of CIDRs) every other connection goes on to the
//! address the guest chose, if the mode's rules allow it
//! ([`EgressFilter::permits_tcp`]): the proxy's own connections do not
//! pass the session's policy chain, so it applies the rules itself.
//!
//! Threads: one acceptor per session (`proxy-<id>`) and one per
//! connection, all in the session namespace, under the `Proxy` seccomp
//! filter; at most [`MAX_CONNS`] connections per session.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::cidr::Cidr;
use super::dns::{self, Action};
use super::egress::EgressFilter;
use super::inject::{Injection, Rewrite};
use super::policy::DnsNames;
use super::{netns, NetError, Result};
use crate::sync::lock;

/// Concurrent connections per session; more are closed at once (counted).
pub const MAX_CONNS: usize = 256;
/// ... and over all sessions of the daemon (each holds one or two
/// threads): hostile guests together cannot grow the daemon beyond it.
pub const MAX_CONNS_TOTAL: usize = 4096;
static TOTAL_LIVE: AtomicUsize = AtomicUsize::new(0);
/// The first bytes (ClientHello, request head) must arrive within this.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// ... and fit in this (a ClientHello with post-quantum key shares is
/// ~2 KiB; request heads of real clients are far below it).
const MAX_HELLO: usize = 16 << 10;
/// A connection with no byte either way for this long is closed.
const IDLE: Duration = Duration::from_secs(300);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Refusals logged per session (all are counted).
const LOGGED_REFUSALS: u64 = 64;
/// `SO_ORIGINAL_DST` (linux/netfilter_ipv4.h).
const SO_ORIGINAL_DST: libc::c_int = 80;

/// Proxy settings (from [`super::NetConfig`]).
#[derive(Debug, Clone)]
pub(super) struct ProxyConfig {
    /// Where it listens (the TAP address) and on which port.
    pub listen: SocketAddrV4,
    /// Ports the firewall redirects here.
    pub ports: Vec<u16>,
    /// The session's DNS forwarder (same namespace), and its patience.
    pub resolver: SocketAddr,
    pub resolve_timeout: Duration,
    /// Never connected to (the host table drops them anyway).
    pub blocked: Vec<Cidr>,
    pub exceptions: Vec<Cidr>,
    /// How TLS to a secret's host is re-originated (`None`: the bundle
    /// could not be read; interception then answers 502).
    pub upstream_tls: Option<Arc<rustls::ClientConfig>>,
}

/// What the proxy lets through: the session policy's parts it applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Gate {
    /// A domain allowlist in a mode ending in drop ([`super::firewall::proxied`]):
    /// only `names` pass, each to what the proxy resolves. Otherwise the
    /// proxy runs for injection only and the guest's own destinations
    /// pass when `filter` allows them.
    pub proxied: bool,
    pub names: DnsNames,
    pub filter: EgressFilter,
}

/// Why a connection was refused (one counter each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Neither a TLS ClientHello with SNI nor an HTTP request with Host.
    NoName,
    IpLiteral,
    NotListed,
    /// The request line names another host than its Host header.
    Mismatch,
    /// The name did not resolve to a reachable address.
    Unresolved,
    /// No connection to any of its addresses.
    Upstream,
    /// More than [`MAX_CONNS`] at once (or [`MAX_CONNS_TOTAL`] daemon-wide).
    Busy,
    /// A secret's placeholder towards a host the secret is not bound to
    /// (or over plain HTTP).
    Placeholder,
}

impl Refusal {
    fn what(self) -> &'static str {
        match self {
            Refusal::NoName => "no TLS SNI or HTTP Host name",
            Refusal::IpLiteral => "an IP address instead of a name",
            Refusal::NotListed => "a destination the session's egress policy does not allow",
            Refusal::Mismatch => "a request line naming another host than its Host header",
            Refusal::Unresolved => "the name has no reachable address",
            Refusal::Upstream => "no connection to the name's addresses",
            Refusal::Busy => "too many proxied connections at once",
            Refusal::Placeholder => {
                "a secret's placeholder towards a host it is not bound to (or in plain HTTP)"
            }
        }
    }
}

/// What the proxy did for a session, as `GET .../network` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyStats {
    pub connections: u64,
    pub allowed: u64,
    pub refused_no_name: u64,
    pub refused_ip_literal: u64,
    pub refused_not_listed: u64,
    pub refused_mismatch: u64,
    pub refused_unresolved: u64,
    pub refused_upstream: u64,
    pub refused_busy: u64,
    pub refused_placeholder: u64,
    /// TLS connections terminated for a secret's host.
    pub intercepted: u64,
    /// Requests that left with a secret's value in them.
    pub injected: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    allowed: AtomicU64,
    refused: [AtomicU64; 8],
    intercepted: AtomicU64,
    injected: AtomicU64,
}

impl Counters {
    fn refused(&self, r: Refusal) {
        self.refused[r as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> ProxyStats {
        let r = |x: Refusal| self.refused[x as usize].load(Ordering::Relaxed);
        ProxyStats {
            connections: self.connections.load(Ordering::Relaxed),
            allowed: self.allowed.load(Ordering::Relaxed),
            refused_no_name: r(Refusal::NoName),
            refused_ip_literal: r(Refusal::IpLiteral),
            refused_not_listed: r(Refusal::NotListed),
            refused_mismatch: r(Refusal::Mismatch),
            refused_unresolved: r(Refusal::Unresolved),
            refused_upstream: r(Refusal::Upstream),
            refused_busy: r(Refusal::Busy),
            refused_placeholder: r(Refusal::Placeholder),
            intercepted: self.intercepted.load(Ordering::Relaxed),
            injected: self.injected.load(Ordering::Relaxed),
        }
    }

    fn total_refused(&self) -> u64 {
        self.refused.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

/// State shared between the acceptor, its connections and `set_policy`.
struct Shared {
    id: String,
    cfg: ProxyConfig,
    gate: Mutex<Arc<Gate>>,
    inject: Mutex<Option<Arc<Injection>>>,
    counters: Counters,
    live: AtomicUsize,
    stop: AtomicBool,
    /// The session egress decisions are recorded for.
    audit: crate::audit::Slot,
}

impl Shared {
    fn audit(&self, fields: serde_json::Value) {
        let tag = lock(&self.audit).clone();
        if let Some(t) = tag {
            t.record("egress", fields);
        }
    }
}

pub(super) struct Proxy {
    shared: Arc<Shared>,
    wake: Arc<OwnedFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    /// Bind the listener inside the session namespace `ns` and serve from
    /// a thread that enters `ns` too (its connections' upstream sockets
    /// and resolver queries belong there).
    pub fn start(
        id: &str,
        ns: &File,
        cfg: ProxyConfig,
        gate: Gate,
        inject: Option<Arc<Injection>>,
        audit: crate::audit::Slot,
    ) -> Result<Proxy> {
        let what = format!("session {id} egress proxy");
        let listen = cfg.listen;
        let l = netns::within(ns, &what, || {
            let l = TcpListener::bind(listen)
                .map_err(|e| NetError::io(format!("{what}: bind {listen}"), e))?;
            l.set_nonblocking(true)
                .map_err(|e| NetError::io(format!("{what}: nonblocking"), e))?;
            Ok(l)
        })?;
        let ns = ns
            .try_clone()
            .map_err(|e| NetError::io(format!("{what}: dup netns fd"), e))?;
        let shared = Arc::new(Shared {
            id: id.to_string(),
            cfg,
            gate: Mutex::new(Arc::new(gate)),
            inject: Mutex::new(inject),
            counters: Counters::default(),
            live: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            audit,
        });
        let wake = Arc::new(super::dnsfwd::eventfd()?);
        let (sh, wk) = (shared.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{id}"))
            .spawn(move || {
                // Into the namespace first (the filter then need not allow
                // setns); connection threads inherit both.
                if let Err(e) = netns::enter(&ns, "session netns") {
                    log::error!("session {}: egress proxy: {e}; not serving", sh.id);
                    return;
                }
                drop(ns);
                if let Err(e) = crate::harden::install_current(crate::harden::ThreadKind::Proxy) {
                    log::error!("session {}: egress proxy: {e}; not serving", sh.id);
                    return;
                }
                accept_loop(&sh, &l, &wk);
            })
            .map_err(|e| NetError::io(format!("spawn {what} thread"), e))?;
        Ok(Proxy {
            shared,
            wake,
            thread: Some(thread),
        })
    }

    /// The policy changed live: new connections are checked against it;
    /// open ones stay.
    pub fn set_gate(&self, gate: Gate) {
        *lock(&self.shared.gate) = Arc::new(gate);
    }

    /// The session's secrets changed: new connections use these.
    pub fn set_injection(&self, inject: Option<Arc<Injection>>) {
        *lock(&self.shared.inject) = inject;
    }

    pub fn stats(&self) -> ProxyStats {
        self.shared.counters.snapshot()
    }

    fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8-byte write to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Open connections end with the namespace (their links vanish) or
        // at their idle timeout. The acceptor wakes at once and never
        // blocks elsewhere: joined, so its port is free for a successor.
        self.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(sh: &Arc<Shared>, l: &TcpListener, wake: &OwnedFd) {
    while !sh.stop.load(Ordering::SeqCst) {
        let mut fds = [
            libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: valid pollfd array of 2.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                log::error!("session {}: egress proxy poll: {e}; stopping", sh.id);
                return;
            }
            continue;
        }
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        loop {
            let c = match l.accept() {
                Ok((c, _)) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    log::warn!("session {}: egress proxy accept: {e}", sh.id);
                    std::thread::sleep(Duration::from_millis(50));
                    break;
                }
            };
            sh.counters.connections.fetch_add(1, Ordering::Relaxed);
            let own = sh.live.fetch_add(1, Ordering::SeqCst);
            let all = TOTAL_LIVE.fetch_add(1, Ordering::SeqCst);
            let release = |sh: &Shared| {
                sh.live.fetch_sub(1, Ordering::SeqCst);
                TOTAL_LIVE.fetch_sub(1, Ordering::SeqCst);
            };
            if own >= MAX_CONNS || all >= MAX_CONNS_TOTAL {
                release(sh);
                refuse(sh, Refusal::Busy, "", None, c);
                continue;
            }
            let sh2 = sh.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("proxy-{}-c", sh.id))
                .spawn(move || {
                    serve(&sh2, c);
                    release(&sh2);
                });
            if let Err(e) = spawned {
                release(sh);
                log::warn!("session {}: egress proxy: spawn: {e}", sh.id);
            }
        }
    }
}

/// What the first bytes of a connection are.
#[derive(Debug, PartialEq, Eq)]
pub enum Hello {
    /// A TLS ClientHello; its SNI name, if any.
    Tls(Option<String>),
    /// An HTTP request head of `len` bytes; its Host (without port), and
    /// the host of an absolute-form request target, if any.
    Http {
        host: Option<String>,
        target_host: Option<String>,
        len: usize,
        body: Body,
    },
    /// Neither (or a broken one).
    Other,
}

/// How an HTTP request's body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    None,
    Length(u64),
    Chunked,
}

/// Parse what has arrived; `None`: need more bytes.
pub fn parse_hello(b: &[u8]) -> Option<Hello> {
    if b.is_empty() {
        return None;
    }
    if b[0] == 0x16 {
        return tls_sni(b).map(Hello::Tls);
    }
    http_head(b)
}

/// The SNI of a TLS ClientHello that may span several records;
/// `Some(None)`: a ClientHello without SNI, or not one at all.
fn tls_sni(b: &[u8]) -> Option<Option<String>> {
    // Reassemble the handshake message from the records' payloads.
    let mut hs = Vec::new();
    let mut p = 0;
    loop {
        if b.len() < p + 5 {
            return if b.len() >= MAX_HELLO {
                Some(None)
            } else {
                None
            };
        }
        if b[p] != 0x16 || b[p + 1] != 3 {
            return Some(None);
        }
        let len = usize::from(u16::from_be_bytes([b[p + 3], b[p + 4]]));
        if b.len() < p + 5 + len {
            return None;
        }
        hs.extend_from_slice(&b[p + 5..p + 5 + len]);
        p += 5 + len;
        if hs.len() >= 4 {
            if hs[0] != 1 {
                return Some(None); // not a ClientHello
            }
            let need =
                4 + (usize::from(hs[1]) << 16 | usize::from(hs[2]) << 8 | usize::from(hs[3]));
            if hs.len() >= need {
                return Some(client_hello_sni(&hs[4..need]));
            }
        }
    }
}

fn client_hello_sni(m: &[u8]) -> Option<String> {
    let mut r = Reader { b: m, p: 0 };
    r.skip(2 + 32)?; // version, random
    let n = usize::from(r.u8()?);
    r.skip(n)?; // session id
    let n = usize::from(r.u16()?);
    r.skip(n)?; // cipher suites
    let n = usize::from(r.u8()?);
    r.skip(n)?; // compression methods
    let ext_len = usize::from(r.u16()?);
    let end = r.p.checked_add(ext_len)?;
    while r.p + 4 <= end {
        let ty = r.u16()?;
        let len = usize::from(r.u16()?);
        if ty != 0 {
            r.skip(len)?;
            continue;
        }
        // server_name: list length, then (type 0 = host_name, length, name).
        let _list = r.u16()?;
        if r.u8()? != 0 {
            return None;
        }
        let n = usize::from(r.u16()?);
        let name = r.take(n)?;
        let s = std::str::from_utf8(name).ok()?;
        return Some(s.to_ascii_lowercase());
    }
    None
}

struct Reader<'a> {
    b: &'a [u8],
    p: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.p..self.p.checked_add(n)?)?;
        self.p += n;
        Some(s)
    }
    fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|s| s[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|s| u16::from_be_bytes([s[0], s[1]]))
    }
}

fn http_head(b: &[u8]) -> Option<Hello> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(b) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if b.len() < MAX_HELLO => return None,
        _ => return Some(Hello::Other),
    };
    if req.method == Some("CONNECT") {
        // A forward-proxy request: not what a transparent proxy serves.
        return Some(Hello::Other);
    }
    let mut host = None;
    let mut body = Body::None;
    for h in req.headers.iter() {
        let v = std::str::from_utf8(h.value).ok().map(str::trim);
        if h.name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return Some(Hello::Other); // two Host headers: ambiguous
            }
            host = v.map(|v| strip_port(v).to_ascii_lowercase());
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if !v.is_some_and(|v| v.eq_ignore_ascii_case("chunked")) || body != Body::None {
                return Some(Hello::Other);
            }
            body = Body::Chunked;
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let Some(n) = v.and_then(|v| v.parse::<u64>().ok()) else {
                return Some(Hello::Other);
            };
            if body != Body::None {
                return Some(Hello::Other); // both framings: smuggling
            }
            body = Body::Length(n);
        }
    }
    let target_host = req.path.and_then(|p| {
        let rest = p
            .strip_prefix("http://")
            .or_else(|| p.strip_prefix("https://"))?;
        let auth = rest.split('/').next().unwrap_or("");
        let auth = auth.rsplit('@').next().unwrap_or(auth);
        Some(strip_port(auth).to_ascii_lowercase())
    });
    Some(Hello::Http {
        host,
        target_host,
        len,
        body,
    })
}

fn strip_port(h: &str) -> &str {
    if h.starts_with('[') {
        return h; // IPv6 literal: refused as a literal anyway
    }
    h.rsplit_once(':')
        .filter(|(_, p)| p.bytes().all(|c| c.is_ascii_digit()))
        .map_or(h, |(n, _)| n)
}

/// A host name as the policy matches it: lower case, no trailing dot.
fn is_ip_literal(n: &str) -> bool {
    n.parse::<std::net::IpAddr>().is_ok() || n.starts_with('[')
}

fn serve(sh: &Shared, mut c: TcpStream) {
    let orig = match original_dst(&c) {
        Ok(a) => a,
        Err(e) => {
            log::warn!("session {}: egress proxy: SO_ORIGINAL_DST: {e}", sh.id);
            return;
        }
    };
    let port = orig.port();
    if !sh.cfg.ports.contains(&port) {
        // Reached the proxy's own address directly, not through the
        // redirect: nothing to inspect for.
        return;
    }
    let _ = c.set_read_timeout(Some(HELLO_TIMEOUT));
    let _ = c.set_write_timeout(Some(HELLO_TIMEOUT));
    let mut buf = Vec::with_capacity(2048);
    let deadline = Instant::now() + HELLO_TIMEOUT;
    let hello = loop {
        if let Some(h) = parse_hello(&buf) {
            break h;
        }
        if buf.len() >= MAX_HELLO || Instant::now() >= deadline {
            break Hello::Other;
        }
        let mut chunk = [0u8; 4096];
        match c.read(&mut chunk) {
            Ok(0) | Err(_) => return, // gone before saying anything
            Ok(n) => buf.extend_from_slice(&chunk[..n.min(MAX_HELLO - buf.len())]),
        }
    };
    let gate = lock(&sh.gate).clone();
    let inject = lock(&sh.inject).clone();
    let tls = matches!(hello, Hello::Tls(_));
    // Plain HTTP never carries a placeholder out: a value is only ever
    // put in over TLS, and a placeholder elsewhere is refused.
    if !tls && inject.as_ref().is_some_and(|i| i.carries_placeholder(&buf)) {
        return refuse(sh, Refusal::Placeholder, "", Some(false), c);
    }
    let (name, http) = match hello {
        Hello::Tls(Some(n)) => (n, None),
        Hello::Http {
            host: Some(h),
            target_host,
            len,
            body,
        } => {
            if target_host.as_ref().is_some_and(|t| *t != h) {
                return refuse(sh, Refusal::Mismatch, &h, Some(tls), c);
            }
            (h, Some((len, body)))
        }
        Hello::Http { len, body, .. } if !gate.proxied => (String::new(), Some((len, body))),
        _ if !gate.proxied => (String::new(), None),
        _ => return refuse(sh, Refusal::NoName, "", Some(tls), c),
    };
    let name = name.trim_end_matches('.').to_string();
    let intercept = tls
        && !name.is_empty()
        && !is_ip_literal(&name)
        && inject.as_ref().is_some_and(|i| i.binds(&name));
    let up = if gate.proxied || intercept {
        // The name decides, and the proxy's own answer for it.
        if is_ip_literal(&name) {
            return refuse(sh, Refusal::IpLiteral, &name, Some(tls), c);
        }
        if name.is_empty() || !gate.names.allows(&name) {
            return refuse(sh, Refusal::NotListed, &name, Some(tls), c);
        }
        let addrs = match resolve(&sh.cfg, &name) {
            Ok(a) => a,
            Err(e) => {
                log::info!("session {}: egress proxy: resolve {name}: {e}", sh.id);
                return refuse(sh, Refusal::Unresolved, &name, Some(tls), c);
            }
        };
        let addrs: Vec<Ipv4Addr> = addrs
            .into_iter()
            .filter(|a| gate.proxied || gate.filter.permits_tcp(*a, port))
            .collect();
        if addrs.is_empty() {
            return refuse(sh, Refusal::Unresolved, &name, Some(tls), c);
        }
        addrs.iter().take(4).find_map(|a| {
            TcpStream::connect_timeout(&SocketAddr::from((*a, port)), CONNECT_TIMEOUT).ok()
        })
    } else {
        // Injection only: the guest's own destination, if its mode
        // allows it (the policy chain never sees this connection).
        let a = *orig.ip();
        if !reachable(&sh.cfg, a) || !gate.filter.permits_tcp(a, port) {
            return refuse(sh, Refusal::NotListed, &a.to_string(), Some(tls), c);
        }
        TcpStream::connect_timeout(&SocketAddr::from(orig), CONNECT_TIMEOUT).ok()
    };
    let Some(mut up) = up else {
        return refuse(sh, Refusal::Upstream, &name, Some(tls), c);
    };
    sh.counters.allowed.fetch_add(1, Ordering::Relaxed);
    log::debug!("session {}: egress proxy: {name}:{port} allowed", sh.id);
    let _ = c.set_read_timeout(Some(IDLE));
    let _ = c.set_write_timeout(Some(IDLE));
    let _ = up.set_read_timeout(Some(IDLE));
    let _ = up.set_write_timeout(Some(IDLE));
    let t0 = Instant::now();
    let addr = up.peer_addr().ok();
    let done = |bytes: Option<[u64; 2]>, intercepted: bool| {
        sh.audit(serde_json::json!({
            "decision": "allowed", "name": name, "address": addr.map(|a| a.ip().to_string()),
            "port": port, "tls": tls, "intercepted": intercepted,
            "bytesUp": bytes.map(|b| b[0]), "bytesDown": bytes.map(|b| b[1]),
            "durationMs": t0.elapsed().as_millis() as u64,
        }))
    };
    if let (true, Some(inj)) = (intercept, inject) {
        sh.counters.intercepted.fetch_add(1, Ordering::Relaxed);
        intercept_tls(sh, c, buf, &name, up, &inj);
        return done(None, true);
    }
    match http {
        None => {
            if up.write_all(&buf).is_ok() {
                let [a, b] = splice_counted(c, up);
                done(Some([a + buf.len() as u64, b]), false);
            } else {
                done(Some([0, 0]), false);
            }
        }
        Some((len, body)) => {
            let head = close_head(&buf[..len]);
            if up.write_all(&head).is_err() {
                return done(Some([0, 0]), false);
            }
            let Ok(up2) = up.try_clone() else { return };
            let Ok(c2) = c.try_clone() else { return };
            // Answers flow back while the one request's body goes up.
            let back = std::thread::Builder::new()
                .name(format!("proxy-{}-r", sh.id))
                .spawn(move || copy_until_eof(up2, c2));
            let mut rest = buf[len..].to_vec();
            let mut counted = Counting { w: &mut up, n: 0 };
            let _ = forward_body(&mut c, &mut counted, body, &mut rest);
            let sent = head.len() as u64 + counted.n;
            let got = back.ok().and_then(|h| h.join().ok()).unwrap_or(0);
            done(Some([sent, got]), false);
        }
    }
}

/// A writer that counts what passed.
struct Counting<'a, W: Write> {
    w: &'a mut W,
    n: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let k = self.w.write(b)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

/// Whether `a` is outside the always-blocked set (or an exception in it).
fn reachable(cfg: &ProxyConfig, a: Ipv4Addr) -> bool {
    !cfg.blocked.iter().any(|b| b.contains(a)) || cfg.exceptions.iter().any(|b| b.contains(a))
}

/// Bytes already read (the ClientHello), then the socket.
struct Replay {
    head: Vec<u8>,
    at: usize,
    sock: TcpStream,
}

impl Read for Replay {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        if self.at < self.head.len() {
            let n = (self.head.len() - self.at).min(b.len());
            b[..n].copy_from_slice(&self.head[self.at..self.at + n]);
            self.at += n;
            return Ok(n);
        }
        self.sock.read(b)
    }
}

impl Write for Replay {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.sock.write(b)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// A request head (through its blank line) from `r`, at most
/// [`MAX_HELLO`] bytes; the bytes after it stay in the returned buffer.
fn read_head(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(Some(buf));
        }
        if buf.len() >= MAX_HELLO {
            return Ok(None);
        }
        let n = r.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// TLS to a secret's host: terminated with the session's CA, one request
/// read and given its secrets, sent on over TLS verified against the
/// upstream bundle, its answer copied back.
fn intercept_tls(
    sh: &Shared,
    c: TcpStream,
    hello: Vec<u8>,
    name: &str,
    up: TcpStream,
    inj: &Injection,
) {
    let server = match inj.ca().server_config(name) {
        Ok(s) => s,
        Err(e) => {
            log::warn!("session {}: egress proxy: {e}", sh.id);
            return;
        }
    };
    let conn = match rustls::ServerConnection::new(server) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("session {}: egress proxy: TLS for {name}: {e}", sh.id);
            return;
        }
    };
    let mut guest = rustls::StreamOwned::new(
        conn,
        Replay {
            head: hello,
            at: 0,
            sock: c,
        },
    );
    let first = match read_head(&mut guest) {
        Ok(Some(h)) => h,
        Ok(None) => return,
        Err(e) => {
            // Most often the guest does not trust the session's CA (a
            // client with its own bundle): say so in the log.
            log::info!(
                "session {}: egress proxy: TLS from the guest to {name}: {e}",
                sh.id
            );
            return;
        }
    };
    let answer = |guest: &mut rustls::StreamOwned<rustls::ServerConnection, Replay>,
                  status: &str,
                  why: &str| {
        let body = format!("agent-sandbox: {name}: {why}\n");
        let _ = write!(
            guest,
            "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        guest.conn.send_close_notify();
        let _ = guest.flush();
    };
    let (len, body) = match http_head(&first) {
        Some(Hello::Http {
            host: Some(h),
            target_host,
            len,
            body,
        }) if h.trim_end_matches('.') == name && target_host.as_ref().is_none_or(|t| t == &h) => {
            (len, body)
        }
        Some(Hello::Http { .. }) => {
            sh.counters.refused(Refusal::Mismatch);
            return answer(
                &mut guest,
                "403 Forbidden",
                "the request names another host than the TLS connection",
            );
        }
        _ => {
            sh.counters.refused(Refusal::NoName);
            return answer(&mut guest, "400 Bad Request", "not an HTTP/1.1 request");
        }
    };
    let (rewritten, put) = match inj.rewrite(name, &first[..len]) {
        Rewrite::Send(h, n) => (h, n),
        Rewrite::Refuse(secret) => {
            sh.counters.refused(Refusal::Placeholder);
            log::info!(
                "session {}: egress proxy refused a request to {name}: it carries the \
                 placeholder of secret {secret}, which is not bound to that host",
                sh.id
            );
            return answer(
                &mut guest,
                "403 Forbidden",
                "a secret's placeholder towards a host it is not bound to",
            );
        }
    };
    let Some(client) = sh.cfg.upstream_tls.clone() else {
        return answer(
            &mut guest,
            "502 Bad Gateway",
            "no CA bundle to verify the host with (proxy_upstream_ca)",
        );
    };
    let server_name = match rustls::pki_types::ServerName::try_from(name.to_string()) {
        Ok(n) => n,
        Err(_) => return answer(&mut guest, "502 Bad Gateway", "not a TLS server name"),
    };
    let Ok(cconn) = rustls::ClientConnection::new(client, server_name) else {
        return answer(&mut guest, "502 Bad Gateway", "TLS client setup failed");
    };
    let mut upstream = rustls::StreamOwned::new(cconn, up);
    let head = close_head(&rewritten);
    if let Err(e) = upstream.write_all(&head).and_then(|_| upstream.flush()) {
        sh.counters.refused(Refusal::Upstream);
        log::info!("session {}: egress proxy: TLS to {name}: {e}", sh.id);
        return answer(
            &mut guest,
            "502 Bad Gateway",
            &format!("TLS to the host failed: {e}"),
        );
    }
    if put > 0 {
        sh.counters.injected.fetch_add(1, Ordering::Relaxed);
    }
    let mut rest = first[len..].to_vec();
    if forward_body(&mut guest, &mut upstream, body, &mut rest).is_err() {
        return;
    }
    let _ = upstream.flush();
    // The answer, until the host closes (the request said `close`).
    let mut b = vec![0u8; 32 << 10];
    loop {
        match upstream.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if guest.write_all(&b[..n]).is_err() {
                    return;
                }
            }
        }
    }
    guest.conn.send_close_notify();
    let _ = guest.flush();
    let _ = guest.sock.sock.shutdown(Shutdown::Both);
}

/// The request head with `Connection: close` (replacing any Connection
/// and Keep-Alive header): one request per connection.
fn close_head(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::with_capacity(head.len() + 20);
    for (i, line) in text.split("\r\n").enumerate() {
        if line.is_empty() {
            continue;
        }
        let lower = line.to_ascii_lowercase();
        if i > 0 && (lower.starts_with("connection:") || lower.starts_with("keep-alive:")) {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

/// Copy the request body (framed by `body`; `rest` holds bytes already
/// read after the head), then nothing more.
fn forward_body(
    c: &mut impl Read,
    up: &mut impl Write,
    body: Body,
    rest: &mut Vec<u8>,
) -> io::Result<()> {
    let mut fill = |rest: &mut Vec<u8>| -> io::Result<bool> {
        let mut b = [0u8; 16 << 10];
        let n = c.read(&mut b)?;
        rest.extend_from_slice(&b[..n]);
        Ok(n > 0)
    };
    match body {
        Body::None => Ok(()),
        Body::Length(mut left) => loop {
            let n = (rest.len() as u64).min(left) as usize;
            up.write_all(&rest[..n])?;
            rest.drain(..n);
            left -= n as u64;
            if left == 0 || !fill(rest)? {
                return Ok(());
            }
        },
        Body::Chunked => loop {
            // A chunk: "<hex>[;ext]\r\n", data, "\r\n"; "0\r\n" ends it,
            // then trailers up to an empty line.
            let line_end = loop {
                if let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                if rest.len() > 4096 || !fill(rest)? {
                    return Ok(());
                }
            };
            let line = String::from_utf8_lossy(&rest[..line_end]).to_string();
            let size_txt = line.split(';').next().unwrap_or("").trim();
            let Ok(size) = u64::from_str_radix(size_txt, 16) else {
                return Ok(()); // broken framing: stop forwarding
            };
            up.write_all(&rest[..line_end + 2])?;
            rest.drain(..line_end + 2);
            if size == 0 {
                // Trailers, each a line, until the empty one.
                loop {
                    let end = loop {
                        if let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
                            break i;
                        }
                        if rest.len() > 4096 || !fill(rest)? {
                            return Ok(());
                        }
                    };
                    up.write_all(&rest[..end + 2])?;
                    rest.drain(..end + 2);
                    if end == 0 {
                        return Ok(());
                    }
                }
            }
            let mut left = size + 2; // data and its CRLF
            loop {
                let n = (rest.len() as u64).min(left) as usize;
                up.write_all(&rest[..n])?;
                rest.drain(..n);
                left -= n as u64;
                if left == 0 {
                    break;
                }
                if !fill(rest)? {
                    return Ok(());
                }
            }
        },
    }
}

fn copy_until_eof(mut from: TcpStream, mut to: TcpStream) -> u64 {
    let mut b = vec![0u8; 32 << 10];
    let mut total = 0u64;
    loop {
        match from.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&b[..n]).is_err() {
                    break;
                }
                total += n as u64;
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Both);
    total
}

/// Both directions until both ends closed (a half-close passed on), or
/// [`IDLE`] without a byte either way.
pub fn splice(a: TcpStream, b: TcpStream) {
    splice_counted(a, b);
}

/// [`splice`], answering the bytes moved: `[a -> b, b -> a]`.
pub fn splice_counted(mut a: TcpStream, mut b: TcpStream) -> [u64; 2] {
    let mut moved = [0u64; 2];
    let mut buf = vec![0u8; 32 << 10];
    // open[0]: a -> b still reading; open[1]: b -> a.
    let mut open = [true, true];
    let mut last = Instant::now();
    while open[0] || open[1] {
        let ev = |o: bool| if o { libc::POLLIN } else { 0 };
        let mut fds = [
            libc::pollfd {
                fd: a.as_raw_fd(),
                events: ev(open[0]),
                revents: 0,
            },
            libc::pollfd {
                fd: b.as_raw_fd(),
                events: ev(open[1]),
                revents: 0,
            },
        ];
        // SAFETY: valid pollfd array of 2.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return moved;
        }
        if n == 0 {
            if last.elapsed() >= IDLE {
                return moved;
            }
            continue;
        }
        for i in 0..2 {
            if !open[i] || fds[i].revents == 0 {
                continue;
            }
            let (from, to) = if i == 0 {
                (&mut a, &mut b)
            } else {
                (&mut b, &mut a)
            };
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    open[i] = false;
                    let _ = to.shutdown(Shutdown::Write);
                }
                Ok(k) => {
                    if to.write_all(&buf[..k]).is_err() {
                        return moved;
                    }
                    moved[i] += k as u64;
                    last = Instant::now();
                }
            }
        }
    }
    moved
}

/// Refuse a connection: a 403 for HTTP, a TLS alert for TLS; counted,
/// and logged up to [`LOGGED_REFUSALS`] times per session.
fn refuse(sh: &Shared, r: Refusal, name: &str, tls: Option<bool>, mut c: TcpStream) {
    sh.counters.refused(r);
    let port = original_dst(&c).ok().map(|a| a.port());
    sh.audit(serde_json::json!({
        "decision": "refused", "name": name, "port": port, "tls": tls,
        "reason": format!("{r:?}"), "why": r.what(),
    }));
    let total = sh.counters.total_refused();
    if total <= LOGGED_REFUSALS {
        log::info!(
            "session {}: egress proxy refused {:?}: {}{}",
            sh.id,
            name,
            r.what(),
            if total == LOGGED_REFUSALS {
                " (further refusals are only counted)"
            } else {
                ""
            }
        );
    }
    let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
    match tls {
        // access_denied (49), fatal; unrecognized_name (112) for no SNI.
        Some(true) => {
            let desc = if r == Refusal::NoName { 112 } else { 49 };
            let _ = c.write_all(&[0x15, 3, 3, 0, 2, 2, desc]);
        }
        Some(false) => {
            let body = format!(
                "agent-sandbox: {}{}: refused by this session's egress policy ({})\n",
                name,
                if name.is_empty() { "this request" } else { "" },
                r.what()
            );
            let _ = write!(
                c,
                "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
        None => {}
    }
    let _ = c.shutdown(Shutdown::Both);
}

/// Where the guest connected to, before the redirect.
fn original_dst(c: &TcpStream) -> io::Result<SocketAddrV4> {
    // SAFETY: zeroed sockaddr_in is a valid value; getsockopt writes at
    // most `len` bytes into it.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: valid fd, out pointer and length.
    let r = unsafe {
        libc::getsockopt(
            c.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&mut sa as *mut libc::sockaddr_in).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ))
}

/// The name's A records, through the session's forwarder, without
/// addresses the session may never reach.
fn resolve(cfg: &ProxyConfig, name: &str) -> io::Result<Vec<Ipv4Addr>> {
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let id = super::dnsfwd::random_u16();
    let raw = a_query(name, id).ok_or_else(|| bad("not a valid DNS name"))?;
    let Action::Forward(q) = dns::classify_by(&raw, |_| true) else {
        return Err(bad("not a valid DNS name"));
    };
    let upstream = dns::upstream_query(&q, id);
    let resp = super::dnsfwd::udp_exchange(cfg.resolver, &upstream, id, cfg.resolve_timeout)?;
    let ans = dns::parse_response(&resp, id, &q, u32::MAX).map_err(|e| bad(&e.to_string()))?;
    Ok(ans
        .addrs
        .into_iter()
        .map(|(a, _)| a)
        .filter(|a| reachable(cfg, *a))
        .collect())
}

/// A one-question A query for `name`.
fn a_query(name: &str, id: u16) -> Option<Vec<u8>> {
    let mut m = Vec::with_capacity(32 + name.len());
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for l in name.split('.') {
        if l.is_empty() || l.len() > 63 {
            return None;
        }
        m.push(l.len() as u8);
        m.extend_from_slice(l.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&[0, 1, 0, 1]);
    (m.len() <= 512).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_hello(sni: Option<&str>) -> Vec<u8> {
        let mut ext = Vec::new();
        // An unrelated extension first (supported_groups).
        ext.extend_from_slice(&[0, 10, 0, 4, 0, 2, 0, 29]);
        if let Some(n) = sni {
            let n = n.as_bytes();
            let mut e = Vec::new();
            e.extend_from_slice(&((n.len() + 3) as u16).to_be_bytes());
            e.push(0);
            e.extend_from_slice(&(n.len() as u16).to_be_bytes());
            e.extend_from_slice(n);
            ext.extend_from_slice(&[0, 0]);
            ext.extend_from_slice(&(e.len() as u16).to_be_bytes());
            ext.extend_from_slice(&e);
        }
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        hs
    }

    fn records(hs: &[u8], size: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in hs.chunks(size) {
            out.extend_from_slice(&[0x16, 3, 1]);
            out.extend_from_slice(&(c.len() as u16).to_be_bytes());
            out.extend_from_slice(c);
        }
        out
    }

    #[test]
    fn sni_from_one_or_many_records_and_partial_input() {
        let hs = client_hello(Some("PyPI.test"));
        let one = records(&hs, 16384);
        assert_eq!(
            parse_hello(&one),
            Some(Hello::Tls(Some("pypi.test".into())))
        );
        let many = records(&hs, 7);
        assert_eq!(
            parse_hello(&many),
            Some(Hello::Tls(Some("pypi.test".into())))
        );
        for cut in [1, 4, 5, one.len() - 1] {
            assert_eq!(parse_hello(&one[..cut]), None, "cut at {cut}");
        }
        assert_eq!(
            parse_hello(&records(&client_hello(None), 100)),
            Some(Hello::Tls(None))
        );
        // Garbage after a TLS-looking first byte: no name, never a panic.
        assert_eq!(parse_hello(&[0x16, 9, 9, 0, 1, 0]), Some(Hello::Tls(None)));
        let mut bad = one.clone();
        bad[5] = 2; // a ServerHello
        assert_eq!(parse_hello(&bad), Some(Hello::Tls(None)));
    }

    #[test]
    fn random_and_truncated_hellos_never_panic() {
        let hs = records(&client_hello(Some("a.test")), 50);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for i in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let mut m = hs.clone();
            let at = (seed as usize) % m.len();
            m[at] = (seed >> 32) as u8;
            m.truncate(((seed >> 40) as usize) % (m.len() + 1));
            let _ = parse_hello(&m);
            if i % 2 == 0 {
                let r: Vec<u8> = (0..(seed % 300))
                    .map(|k| (seed >> (k % 56)) as u8)
                    .collect();
                let _ = parse_hello(&r);
            }
        }
    }

    #[test]
    fn http_heads() {
        let head = b"GET /simple/ HTTP/1.1\r\nHost: PyPI.test:8080\r\nAccept: */*\r\n\r\n";
        let h = parse_hello(head);
        assert_eq!(
            h,
            Some(Hello::Http {
                host: Some("pypi.test".into()),
                target_host: None,
                len: head.len(),
                body: Body::None
            })
        );
        assert_eq!(parse_hello(b"GET / HTTP/1.1\r\nHost: a.test\r\n"), None);
        let h = parse_hello(b"GET http://evil.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n");
        assert!(matches!(h, Some(Hello::Http { target_host: Some(t), .. }) if t == "evil.test"));
        let h = parse_hello(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello");
        assert!(matches!(
            h,
            Some(Hello::Http {
                body: Body::Length(5),
                ..
            })
        ));
        let h = parse_hello(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(matches!(
            h,
            Some(Hello::Http {
                body: Body::Chunked,
                ..
            })
        ));
        for smuggle in [
            &b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
            b"SSH-2.0-OpenSSH_9.2\r\n",
        ] {
            assert_eq!(parse_hello(smuggle), Some(Hello::Other), "{:?}", String::from_utf8_lossy(smuggle));
        }
        let h = parse_hello(b"GET / HTTP/1.1\r\n\r\n");
        assert!(matches!(h, Some(Hello::Http { host: None, .. })));
    }

    #[test]
    fn one_request_per_connection() {
        let h = close_head(
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\nKeep-Alive: 5\r\n\r\n",
        );
        assert_eq!(
            String::from_utf8(h).unwrap(),
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn literals_and_ports() {
        assert!(is_ip_literal("198.51.100.1"));
        assert!(is_ip_literal("[::1]"));
        assert!(!is_ip_literal("pypi.test"));
        assert_eq!(strip_port("a.test:443"), "a.test");
        assert_eq!(strip_port("a.test"), "a.test");
        assert!(a_query("a..b", 1).is_none());
        let q = a_query("pypi.test", 7).unwrap();
        assert!(matches!(dns::classify_by(&q, |_| true), Action::Forward(_)));
    }
}
