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

/// Print why a test is skipped; returns true when it must be.
pub fn skip_unless_root(test: &str) -> bool {
    if !is_root() {
        eprintln!("SKIP {test}: needs root (network namespaces, netlink, nftables)");
        return true;
    }
    false
}

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
            // SAFETY: setns on a valid fd, this thread only.
            assert_eq!(
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
            let idx = unsafe { libc::if_nametoindex(c"gwire".as_ptr()) };
            assert!(idx > 0, "gwire index");
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
            sll.sll_ifindex = idx as i32;
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
                unsafe { libc::send(p, buf.as_ptr().cast(), n as usize, 0) };
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
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
