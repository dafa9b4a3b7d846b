//! Test topology for the networking tests. Built with the `ip` command on
//! purpose: the code under test does not build its own test bench.
//!
//! ```text
//!  [internet ns]  wan0 192.0.2.1/24, lo: 198.51.100.1 169.254.169.254
//!       |                                 10.99.0.1 100.64.0.1
//!  [host ns]      up0 192.0.2.2/24, default via 192.0.2.1
//!       |  (the code under test makes sessions here)
//!  [session ns]   tap0 <-relay-> gwire ~~ gst0 [guest ns] 172.16.0.2/30
//! ```
//! Every address any test talks to lives in namespaces made here; the host
//! and internet namespaces have no other link, so no packet leaves.

#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub const PORT: u16 = 7007;
pub const INTERNET: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
pub const CGNAT: Ipv4Addr = Ipv4Addr::new(100, 64, 0, 1);
pub const HOST_UPLINK: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const GUEST: &str = "172.16.0.2/30";
pub const GUEST_GW: &str = "172.16.0.1";

pub fn is_root() -> bool {
    // SAFETY: trivial libc call.
    unsafe { libc::geteuid() == 0 }
}

/// Why the network tests skip when not root (`skip!("{NEEDS_ROOT}")`).
pub const NEEDS_ROOT: &str = "needs root (network namespaces, netlink, nftables)";

/// Run a command, panic with its output on failure.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Like `sh` but ignores failure (cleanup).
pub fn sh_quiet(args: &[&str]) {
    let _ = Command::new(args[0]).args(&args[1..]).output();
}

/// Run `f` on a thread inside namespace file `ns`.
pub fn in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        PathBuf::from(format!("/run/netns/{ns}"))
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            let f0 = File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
            assert_eq!(
                // SAFETY: setns on a valid fd, this thread only.
                unsafe { libc::setns(f0.as_raw_fd(), libc::CLONE_NEWNET) },
                0,
                "setns {ns}"
            );
            f()
        })
        .join()
        .unwrap()
    })
}

/// Echo servers (TCP and UDP on PORT): they answer with the peer's address,
/// so a test sees which source address arrived (NAT check).
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Servers {
    /// Serve on each of `addrs` (UDP answers must come from the address
    /// asked, so one socket per address), or on 0.0.0.0 when empty.
    pub fn start(ns: &str, addrs: &[Ipv4Addr]) -> Servers {
        let stop = Arc::new(AtomicBool::new(false));
        let addrs: Vec<Ipv4Addr> = if addrs.is_empty() {
            vec![Ipv4Addr::UNSPECIFIED]
        } else {
            addrs.to_vec()
        };
        let socks = in_ns(ns, || {
            addrs
                .iter()
                .map(|a| {
                    let t = TcpListener::bind((*a, PORT)).expect("bind tcp");
                    let u = UdpSocket::bind((*a, PORT)).expect("bind udp");
                    (t, u)
                })
                .collect::<Vec<_>>()
        });
        let mut threads = Vec::new();
        for (tcp, udp) in socks {
            tcp.set_nonblocking(true).unwrap();
            u_timeout(&udp);
            let s1 = stop.clone();
            threads.push(std::thread::spawn(move || {
                while !s1.load(Ordering::Relaxed) {
                    match tcp.accept() {
                        Ok((mut c, peer)) => {
                            let _ = c.write_all(format!("{}\n", peer.ip()).as_bytes());
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }));
            let s2 = stop.clone();
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 512];
                while !s2.load(Ordering::Relaxed) {
                    if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                        let _ = udp.send_to(format!("{}\n", peer.ip()).as_bytes(), peer);
                    }
                }
            }));
        }
        Servers { stop, threads }
    }
}

