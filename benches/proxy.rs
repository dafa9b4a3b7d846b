//! The inspection proxy (src/net/proxy.rs) against direct NAT, same run:
//! two sessions on one `Net` in a throwaway test topology, one `internet`
//! (NAT only), one `allowlist` with `domains` (every TCP connection to
//! port 80 through the proxy); a namespace on each TAP plays the guest and
//! talks to one HTTP server in the test internet namespace. Prints the
//! time from connect to the last byte of a small answer (p50/p99) and
//! the rate of a large download, both ways. Run as root:
//! `cargo bench --bench proxy` (N from ASBX_BENCH_N, default 200).
//!
//! The "guest" reaches its TAP through a userspace frame relay
//! (tests/common/netns.rs `Guest`), the same for both sessions: it bounds
//! the download rate of both, so compare the two, not the absolute rate.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/netns.rs"]
mod netns;
#[path = "../tests/common/skip.rs"]
mod skip;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use agent_sandbox::net::{Net, NetConfig, NetPolicy};
use netns::{in_ns, is_root, DnsServer, Guest, Rr, SweepGuard, Topology, WebServer, INTERNET};

/// The `p` quantile in milliseconds.
fn pct(v: &mut [Duration], p: f64) -> f64 {
    bench::pct(v, p).as_secs_f64() * 1e3
}

/// One `GET path` with Connection: close; the bytes received.
fn get(ns: &str, path: &str) -> usize {
    let req = format!("GET {path} HTTP/1.1\r\nHost: pypi.test\r\nConnection: close\r\n\r\n");
    in_ns(ns, move || {
        let mut c = TcpStream::connect_timeout(&(INTERNET, 80).into(), Duration::from_secs(5))
            .expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        c.write_all(req.as_bytes()).unwrap();
        let mut buf = vec![0u8; 256 << 10];
        let mut n = 0;
        loop {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k,
            }
        }
    })
}

fn main() {
    if !is_root() {
        println!("SKIP bench proxy: needs root (network namespaces, netlink, nftables)");
        return;
    }
    let n: usize = std::env::var("ASBX_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut topo = Topology::new("bproxy");
    let cfg = NetConfig {
        host_netns: Some(topo.host_path()),
        uplink_if: "up0".into(),
        prefix: "asbxy".into(),
        dns_upstreams: vec![(INTERNET, 53).into()],
        ..NetConfig::default()
    };
    let _sweep = SweepGuard(cfg.clone());
    let _ = Net::sweep(&cfg);
    let _web = WebServer::start(&topo.internet, INTERNET);
    let _dns = DnsServer::start(
        &topo.internet,
        INTERNET,
        &[("pypi.test", Rr::A(INTERNET, 300))],
    );
    let net = Net::new(cfg).expect("net init");
    let p = |j: &str| serde_json::from_str::<NetPolicy>(j).expect("policy");
    let direct = net
        .create_session(p(r#"{"mode":"internet"}"#))
        .expect("session");
    let proxied = net
        .create_session(p(r#"{"mode":"allowlist","domains":["pypi.test"]}"#))
        .expect("session");
    let gd = Guest::attach(&mut topo, direct.netns(), "tap0", 1);
    let gp = Guest::attach(&mut topo, proxied.netns(), "tap0", 2);
    // Warm-up (ARP, the proxy's first lookup through the forwarder).
    for g in [&gd, &gp] {
        assert!(get(&g.ns, "/bytes/1") > 0);
    }
    println!("small answer (connect .. last byte of GET /bytes/1), n={n}, interleaved:");
    let (mut td, mut tp) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        for (g, v) in [(&gd, &mut td), (&gp, &mut tp)] {
            let t = Instant::now();
            let got = get(&g.ns, "/bytes/1");
            v.push(t.elapsed());
            assert!(got > 0);
        }
    }
    let (d50, d99, p50, p99) = (
        pct(&mut td, 0.5),
        pct(&mut td, 0.99),
        pct(&mut tp, 0.5),
        pct(&mut tp, 0.99),
    );
    println!("  direct NAT   p50 {d50:>8.3} ms   p99 {d99:>8.3} ms");
    println!("  via proxy    p50 {p50:>8.3} ms   p99 {p99:>8.3} ms");
    println!("  added by the proxy: p50 {:+.3} ms", p50 - d50);
    const BIG: usize = 32 << 20;
    println!("download of {} MiB, best of 3:", BIG >> 20);
    for (name, g) in [("direct NAT", &gd), ("via proxy", &gp)] {
        let mut best = 0f64;
        for _ in 0..3 {
            let t = Instant::now();
            let got = get(&g.ns, &format!("/bytes/{BIG}"));
            assert!(got >= BIG, "{name}: {got} bytes");
            best = best.max(got as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e6);
        }
        println!("  {name:<12} {best:>8.1} Mbit/s");
    }
    if let Some(s) = proxied.proxy_stats() {
        println!("proxy counters: {s:?}");
    }
    drop(gd);
    drop(gp);
}
