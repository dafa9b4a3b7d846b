//! Domain allowlist (DNS forwarder + timeout set) and bandwidth limits, for
//! real, as root, in namespaces the tests make (tests/common/netns.rs). The
//! upstream resolver is a test server in the test "internet" namespace; no
//! query ever reaches a real resolver. Skipped when not root.

#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use serde_json::json;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use agent_sandbox::net::{Net, NetConfig, NetPolicy};
use netns::*;

const EVIL: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const EDGE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 9);
const A: u16 = 1;
const AAAA: u16 = 28;

fn config(topo: &Topology, prefix: &str) -> NetConfig {
    NetConfig {
        host_netns: Some(topo.host_path()),
        uplink_if: "up0".into(),
        prefix: prefix.into(),
        dns_upstreams: vec![(INTERNET, 53).into()],
        dns_timeout_ms: 1000,
        dns_ttl_min_secs: 1,
        ..NetConfig::default()
    }
}

fn policy(json: &str) -> NetPolicy {
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{json}: {e}"))
}

fn gw() -> Ipv4Addr {
    GUEST_GW.parse().unwrap()
}

fn leftovers(topo: &Topology, prefix: &str) -> Vec<String> {
    let mut v: Vec<String> = sh(&["ip", "netns", "list"])
        .lines()
        .filter(|l| l.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect();
    for l in sh(&["ip", "-n", &topo.host, "-o", "link", "show"]).lines() {
        if l.contains(&format!(": {prefix}")) {
            v.push(l.to_string());
        }
    }
    v
}

/// Elements of the session's set, as `nft` (not our code) lists them.
fn set_list(ns: &str, prefix: &str) -> String {
    sh(&[
        "ip",
        "netns",
        "exec",
        ns,
        "nft",
        "list",
        "set",
        "ip",
        prefix,
        "dns_allowed",
    ])
}

#[test]
fn dns_allowlist_resolves_allows_expires_and_survives_junk() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxd1";
    let mut topo = Topology::new("d1");
    add_internet_addr(&topo, EVIL);
    add_internet_addr(&topo, EDGE);
    let mut cfg = config(&topo, prefix);
    // The first upstream has nothing listening (port unreachable): every
    // query fails over to the second.
    cfg.dns_upstreams.insert(0, (INTERNET, 5353).into());
    let _sweep = SweepGuard(cfg.clone());
    let _srv = Servers::start(&topo.internet, &[INTERNET, EVIL, EDGE, PRIVATE]);
    let _bulk = BulkServer::start(&topo.internet, INTERNET, 2_000_000);
    // 40 A records: 670 bytes, more than a UDP reply without EDNS may hold.
    let many: Vec<Ipv4Addr> = (0..40)
        .map(|i| Ipv4Addr::new(203, 0, 113, 100 + i))
        .collect();
    let dns = DnsServer::start(
        &topo.internet,
        INTERNET,
        &[
            ("files.pypi.org", Rr::A(INTERNET, 2)),
            ("cdn.pypi.org", Rr::Cname("edge.example.net", 300)),
            ("edge.example.net", Rr::A(EDGE, 300)),
            ("github.com", Rr::A(EDGE, 300)),
            ("evil.com", Rr::A(EVIL, 300)),
            ("pypi.org", Rr::A(EVIL, 300)),
            // DNS rebinding: an allowed name pointing inside.
            ("internal.pypi.org", Rr::A(PRIVATE, 300)),
            ("many.pypi.org", Rr::Many(many.clone(), 300)),
        ],
    );

    let net = Net::new(cfg.clone()).unwrap();
    // Without upstreams a domain allowlist is refused up front.
    let bare = Net::new(NetConfig {
        dns_upstreams: vec![],
        ..cfg.clone()
    })
    .unwrap();
    let e = bare
        .create_session(policy(r#"{"domains":["github.com"]}"#))
        .expect_err("no upstream");
    assert!(e.to_string().contains("dns_upstreams"), "{e}");
    drop(bare);

    let s = net
        .create_session(policy(
            r#"{"mode":"allowlist","domains":["*.pypi.org","github.com"],
                "bandwidth":{"down_kbit":4000}}"#,
        ))
        .expect("session");
    let g = Guest::attach(&mut topo, s.netns(), "tap0", 1);

    // Nothing resolved yet: nothing reachable.
    assert_eq!(tcp_probe(&g.ns, INTERNET), None);
    assert_eq!(tcp_probe(&g.ns, EDGE), None);

    // An allowed name resolves through the forwarder; its address opens.
    let r = dns_ask(&g.ns, gw(), "files.pypi.org", A, false).expect("answer");
    assert_eq!((r.rcode, r.addrs.clone()), (0, vec![INTERNET]), "{r:?}");
    assert_eq!(tcp_probe(&g.ns, INTERNET).as_deref(), Some("192.0.2.2"));
    assert!(set_list(s.netns(), prefix).contains("198.51.100.1"));
    // A download that outlives the address's TTL (2 s; 2 MB at 4 Mbit/s
    // take 4 s) runs to its end; a new connection after the TTL does not.
    let (n, secs) = download(&g.ns, INTERNET).expect("download via a resolved address");
    assert_eq!(n, 2_000_000);
    assert!(secs > 3.0, "{secs}");
    assert_eq!(tcp_probe(&g.ns, INTERNET), None, "TTL over: closed");

    // Not on the list: NXDOMAIN without asking upstream; the address stays
    // closed even though the guest knows it.
    for name in ["evil.com", "pypi.org", "files.pypi.org.evil.com"] {
        let r = dns_ask(&g.ns, gw(), name, A, false).expect("answer");
        assert_eq!(r.rcode, 3, "{name}: {r:?}");
        assert!(r.addrs.is_empty());
    }
    {
        let asked = dns.asked.lock().unwrap();
        assert!(
            !asked.iter().any(|n| n.contains("evil") || n == "pypi.org"),
            "refused names reached upstream: {asked:?}"
        );
    }
    assert_eq!(tcp_probe(&g.ns, EVIL), None);

    // CNAME chain, over TCP: the target's address opens.
    let r = dns_ask(&g.ns, gw(), "cdn.pypi.org", A, true).expect("tcp answer");
    assert_eq!((r.rcode, r.addrs.clone()), (0, vec![EDGE]), "{r:?}");
    assert!(tcp_probe(&g.ns, EDGE).is_some());

    // An allowed name answering with a blocked address opens nothing.
    let r = dns_ask(&g.ns, gw(), "internal.pypi.org", A, false).expect("answer");
    assert_eq!(r.addrs, vec![PRIVATE]);
    assert_eq!(tcp_probe(&g.ns, PRIVATE), None);
    assert!(!set_list(s.netns(), prefix).contains("10.99.0.1"));

    // A big answer: over UDP the guest is told to retry over TCP, where it
    // gets all of it; every address is in the set.
    let r = dns_ask(&g.ns, gw(), "many.pypi.org", A, false).expect("answer");
    assert!(r.truncated && r.answers == 0, "{r:?}");
    let r = dns_ask(&g.ns, gw(), "many.pypi.org", A, true).expect("tcp answer");
    assert_eq!(r.addrs, many);
    let set = set_list(s.netns(), prefix);
    assert!(many.iter().all(|a| set.contains(&format!("{a} "))), "{set}");

    // AAAA: empty answer (sessions have no IPv6 route).
    let r = dns_ask(&g.ns, gw(), "github.com", AAAA, false).expect("answer");
    assert_eq!((r.rcode, r.answers), (0, 0));

    // A client we did not write agrees.
    if std::path::Path::new("/usr/bin/dig").exists() {
        let out = sh(&[
            "ip",
            "netns",
            "exec",
            &g.ns,
            "dig",
            "+short",
            "+tries=1",
            "+time=3",
            "@172.16.0.1",
            "github.com",
            "A",
        ]);
        assert_eq!(out.trim(), "198.51.100.9", "dig: {out}");
        let out = sh(&[
            "ip",
            "netns",
            "exec",
            &g.ns,
            "dig",
            "+tries=1",
            "+time=3",
            "@172.16.0.1",
            "evil.com",
        ]);
        assert!(out.contains("status: NXDOMAIN"), "dig: {out}");
    } else {
        skip::not_checked("dig is not installed (dnsutils, images/install-deps.sh)");
    }

    // Junk never kills the forwarder: truncated, oversized, compression
    // loops, responses, random bytes, over UDP and TCP.
    let good = dns_query_msg(7, "github.com", A);
    let mut lp = good[..12].to_vec();
    lp.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
    let mut resp = good.clone();
    resp[2] |= 0x80;
    let mut junk: Vec<Vec<u8>> = vec![
        good[..5].to_vec(),
        good[..good.len() - 3].to_vec(),
        vec![0xff; 3000],
        vec![0x41; 5000],
        lp.clone(),
        resp,
        vec![],
    ];
    let mut x = 0x1234_5678u32;
    for i in 0..200 {
        let mut m = good.clone();
        for _ in 0..(i % 7) + 1 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let at = x as usize % m.len();
            m[at] = (x >> 8) as u8;
        }
        junk.push(m);
    }
    for m in &junk {
        if let Some(r) = udp_raw(&g.ns, gw(), 53, m, Duration::from_millis(200)) {
            // Whatever comes back is a well-formed response header.
            assert!(r.len() >= 12 && r[2] & 0x80 != 0, "{r:?}");
        }
    }
    let r = udp_raw(&g.ns, gw(), 53, &lp, Duration::from_secs(1)).expect("FORMERR");
    assert_eq!(r[3] & 0x0f, 1, "compression loop: FORMERR");
    in_ns(&g.ns, || {
        use std::io::Write;
        use std::net::TcpStream;
        // A huge length prefix, then garbage; and an idle connection.
        if let Ok(mut c) = TcpStream::connect((gw(), 53)) {
            let _ = c.write_all(&[0xff, 0xff, 1, 2, 3]);
        }
        let _idle = TcpStream::connect((gw(), 53));
    });
    let r = dns_ask(&g.ns, gw(), "github.com", A, false).expect("still answering");
    assert_eq!(r.addrs, vec![EDGE]);

    // TTL expiry: files.pypi.org had TTL 2 s, so its address closes again
    // (the bound is for "never", not for how soon).
    let t = Instant::now();
    while tcp_probe(&g.ns, INTERNET).is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "address still open after its TTL"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(!set_list(s.netns(), prefix).contains("198.51.100.1 "));

    // Live change: other names; resolved addresses of the old list go, and
    // so do connections they let in.
    let r = dns_ask(&g.ns, gw(), "files.pypi.org", A, false).expect("answer");
    assert_eq!(r.addrs, vec![INTERNET]);
    let gns = g.ns.clone();
    let dl = std::thread::spawn(move || download_within(&gns, INTERNET, Duration::from_secs(2)));
    std::thread::sleep(Duration::from_millis(800));
    s.set_policy(policy(
        r#"{"mode":"allowlist","domains":["files.pypi.org"],"bandwidth":{"down_kbit":4000}}"#,
    ))
    .unwrap();
    assert_eq!(dl.join().unwrap(), None, "old connection cut");
    assert_eq!(tcp_probe(&g.ns, EDGE), None, "set flushed on a name change");
    let r = dns_ask(&g.ns, gw(), "github.com", A, false).expect("answer");
    assert_eq!(r.rcode, 3);
    let r = dns_ask(&g.ns, gw(), "files.pypi.org", A, false).expect("answer");
    assert_eq!(r.addrs, vec![INTERNET]);
    assert!(tcp_probe(&g.ns, INTERNET).is_some());
    // Internet: the resolver answers every name, and opens nothing by it
    // (the mode's rules decide; the set was flushed by the change).
    s.set_policy(policy(r#"{"mode":"internet"}"#)).unwrap();
    assert_eq!(
        dns_ask(&g.ns, gw(), "evil.com", A, false).map(|r| r.addrs),
        Some(vec![EVIL])
    );
    assert!(tcp_probe(&g.ns, EVIL).is_some());
    assert!(!set_list(s.netns(), prefix).contains("elements = {"));
    // Internet with names refused (the seed's VM_DNS_MODE=deny): those are
    // NXDOMAIN without asking upstream, every other name resolves, and
    // nothing is opened by a name (the mode decides). A bucket of 800 kbit
    // is 100000 bytes in the kernel's tbf.
    let before = dns.asked.lock().unwrap().len();
    s.set_policy(policy(
        r#"{"mode":"internet","denied_domains":["evil.com","*.pypi.org"],
            "bandwidth":{"down_kbit":8000,"up_kbit":8000,"burst_kbit":800}}"#,
    ))
    .unwrap();
    for name in ["evil.com", "files.pypi.org"] {
        let r = dns_ask(&g.ns, gw(), name, A, false).expect("answer");
        assert_eq!(r.rcode, 3, "{name}: {r:?}");
    }
    {
        let asked = dns.asked.lock().unwrap();
        assert!(
            !asked[before..]
                .iter()
                .any(|n| n == "evil.com" || n.ends_with("pypi.org")),
            "refused names reached upstream: {asked:?}"
        );
    }
    let r = dns_ask(&g.ns, gw(), "github.com", A, false).expect("answer");
    assert_eq!((r.rcode, r.addrs), (0, vec![EDGE]));
    assert!(!set_list(s.netns(), prefix).contains("elements = {"));
    let q = sh(&[
        "ip",
        "netns",
        "exec",
        s.netns(),
        "tc",
        "-j",
        "qdisc",
        "show",
        "dev",
        "tap0",
    ]);
    let q: serde_json::Value = serde_json::from_str(&q).unwrap_or_else(|e| panic!("{q}: {e}"));
    let tbf = q
        .as_array()
        .and_then(|a| a.iter().find(|d| d["kind"] == "tbf"))
        .unwrap_or_else(|| panic!("no tbf on tap0: {q}"));
    assert_eq!(tbf["options"]["burst"], 100_000, "{tbf}");
    // An allowlist without names: no resolver at all (nothing on port 53).
    s.set_policy(policy(
        r#"{"mode":"allowlist","rules":["198.51.100.7/32"]}"#,
    ))
    .unwrap();
    assert_eq!(dns_ask(&g.ns, gw(), "evil.com", A, false), None);
    assert!(tcp_probe(&g.ns, EVIL).is_some());
    assert_eq!(tcp_probe(&g.ns, INTERNET), None);
    // And back on, live.
    s.set_policy(policy(r#"{"mode":"none","domains":["github.com"]}"#))
        .unwrap();
    assert_eq!(tcp_probe(&g.ns, EDGE), None);
    assert_eq!(
        dns_ask(&g.ns, gw(), "github.com", A, false).map(|r| r.addrs),
        Some(vec![EDGE])
    );
    assert!(tcp_probe(&g.ns, EDGE).is_some());
    assert_eq!(tcp_probe(&g.ns, INTERNET), None);

    drop(g);
    drop(s);
    net.close().unwrap();
    let left = leftovers(&topo, prefix);
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn bandwidth_limit_throttles_both_ways_and_changes_live() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    const MB2: usize = 2 * 1000 * 1000;
    let prefix = "asbxd2";
    let mut topo = Topology::new("d2");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let _bulk = BulkServer::start(&topo.internet, INTERNET, MB2);
    let net = Net::new(cfg).unwrap();
    let s = net
        .create_session(policy(r#"{"bandwidth":{"down_kbit":8000,"up_kbit":4000}}"#))
        .unwrap();
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", "tap0"]);
    assert!(q.contains("tbf") && q.contains("rate 8Mbit"), "{q}");
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", s.peer_if()]);
    assert!(q.contains("tbf") && q.contains("rate 4Mbit"), "{q}");
    let g = Guest::attach(&mut topo, s.netns(), "tap0", 1);

    // 2 MB at 8 Mbit/s: 2 s at least (the bucket holds 20 ms worth).
    let (n, limited) = download(&g.ns, INTERNET).expect("download");
    assert_eq!(n, MB2);
    eprintln!("2 MB down at 8 Mbit/s: {limited:.2} s");
    assert!(limited >= 1.9, "not throttled: {limited:.2} s");
    // A rate 10x too low (a unit slip) would take 20 s; load alone does
    // not get there.
    assert!(limited < 15.0, "far slower than the limit: {limited:.2} s");
    // 1 MB up at 4 Mbit/s: 2 s at least.
    let (n, up) = upload(&g.ns, INTERNET, MB2 / 2).expect("upload");
    assert_eq!(n, MB2 / 2);
    eprintln!("1 MB up at 4 Mbit/s: {up:.2} s");
    assert!(up >= 1.9, "upload not throttled: {up:.2} s");

    // Live: faster limit, then none.
    s.set_policy(policy(r#"{"bandwidth":{"down_kbit":32000}}"#))
        .unwrap();
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", "tap0"]);
    assert!(q.contains("tbf") && q.contains("rate 32Mbit"), "{q}");
    let (_, faster) = download(&g.ns, INTERNET).expect("download");
    eprintln!("2 MB down at 32 Mbit/s: {faster:.2} s");
    assert!(faster >= 0.45, "32 Mbit/s limit not applied: {faster:.2} s");
    // The new rate is the qdisc above; how much faster the download got
    // is a figure (printed), not a bound a loaded host keeps.
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", s.peer_if()]);
    assert!(!q.contains("tbf"), "upload limit not removed: {q}");
    s.set_policy(policy(r#"{"mode":"internet"}"#)).unwrap();
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", "tap0"]);
    assert!(!q.contains("tbf"), "{q}");
    let (_, free) = download(&g.ns, INTERNET).expect("download");
    eprintln!("2 MB down unlimited: {free:.2} s");
    // A leftover 8 Mbit/s limit would take `limited` again (a leftover
    // 32 Mbit/s one is the qdisc check above); unlimited over veth is
    // milliseconds even on a loaded host.
    assert!(free < limited / 2.0, "{free:.2} s vs {limited:.2} s");
    assert_eq!(
        s.policy().map(|p| p.bandwidth),
        Some(None),
        "policy in force"
    );

    drop(g);
    drop(s);
    net.close().unwrap();
    assert!(leftovers(&topo, prefix).is_empty());
}

#[test]
fn doctor_passes_here_and_leaves_nothing() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let topo = Topology::new("d3");
    let cfg = config(&topo, "asbxd3");
    agent_sandbox::net::doctor::check(&cfg).expect("doctor");
    assert!(leftovers(&topo, "asbxd3").is_empty());
}

#[test]
fn failed_live_change_keeps_the_previous_policy() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxd4";
    let mut topo = Topology::new("d4");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let _srv = Servers::start(&topo.internet, &[INTERNET]);
    let net = Net::new(cfg).unwrap();
    // An allowlist without names runs no resolver: port 53 is free.
    let before =
        r#"{"mode":"allowlist","rules":["198.51.100.0/24"],"bandwidth":{"down_kbit":8000}}"#;
    let s = net.create_session(policy(before)).unwrap();
    let g = Guest::attach(&mut topo, s.netns(), "tap0", 1);
    assert!(tcp_probe(&g.ns, INTERNET).is_some());
    // Someone holds port 53 on the gateway: the forwarder cannot start, so
    // the change must fail as a whole, after its firewall part and its
    // bandwidth part were already installed.
    let squatter = in_ns(s.netns(), || {
        std::net::UdpSocket::bind((gw(), 53)).expect("squat port 53")
    });
    let e = s
        .set_policy(policy(
            r#"{"mode":"none","domains":["github.com"],"bandwidth":{"down_kbit":16000}}"#,
        ))
        .expect_err("forwarder cannot bind");
    assert!(e.to_string().contains("53"), "{e}");
    // Everything as before: the policy in force, egress open, old limit.
    assert_eq!(s.policy(), Some(policy(before)));
    assert!(tcp_probe(&g.ns, INTERNET).is_some(), "egress rolled back");
    let q = sh(&["tc", "-n", s.netns(), "qdisc", "show", "dev", "tap0"]);
    assert!(q.contains("rate 8Mbit"), "limit rolled back: {q}");
    drop(squatter);
    s.set_policy(policy(r#"{"mode":"none","domains":["github.com"]}"#))
        .expect("works once the port is free");
    assert_eq!(tcp_probe(&g.ns, INTERNET), None);
    drop(g);
    drop(s);
    net.close().unwrap();
    assert!(leftovers(&topo, prefix).is_empty());
}

/// The inspection proxy without a VM (a namespace on the TAP plays the
/// guest): with `domains: [pypi.test]`, HTTP to a shared address passes
/// only when the request names pypi.test, whatever address the guest
/// dialled; the server sees no other name; TLS without SNI and junk are
/// refused; the DNS set still opens other ports for resolved names;
/// counters count; a live change to `internet` stops the redirect.
#[test]
fn the_proxy_lets_through_only_the_listed_names() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxp1";
    let mut topo = Topology::new("p1");
    add_internet_addr(&topo, EVIL);
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let web = WebServer::start(&topo.internet, INTERNET);
    let _srv = Servers::start(&topo.internet, &[INTERNET, EVIL]);
    let _dns = DnsServer::start(
        &topo.internet,
        INTERNET,
        &[
            ("pypi.test", Rr::A(INTERNET, 300)),
            ("evil.test", Rr::A(INTERNET, 300)),
        ],
    );
    let net = Net::new(cfg).unwrap();
    let s = net
        .create_session(policy(r#"{"mode":"allowlist","domains":["pypi.test"]}"#))
        .expect("session");
    let g = Guest::attach(&mut topo, s.netns(), "tap0", 1);
    // Its decisions go to an audit log (issue #26).
    let audit_dir = tempfile::tempdir().unwrap();
    let log = agent_sandbox::audit::Log::start(
        &agent_sandbox::audit::Settings::default(),
        audit_dir.path().to_path_buf(),
        None,
    )
    .unwrap();
    s.set_audit(Some(agent_sandbox::audit::Tag {
        log: log.clone(),
        owner: "k".into(),
        session: "p1".into(),
    }));
    let get = |dst: Ipv4Addr, host: &str| {
        let req = format!("GET /bytes/5 HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let out = http_raw(&g.ns, dst, 80, req.as_bytes()).unwrap_or_default();
        String::from_utf8_lossy(&out).into_owned()
    };
    // Listed: through, whatever address the guest dialled (nothing
    // resolved yet, and EVIL is not where pypi.test lives).
    let ok = get(INTERNET, "pypi.test");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.ends_with("ooooo"), "{ok}");
    assert!(get(EVIL, "pypi.test").starts_with("HTTP/1.1 200"));
    // Not listed, an IP literal, no Host: a 403 from the proxy.
    for host in ["evil.test", "198.51.100.1", ""] {
        let r = if host.is_empty() {
            let out = http_raw(&g.ns, INTERNET, 80, b"GET / HTTP/1.1\r\n\r\n").unwrap_or_default();
            String::from_utf8_lossy(&out).into_owned()
        } else {
            get(INTERNET, host)
        };
        assert!(r.starts_with("HTTP/1.1 403"), "Host {host:?}: {r}");
        assert!(r.contains("agent-sandbox"), "{r}");
    }
    // A second request on the connection naming another host never
    // leaves: one answer, then the proxy's close.
    let two = http_raw(
        &g.ns,
        INTERNET,
        80,
        b"GET /bytes/1 HTTP/1.1\r\nHost: pypi.test\r\n\r\nGET /bytes/1 HTTP/1.1\r\nHost: evil.test\r\n\r\n",
    )
    .unwrap_or_default();
    assert_eq!(
        String::from_utf8_lossy(&two).matches("HTTP/1.1").count(),
        1,
        "{}",
        String::from_utf8_lossy(&two)
    );
    // A POST body by Content-Length and by chunks goes through whole.
    let post = http_raw(
        &g.ns,
        INTERNET,
        80,
        b"POST /bytes/3 HTTP/1.1\r\nHost: pypi.test\r\nContent-Length: 4\r\n\r\nbody",
    )
    .unwrap_or_default();
    assert!(String::from_utf8_lossy(&post).ends_with("ooo"));
    let chunked = http_raw(
        &g.ns,
        INTERNET,
        80,
        b"POST /bytes/3 HTTP/1.1\r\nHost: pypi.test\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\n\r\n",
    )
    .unwrap_or_default();
    assert!(String::from_utf8_lossy(&chunked).ends_with("ooo"));
    // TLS without SNI, and bytes that are neither: refused.
    let tls = http_raw(&g.ns, INTERNET, 443, &[0x16, 3, 1, 0, 4, 1, 0, 0, 0]).unwrap_or_default();
    assert_eq!(tls.first(), Some(&0x15), "a TLS alert: {tls:?}");
    assert_eq!(
        http_raw(&g.ns, INTERNET, 80, b"SSH-2.0-x\r\n\r\n")
            .unwrap_or_default()
            .get(..12),
        Some(&b"HTTP/1.1 403"[..])
    );
    let hosts = web.hosts.lock().unwrap().clone();
    assert!(!hosts.is_empty());
    assert!(hosts.iter().all(|h| h == "pypi.test"), "{hosts:?}");

    let st = s.proxy_stats().expect("the proxy runs");
    assert!(st.allowed >= 5, "{st:?}");
    assert_eq!(st.refused_not_listed, 1, "{st:?}");
    assert_eq!(st.refused_ip_literal, 1, "{st:?}");
    assert!(st.refused_no_name >= 3, "{st:?}");
    // A name the policy does not list, asked of the session's resolver.
    let r = dns_ask(&g.ns, gw(), "evil.test", A, false).expect("answer");
    assert_ne!(r.rcode, 0, "{r:?}");
    // Each decision is an `egress` record: allowed with the address
    // dialled and the bytes both ways at close, refused with the reason.
    assert!(log.flush(Duration::from_secs(5)));
    let recs: Vec<serde_json::Value> = log
        .files("k", "p1")
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
    let allowed: Vec<_> = recs.iter().filter(|r| r["decision"] == "allowed").collect();
    assert_eq!(allowed.len() as u64, st.allowed, "{recs:?}");
    let a = allowed[0];
    assert_eq!((&a["name"], &a["port"]), (&json!("pypi.test"), &json!(80)));
    assert_eq!(a["address"], json!(INTERNET.to_string()));
    assert!(
        a["bytesUp"].as_u64().unwrap() > 20 && a["bytesDown"].as_u64().unwrap() > 5,
        "{a}"
    );
    let refused: Vec<_> = recs.iter().filter(|r| r["decision"] == "refused").collect();
    assert!(refused
        .iter()
        .any(|r| r["name"] == "evil.test" && r["reason"] == "NotListed"));
    assert!(refused.iter().any(|r| r["reason"] == "IpLiteral"));
    assert!(
        refused
            .iter()
            .any(|r| r["via"] == "dns" && r["name"] == "evil.test"),
        "{refused:?}"
    );
    assert!(recs.iter().all(|r| r["kind"] == "egress"));

    // Other ports: the DNS set, as before: what pypi.test resolved to (by
    // the proxy's own lookup through the forwarder, or the guest's) is
    // open, an address no allowed name has is not.
    let r = dns_ask(&g.ns, gw(), "pypi.test", A, false).expect("answer");
    assert_eq!(r.addrs, vec![INTERNET]);
    assert!(tcp_probe(&g.ns, INTERNET).is_some());
    assert_eq!(tcp_probe(&g.ns, EVIL), None);

    // Internet mode: no proxy; Host is no longer looked at.
    s.set_policy(policy(r#"{"mode":"internet"}"#)).unwrap();
    assert!(s.proxy_stats().is_none());
    assert!(get(INTERNET, "evil.test").starts_with("HTTP/1.1 200"));
    // And back: proxied again (the listener's port was freed).
    s.set_policy(policy(r#"{"mode":"none","domains":["pypi.test"]}"#))
        .unwrap();
    assert!(get(INTERNET, "evil.test").starts_with("HTTP/1.1 403"));
    assert!(get(INTERNET, "pypi.test").starts_with("HTTP/1.1 200"));
    // A plain CIDR rule stays an address rule: its destination is not
    // proxied (no name check there), every other one still is.
    s.set_policy(policy(
        r#"{"mode":"allowlist","rules":["198.51.100.1/32:80/tcp"],"domains":["pypi.test"]}"#,
    ))
    .unwrap();
    assert!(get(INTERNET, "evil.test").starts_with("HTTP/1.1 200"));
    assert!(get(EVIL, "evil.test").starts_with("HTTP/1.1 403"));
    // A guest holding MAX_CONNS silent connections: the next is closed at
    // once and counted; the held ones do not outlive the hello timeout.
    let before = s.proxy_stats().map_or(0, |st| st.connections);
    let held = in_ns(&g.ns, || {
        (0..agent_sandbox::net::proxy::MAX_CONNS)
            .map(|_| {
                std::net::TcpStream::connect_timeout(&(EVIL, 80).into(), Duration::from_secs(5))
                    .expect("connect")
            })
            .collect::<Vec<_>>()
    });
    let until = Instant::now() + Duration::from_secs(10);
    while s.proxy_stats().map_or(0, |st| st.connections) < before + held.len() as u64 {
        assert!(Instant::now() < until, "the proxy did not accept them all");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = Instant::now();
    assert_eq!(
        http_raw(
            &g.ns,
            EVIL,
            80,
            b"GET / HTTP/1.1\r\nHost: pypi.test\r\n\r\n"
        ),
        Some(Vec::new()),
        "closed without an answer"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(s.proxy_stats().map(|st| st.refused_busy), Some(1));
    drop(held);
    drop(g);
    drop(s);
}