fn u_timeout(u: &UdpSocket) {
    u.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// TCP connect from namespace `ns`; Some(peer address the server saw).
pub fn tcp_probe(ns: &str, dst: Ipv4Addr) -> Option<String> {
    in_ns(ns, || {
        let mut c =
            TcpStream::connect_timeout(&SocketAddr::from((dst, PORT)), Duration::from_millis(400))
                .ok()?;
        c.set_read_timeout(Some(Duration::from_millis(400))).ok()?;
        let mut s = String::new();
        c.read_to_string(&mut s).ok()?;
        Some(s.trim().to_string())
    })
}

/// UDP round trip from namespace `ns`.
pub fn udp_probe(ns: &str, dst: Ipv4Addr) -> Option<String> {
    in_ns(ns, || {
        let u = UdpSocket::bind(("0.0.0.0", 0)).ok()?;
        u.set_read_timeout(Some(Duration::from_millis(400))).ok()?;
        u.send_to(b"ping", (dst, PORT)).ok()?;
        let mut buf = [0u8; 128];
        let (n, _) = u.recv_from(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    })
}

/// The test host + internet namespaces. Dropping removes them (and with
/// them every link, address and table inside).
pub struct Topology {
    pub host: String,
    pub internet: String,
    extra_ns: Vec<String>,
}

impl Topology {
    pub fn new(tag: &str) -> Topology {
        let pid = std::process::id();
        let t = Topology {
            host: format!("tnet-{tag}-{pid}-h"),
            internet: format!("tnet-{tag}-{pid}-i"),
            extra_ns: Vec::new(),
        };
        let (h, i) = (t.host.as_str(), t.internet.as_str());
        sh_quiet(&["ip", "netns", "del", h]);
        sh_quiet(&["ip", "netns", "del", i]);
        sh(&["ip", "netns", "add", h]);
        sh(&["ip", "netns", "add", i]);
        for ns in [h, i] {
            // Quiet namespaces: no IPv6 chatter between them either.
            sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
            ]);
            sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-qw",
                "net.ipv6.conf.default.disable_ipv6=1",
            ]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        sh(&[
            "ip", "link", "add", "up0", "netns", h, "type", "veth", "peer", "name", "wan0",
            "netns", i,
        ]);
        sh(&["ip", "-n", h, "addr", "add", "192.0.2.2/24", "dev", "up0"]);
        sh(&["ip", "-n", h, "link", "set", "up0", "up"]);
        sh(&["ip", "-n", h, "route", "add", "default", "via", "192.0.2.1"]);
        sh(&["ip", "-n", i, "addr", "add", "192.0.2.1/24", "dev", "wan0"]);
        sh(&["ip", "-n", i, "link", "set", "wan0", "up"]);
        for a in [INTERNET, METADATA, PRIVATE, CGNAT] {
            sh(&[
                "ip",
                "-n",
                i,
                "addr",
                "add",
                &format!("{a}/32"),
                "dev",
                "lo",
            ]);
        }
        t
    }

    pub fn host_path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.host))
    }

    /// Track an extra namespace for removal on drop.
    pub fn own_ns(&mut self, name: String) {
        self.extra_ns.push(name);
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for n in self.extra_ns.iter().chain([&self.host, &self.internet]) {
            sh_quiet(&["ip", "netns", "del", n]);
        }
    }
}

/// Removes session namespaces of a prefix on drop (in case a test fails
/// before its own teardown).
pub struct SweepGuard(pub agent_sandbox::net::NetConfig);

impl Drop for SweepGuard {
    fn drop(&mut self) {
        let _ = agent_sandbox::net::Net::sweep(&self.0);
    }
}

/// A stand-in guest: a namespace `gns` with `gst0` = 172.16.0.2/30 whose
/// frames a relay thread carries to and from the session's TAP, the way a
/// VMM's virtio-net device would. The TAP is attached like a VMM attaches.
pub struct Guest {
    pub ns: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Guest {
    pub fn attach(topo: &mut Topology, session_ns: &str, tap: &str, n: usize) -> Guest {
        let gns = format!("{}-g{n}", topo.host);
        topo.own_ns(gns.clone());
        sh(&["ip", "netns", "add", &gns]);
        sh(&[
            "ip",
            "netns",
            "exec",
            &gns,
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.disable_ipv6=1",
        ]);
        sh(&[
            "ip",
            "netns",
            "exec",
            &gns,
            "sysctl",
            "-qw",
            "net.ipv6.conf.default.disable_ipv6=1",
        ]);
        sh(&[
            "ip", "link", "add", "gst0", "netns", &gns, "type", "veth", "peer", "name", "gwire",
            "netns", session_ns,
        ]);
        sh(&["ip", "-n", &gns, "addr", "add", GUEST, "dev", "gst0"]);
        sh(&["ip", "-n", &gns, "link", "set", "gst0", "up"]);
        sh(&["ip", "-n", &gns, "link", "set", "lo", "up"]);
        sh(&["ip", "-n", &gns, "route", "add", "default", "via", GUEST_GW]);
        // The wire end carries frames only: no ARP, no address.
        sh(&[
            "ip", "-n", session_ns, "link", "set", "gwire", "arp", "off", "up",
        ]);
        let tapname = tap.to_string();
        let (tapf, pkt) = in_ns(session_ns, move || {
            let tapf = agent_sandbox::net::tap::open(&tapname, true).expect("attach to TAP");
            // SAFETY: plain socket calls with checked results.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    (libc::ETH_P_ALL as u16).to_be() as i32,
                )
            };
            assert!(fd >= 0, "packet socket");
            // SAFETY: fd is a fresh socket we own.
            let pkt = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: a NUL-terminated literal name.
            let idx = unsafe { libc::if_nametoindex(c"gwire".as_ptr()) };
            assert!(idx > 0, "gwire index");
            // SAFETY: sockaddr_ll is plain data; all-zero is valid.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
            sll.sll_ifindex = idx as i32;
            // SAFETY: sll is a live sockaddr_ll and its size is passed.
            let rc = unsafe {
                libc::bind(
                    fd,
                    &sll as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(rc, 0, "bind packet socket");
            // Carry the virtio-net header both ways, as a VMM does: the
            // guest veth hands over packets with checksums still to be
            // filled in (offload), which only the header describes.
            let one: libc::c_int = 1;
            // SAFETY: `one` is a live c_int and its size is passed.
            let rc = unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_PACKET,
                    libc::PACKET_VNET_HDR,
                    &one as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                )
            };
            assert_eq!(rc, 0, "PACKET_VNET_HDR");
            (tapf, pkt)
        });
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || relay(tapf, pkt, s));
        Guest {
            ns: gns,
            stop,
            thread: Some(thread),
        }
    }
}

fn relay(tap: File, pkt: OwnedFd, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 65536];
    let (t, p) = (tap.as_raw_fd(), pkt.as_raw_fd());
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [
            libc::pollfd {
                fd: t,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: p,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: valid pollfd array.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, 50) } <= 0 {
            continue;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            // SAFETY: reading into our buffer.
            let n = unsafe { libc::read(t, buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                // SAFETY: the first n bytes of buf were just read.
                unsafe { libc::send(p, buf.as_ptr().cast(), n as usize, 0) };
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            // SAFETY: sockaddr_ll is plain data; all-zero is valid.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: reading into our buffer with a proper address struct.
            let n = unsafe {
                libc::recvfrom(
                    p,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    &mut from as *mut _ as *mut libc::sockaddr,
                    &mut len,
                )
            };
            // Our own sends show up as outgoing: do not loop them back.
            if n > 0 && from.sll_pkttype != libc::PACKET_OUTGOING {
                // SAFETY: the first n bytes of buf were just received.
                unsafe { libc::write(t, buf.as_ptr().cast(), n as usize) };
            }
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        sh_quiet(&["ip", "netns", "del", &self.ns]);
    }
}

/// Add an address to the internet namespace's loopback (a further
/// "public" server); removed with the namespace.
pub fn add_internet_addr(topo: &Topology, a: Ipv4Addr) {
    sh(&[
        "ip",
        "-n",
        &topo.internet,
        "addr",
        "add",
        &format!("{a}/32"),
        "dev",
        "lo",
    ]);
}

/// What the test DNS server answers for a name.
#[derive(Clone, Debug)]
pub enum Rr {
    A(Ipv4Addr, u32),
    Cname(&'static str, u32),
    /// Many A records (a big answer).
    Many(Vec<Ipv4Addr>, u32),
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    for l in name.split('.').filter(|l| !l.is_empty()) {
        out.push(l.len() as u8);
        out.extend_from_slice(l.as_bytes());
    }
    out.push(0);
}

/// Decode an uncompressed name at `off` (the test server only needs that).
fn get_name(m: &[u8], mut off: usize) -> Option<(String, usize)> {
    let mut labels = Vec::new();
    loop {
        let l = *m.get(off)? as usize;
        if l == 0 {
            return Some((labels.join("."), off + 1));
        }
        if l & 0xc0 != 0 {
            return None;
        }
        labels.push(String::from_utf8_lossy(m.get(off + 1..off + 1 + l)?).to_ascii_lowercase());
        off += 1 + l;
    }
}

/// A tiny authoritative DNS server for tests (UDP and TCP port 53), written
/// independently of the code under test. It follows CNAMEs it knows and
/// counts the names it was asked, so a test can prove a query never got
/// upstream.
pub struct DnsServer {
    pub asked: Arc<std::sync::Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

fn dns_answer(
    q: &[u8],
    zone: &std::collections::HashMap<String, Rr>,
    asked: &std::sync::Mutex<Vec<String>>,
) -> Option<Vec<u8>> {
    let (name, end) = get_name(q, 12)?;
    let qtype = u16::from_be_bytes([*q.get(end)?, *q.get(end + 1)?]);
    asked.lock().unwrap().push(name.clone());
    let mut r = q[..end + 4].to_vec();
    r[2] = 0x84 | (q[2] & 1); // QR, AA, RD echoed
    r[3] = 0x80;
    r[10] = 0;
    r[11] = 0;
    let mut n = name.clone();
    let mut count = 0u16;
    for _ in 0..8 {
        match zone.get(&n) {
            Some(Rr::Cname(t, ttl)) => {
                put_name(&mut r, &n);
                r.extend_from_slice(&[0, 5, 0, 1]);
                r.extend_from_slice(&ttl.to_be_bytes());
                let mut d = Vec::new();
                put_name(&mut d, t);
                r.extend_from_slice(&(d.len() as u16).to_be_bytes());
                r.extend_from_slice(&d);
                count += 1;
                n = t.to_string();
            }
            Some(Rr::A(a, ttl)) => {
                if qtype == 1 {
                    put_name(&mut r, &n);
                    r.extend_from_slice(&[0, 1, 0, 1]);
                    r.extend_from_slice(&ttl.to_be_bytes());
                    r.extend_from_slice(&[0, 4]);
                    r.extend_from_slice(&a.octets());
                    count += 1;
                }
                break;
            }
            Some(Rr::Many(addrs, ttl)) => {
                for a in addrs.iter().filter(|_| qtype == 1) {
                    put_name(&mut r, &n);
                    r.extend_from_slice(&[0, 1, 0, 1]);
                    r.extend_from_slice(&ttl.to_be_bytes());
                    r.extend_from_slice(&[0, 4]);
                    r.extend_from_slice(&a.octets());
                    count += 1;
                }
                break;
            }
            None => {
                if count == 0 {
                    r[3] |= 3; // NXDOMAIN
                }
                break;
            }
        }
    }
    r[6..8].copy_from_slice(&count.to_be_bytes());
    Some(r)
}

impl DnsServer {
    pub fn start(ns: &str, addr: Ipv4Addr, zone: &[(&str, Rr)]) -> DnsServer {
        let zone: Arc<std::collections::HashMap<String, Rr>> = Arc::new(
            zone.iter()
                .map(|(n, r)| (n.to_string(), r.clone()))
                .collect(),
        );
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (udp, tcp) = in_ns(ns, || {
            (
                UdpSocket::bind((addr, 53)).expect("bind dns udp"),
                TcpListener::bind((addr, 53)).expect("bind dns tcp"),
            )
        });
        u_timeout(&udp);
        tcp.set_nonblocking(true).unwrap();
        let (z1, a1, s1) = (zone.clone(), asked.clone(), stop.clone());
        let t1 = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !s1.load(Ordering::Relaxed) {
                if let Ok((n, peer)) = udp.recv_from(&mut buf) {
                    if let Some(r) = dns_answer(&buf[..n], &z1, &a1) {
                        let _ = udp.send_to(&r, peer);
                    }
                }
            }
        });
        let (z2, a2, s2) = (zone, asked.clone(), stop.clone());
        let t2 = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                let Ok((mut c, _)) = tcp.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = c.set_nonblocking(false);
                let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
                let mut l = [0u8; 2];
                if c.read_exact(&mut l).is_err() {
                    continue;
                }
                let mut q = vec![0u8; u16::from_be_bytes(l) as usize];
                if c.read_exact(&mut q).is_err() {
                    continue;
                }
                if let Some(r) = dns_answer(&q, &z2, &a2) {
                    let mut out = (r.len() as u16).to_be_bytes().to_vec();
                    out.extend_from_slice(&r);
                    let _ = c.write_all(&out);
                }
            }
        });
        DnsServer {
            asked,
            stop,
            threads: vec![t1, t2],
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A DNS query for `name` (type `qtype`) built by hand.
pub fn dns_query_msg(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = id.to_be_bytes().to_vec();
    m.extend_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
    put_name(&mut m, name);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&[0, 1]);
    m
}

/// Parsed reply: rcode and the A records in the answer section.
#[derive(Debug, PartialEq, Eq)]
pub struct DnsReply {
    pub rcode: u8,
    pub answers: u16,
    pub addrs: Vec<Ipv4Addr>,
    pub truncated: bool,
}

/// Parse a reply: skips the question, walks answers (compressed owner
/// names allowed), collects A records.
pub fn parse_reply(r: &[u8]) -> Option<DnsReply> {
    if r.len() < 12 {
        return None;
    }
    let an = u16::from_be_bytes([r[6], r[7]]);
    let (_, mut off) = get_name(r, 12)?;
    off += 4;
    let mut addrs = Vec::new();
    for _ in 0..an {
        // owner: a pointer or a plain name
        if *r.get(off)? & 0xc0 == 0xc0 {
            off += 2;
        } else {
            off = get_name(r, off)?.1;
        }
        let t = u16::from_be_bytes([*r.get(off)?, *r.get(off + 1)?]);
        let len = u16::from_be_bytes([*r.get(off + 8)?, *r.get(off + 9)?]) as usize;
        let d = r.get(off + 10..off + 10 + len)?;
        if t == 1 && len == 4 {
            addrs.push(Ipv4Addr::new(d[0], d[1], d[2], d[3]));
        }
        off += 10 + len;
    }
    Some(DnsReply {
        rcode: r[3] & 0x0f,
        answers: an,
        addrs,
        truncated: r[2] & 0x02 != 0,
    })
}

/// Send raw bytes by UDP from `ns` and wait for one datagram back.
pub fn udp_raw(ns: &str, dst: Ipv4Addr, port: u16, msg: &[u8], wait: Duration) -> Option<Vec<u8>> {
    let msg = msg.to_vec();
    in_ns(ns, move || {
        let u = UdpSocket::bind(("0.0.0.0", 0)).ok()?;
        u.set_read_timeout(Some(wait)).ok()?;
        u.send_to(&msg, (dst, port)).ok()?;
        let mut buf = vec![0u8; 65536];
        let (n, _) = u.recv_from(&mut buf).ok()?;
        buf.truncate(n);
        Some(buf)
    })
}

/// A DNS query over UDP (or TCP) from `ns` to `server`:53.
pub fn dns_ask(ns: &str, server: Ipv4Addr, name: &str, qtype: u16, tcp: bool) -> Option<DnsReply> {
    let q = dns_query_msg(0x5a5a, name, qtype);
    if !tcp {
        let r = udp_raw(ns, server, 53, &q, Duration::from_secs(3))?;
        return parse_reply(&r);
    }
    in_ns(ns, move || {
        let mut c =
            TcpStream::connect_timeout(&SocketAddr::from((server, 53)), Duration::from_secs(2))
                .ok()?;
        c.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
        let mut out = (q.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&q);
        c.write_all(&out).ok()?;
        let mut l = [0u8; 2];
        c.read_exact(&mut l).ok()?;
        let mut r = vec![0u8; u16::from_be_bytes(l) as usize];
        c.read_exact(&mut r).ok()?;
        parse_reply(&r)
    })
}

pub const BULK_PORT: u16 = 7008;
pub const SINK_PORT: u16 = 7009;

/// TCP servers for throughput: on BULK_PORT each connection gets `bytes`
/// bytes, then EOF; on SINK_PORT everything read is counted and the count
/// sent back after the client's EOF.
pub struct BulkServer {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl BulkServer {
    pub fn start(ns: &str, addr: Ipv4Addr, bytes: usize) -> BulkServer {
        let stop = Arc::new(AtomicBool::new(false));
        let (bulk, sink) = in_ns(ns, || {
            (
                TcpListener::bind((addr, BULK_PORT)).expect("bind bulk"),
                TcpListener::bind((addr, SINK_PORT)).expect("bind sink"),
            )
        });
        bulk.set_nonblocking(true).unwrap();
        sink.set_nonblocking(true).unwrap();
        let mut threads = Vec::new();
        let s1 = stop.clone();
        threads.push(std::thread::spawn(move || {
            let data = vec![0x5au8; bytes];
            while !s1.load(Ordering::Relaxed) {
                match bulk.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_write_timeout(Some(Duration::from_secs(30)));
                        let _ = c.write_all(&data);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }));
        let s2 = stop.clone();
        threads.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !s2.load(Ordering::Relaxed) {
                match sink.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
                        let mut n = 0usize;
                        while let Ok(k) = c.read(&mut buf) {
                            if k == 0 {
                                break;
                            }
                            n += k;
                        }
                        let _ = c.write_all(format!("{n}\n").as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }));
        BulkServer { stop, threads }
    }
}

impl Drop for BulkServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Download everything BULK_PORT sends, from `ns`: (bytes, seconds).
pub fn download(ns: &str, dst: Ipv4Addr) -> Option<(usize, f64)> {
    download_within(ns, dst, Duration::from_secs(20))
}

/// Like `download`, giving up (None) when nothing arrives for `stall`.
pub fn download_within(ns: &str, dst: Ipv4Addr, stall: Duration) -> Option<(usize, f64)> {
    in_ns(ns, || {
        let t = std::time::Instant::now();
        let mut c =
            TcpStream::connect_timeout(&SocketAddr::from((dst, BULK_PORT)), Duration::from_secs(2))
                .ok()?;
        c.set_read_timeout(Some(stall)).ok()?;
        let mut v = Vec::new();
        c.read_to_end(&mut v).ok()?;
        Some((v.len(), t.elapsed().as_secs_f64()))
    })
}

/// Upload `bytes` to SINK_PORT from `ns`: (bytes the server counted, seconds).
pub fn upload(ns: &str, dst: Ipv4Addr, bytes: usize) -> Option<(usize, f64)> {
    in_ns(ns, move || {
        let t = std::time::Instant::now();
        let mut c =
            TcpStream::connect_timeout(&SocketAddr::from((dst, SINK_PORT)), Duration::from_secs(2))
                .ok()?;
        c.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
        c.set_write_timeout(Some(Duration::from_secs(20))).ok()?;
        c.write_all(&vec![0xa5u8; bytes]).ok()?;
        c.shutdown(std::net::Shutdown::Write).ok()?;
        let mut s = String::new();
        c.read_to_string(&mut s).ok()?;
        Some((s.trim().parse().ok()?, t.elapsed().as_secs_f64()))
    })
}

/// A small HTTP/1.1 server on `addr`:80 (tests of the inspection proxy and
/// its bench): `GET /bytes/N` answers N bytes, anything else "ok"; every
/// request's Host header is recorded. Keeps connections open unless the
/// request says `Connection: close`, so a proxy that let a second request
/// through on one connection would be seen.
pub struct WebServer {
    pub hosts: Arc<std::sync::Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WebServer {
    pub fn start(ns: &str, addr: Ipv4Addr) -> WebServer {
        let l = in_ns(ns, || TcpListener::bind((addr, 80)).expect("bind :80"));
        l.set_nonblocking(true).unwrap();
        let hosts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, s) = (hosts.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((c, _)) => {
                        let h = h.clone();
                        std::thread::spawn(move || web_conn(c, &h));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        WebServer {
            hosts,
            stop,
            thread: Some(thread),
        }
    }
}

fn web_conn(c: std::net::TcpStream, hosts: &std::sync::Mutex<Vec<String>>) {
    use std::io::BufRead;
    let _ = c.set_nonblocking(false);
    let _ = c.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut w) = c.try_clone() else { return };
    let mut r = std::io::BufReader::new(c);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let mut close = false;
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("host:") {
                hosts.lock().unwrap().push(v.trim().to_string());
            }
            if lower.starts_with("connection:") && lower.contains("close") {
                close = true;
            }
        }
        let n: usize = path
            .strip_prefix("/bytes/")
            .and_then(|n| n.parse().ok())
            .unwrap_or(2);
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n");
        if w.write_all(head.as_bytes()).is_err() {
            return;
        }
        let chunk = vec![b'o'; 64 << 10];
        let mut left = n;
        while left > 0 {
            let k = left.min(chunk.len());
            if w.write_all(&chunk[..k]).is_err() {
                return;
            }
            left -= k;
        }
        if close {
            return;
        }
    }
}

impl Drop for WebServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One HTTP/1.1 exchange from namespace `ns` to `dst`:`port` with `req`
/// written as is; everything the other side sent until it closed (or 10 s).
pub fn http_raw(ns: &str, dst: Ipv4Addr, port: u16, req: &[u8]) -> Option<Vec<u8>> {
    let req = req.to_vec();
    in_ns(ns, move || {
        let mut c =
            std::net::TcpStream::connect_timeout(&(dst, port).into(), Duration::from_secs(5))
                .ok()?;
        c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        c.write_all(&req).ok()?;
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        Some(out)
    })
}
