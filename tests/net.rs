//! Session networking, for real, as root, inside namespaces the tests make
//! (see tests/common/netns.rs for the topology). Skipped when not root.

#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use std::net::Ipv4Addr;

use agent_sandbox::net::{Cidr, EgressFilter, Net, NetConfig};
use netns::*;

fn config(topo: &Topology, prefix: &str) -> NetConfig {
    NetConfig {
        host_netns: Some(topo.host_path()),
        uplink_if: "up0".into(),
        prefix: prefix.into(),
        tap_uid: Some(4242),
        tap_gid: Some(4243),
        ..NetConfig::default()
    }
}

/// Names of ours that still exist: namespaces, host links, host tables.
fn leftovers(topo: &Topology, prefix: &str) -> Vec<String> {
    let mut v = Vec::new();
    for l in sh(&["ip", "netns", "list"]).lines() {
        if l.starts_with(&format!("{prefix}-")) {
            v.push(format!("netns {l}"));
        }
    }
    for l in sh(&["ip", "-n", &topo.host, "-o", "link", "show"]).lines() {
        if l.contains(&format!(": {prefix}")) {
            v.push(format!("link {l}"));
        }
    }
    let tables = sh(&["ip", "netns", "exec", &topo.host, "nft", "list", "tables"]);
    for l in tables.lines() {
        if l.trim() == format!("table ip {prefix}") {
            v.push(l.to_string());
        }
    }
    v
}

fn blocked(ns: &str, dst: Ipv4Addr) {
    assert_eq!(
        tcp_probe(ns, dst),
        None,
        "tcp from {ns} to {dst} must be dropped"
    );
    assert_eq!(
        udp_probe(ns, dst),
        None,
        "udp from {ns} to {dst} must be dropped"
    );
}

#[test]
fn two_sessions_nat_isolation_policy_teardown() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxt1";
    let mut topo = Topology::new("t1");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let _inet = Servers::start(&topo.internet, &[INTERNET, METADATA, PRIVATE, CGNAT]);
    // A server in the host namespace too: a drop there must not be a mere RST.
    let _hostsrv = Servers::start(&topo.host, &[]);

    let net = Net::new(cfg.clone()).expect("net setup");
    let mut s1 = net
        .create_session(&EgressFilter::Internet)
        .expect("session 1");
    let mut s2 = net
        .create_session(&EgressFilter::Internet)
        .expect("session 2");

    // Names, addresses, routes, TAP.
    assert_ne!(s1.netns(), s2.netns());
    assert_ne!(s1.host_addr(), s2.host_addr());
    let nslist = sh(&["ip", "netns", "list"]);
    for s in [&s1, &s2] {
        assert!(s.netns().starts_with("asbxt1-"), "{}", s.netns());
        assert!(
            nslist.contains(s.netns()),
            "ip netns list lacks {}",
            s.netns()
        );
        let a = sh(&[
            "ip",
            "-n",
            &topo.host,
            "-o",
            "addr",
            "show",
            "dev",
            s.host_if(),
        ]);
        assert!(a.contains(&format!("{}/30", s.host_addr())), "{a}");
        let tap = sh(&["ip", "-n", s.netns(), "-d", "link", "show", "tap0"]);
        assert!(tap.contains("tap") && tap.contains("persist on"), "{tap}");
        assert!(
            tap.contains("user 4242") && tap.contains("group 4243"),
            "{tap}"
        );
        let ta = sh(&["ip", "-n", s.netns(), "-o", "addr", "show", "dev", "tap0"]);
        assert!(ta.contains("172.16.0.1/30"), "{ta}");
        let pa = sh(&[
            "ip",
            "-n",
            s.netns(),
            "-o",
            "addr",
            "show",
            "dev",
            s.peer_if(),
        ]);
        assert!(pa.contains(&format!("{}/30", s.peer_addr())), "{pa}");
        let r = sh(&["ip", "-n", s.netns(), "route", "show", "default"]);
        assert!(r.contains(&format!("via {}", s.host_addr())), "{r}");
        let t = sh(&[
            "ip",
            "netns",
            "exec",
            s.netns(),
            "nft",
            "list",
            "table",
            "ip",
            prefix,
        ]);
        assert!(t.contains("masquerade"), "{t}");
    }
    let ht = sh(&[
        "ip", "netns", "exec", &topo.host, "nft", "list", "table", "ip", prefix,
    ]);
    assert!(
        ht.contains("masquerade") && ht.contains("172.16.0.0/30"),
        "{ht}"
    );

    // Positive control: the blocked targets do answer when asked from the host.
    assert!(tcp_probe(&topo.host, METADATA).is_some());
    assert!(tcp_probe(&topo.host, PRIVATE).is_some());

    // The TAP's owner can attach without privileges, anybody else cannot.
    for (uid, gid, ok) in [
        (4242u32, 4243u32, true),
        (4244, 4243, false),
        (4242, 4245, false),
    ] {
        let r = in_ns(s1.netns(), move || {
            // As under the jailer: the device node is opened with privilege
            // (here 0600 root), the TAP attached after dropping it.
            let dev = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/net/tun")
                .unwrap();
            // Raw syscalls change this thread only (glibc would change all).
            // SAFETY: plain syscalls; the thread ends right after.
            unsafe {
                assert_eq!(
                    libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<u32>()),
                    0
                );
                assert_eq!(libc::syscall(libc::SYS_setresgid, gid, gid, gid), 0);
                assert_eq!(libc::syscall(libc::SYS_setresuid, uid, uid, uid), 0);
            }
            agent_sandbox::net::tap::attach(&dev, "tap0", true)
        });
        assert_eq!(r.is_ok(), ok, "attach as {uid}:{gid}: {r:?}");
    }

    let g1 = Guest::attach(&mut topo, s1.netns(), "tap0", 1);
    let g2 = Guest::attach(&mut topo, s2.netns(), "tap0", 2);

    for g in [&g1, &g2] {
        // Allowed, and NATed twice: the internet sees the host's uplink address.
        assert_eq!(tcp_probe(&g.ns, INTERNET).as_deref(), Some("192.0.2.2"));
        assert_eq!(udp_probe(&g.ns, INTERNET).as_deref(), Some("192.0.2.2"));
    }
    // Always blocked. A server in the session namespace too: the guest must
    // not reach the namespace around it either.
    let _nssrv = Servers::start(s1.netns(), &[]);
    let tap_addr: Ipv4Addr = GUEST_GW.parse().unwrap();
    for dst in [
        tap_addr,
        METADATA,
        PRIVATE,
        CGNAT,
        HOST_UPLINK,
        s1.host_addr(),
        s1.peer_addr(),
    ] {
        blocked(&g1.ns, dst);
    }
    // The other session.
    blocked(&g1.ns, s2.host_addr());
    blocked(&g1.ns, s2.peer_addr());

    // Live policy changes.
    s1.set_policy(&EgressFilter::None).unwrap();
    blocked(&g1.ns, INTERNET);
    assert!(
        tcp_probe(&g2.ns, INTERNET).is_some(),
        "session 2 unaffected"
    );
    let allow: EgressFilter =
        serde_json::from_str(r#"{"mode":"allowlist","rules":["198.51.100.0/24:7007/udp"]}"#)
            .unwrap();
    s1.set_policy(&allow).unwrap();
    assert_eq!(udp_probe(&g1.ns, INTERNET).as_deref(), Some("192.0.2.2"));
    assert_eq!(tcp_probe(&g1.ns, INTERNET), None);
    // An allowlist cannot open the always-blocked set.
    s1.set_policy(
        serde_json::from_str::<EgressFilter>(r#"{"mode":"allowlist","rules":["0.0.0.0/0"]}"#)
            .unwrap(),
    )
    .unwrap();
    blocked(&g1.ns, METADATA);
    assert!(tcp_probe(&g1.ns, INTERNET).is_some());
    let deny: EgressFilter =
        serde_json::from_str(r#"{"mode":"denylist","rules":["198.51.100.1:7007/tcp"]}"#).unwrap();
    s1.set_policy(&deny).unwrap();
    assert_eq!(tcp_probe(&g1.ns, INTERNET), None);
    assert!(udp_probe(&g1.ns, INTERNET).is_some());
    s1.set_policy(&EgressFilter::Internet).unwrap();
    assert!(tcp_probe(&g1.ns, INTERNET).is_some());

    // Fail closed: with the session's NAT gone, guest-sourced packets still
    // never reach the internet (rp_filter + blackhole + guard on the host).
    let i = topo.internet.as_str();
    sh(&["ip", "netns", "exec", i, "nft", "add table ip watch"]);
    sh(&[
        "ip",
        "netns",
        "exec",
        i,
        "nft",
        "add chain ip watch pre { type filter hook prerouting priority -300; }",
    ]);
    sh(&[
        "ip",
        "netns",
        "exec",
        i,
        "nft",
        "add rule ip watch pre ip saddr 172.16.0.0/30 counter",
    ]);
    sh(&[
        "ip",
        "netns",
        "exec",
        s1.netns(),
        "nft",
        &format!("flush chain ip {prefix} nat"),
    ]);
    blocked(&g1.ns, INTERNET);
    let w = sh(&["ip", "netns", "exec", i, "nft", "list table ip watch"]);
    assert!(
        w.contains("counter packets 0 bytes 0"),
        "guest-sourced packets leaked: {w}"
    );
    assert!(
        tcp_probe(&g2.ns, INTERNET).is_some(),
        "session 2 unaffected"
    );

    // Teardown: the VMM (here the relay) goes first, as in the daemon. The
    // server sockets in session 1's namespace are left open on purpose: they
    // keep that namespace alive, so its host link must go by the reaper's
    // fallback (explicit delete after the grace period).
    drop(g1);
    drop(g2);
    s1.teardown().unwrap();
    s1.teardown().unwrap(); // idempotent
    s2.teardown().unwrap();
    net.close().unwrap();
    let left = leftovers(&topo, prefix);
    assert!(left.is_empty(), "left behind: {left:?}");
    let routes = sh(&["ip", "-n", &topo.host, "route", "show", "type", "blackhole"]);
    assert!(routes.trim().is_empty(), "{routes}");
}

#[test]
fn sweep_after_crash_leaves_nothing() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxt2";
    let topo = Topology::new("t2");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let net = Net::new(cfg.clone()).unwrap();
    for _ in 0..3 {
        // A crash: no teardown runs.
        std::mem::forget(net.create_session(&EgressFilter::Internet).unwrap());
    }
    drop(net);
    assert_eq!(leftovers(&topo, prefix).len(), 3 + 3 + 1);
    let rep = Net::sweep(&cfg).unwrap();
    assert_eq!(rep.namespaces.len(), 3, "{rep:?}");
    assert_eq!(rep.links.len(), 3, "{rep:?}");
    assert_eq!(rep.tables, vec![prefix.to_string()]);
    let left = leftovers(&topo, prefix);
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(
        Net::sweep(&cfg).unwrap().is_empty(),
        "second sweep finds nothing"
    );
}

#[test]
fn failed_setup_leaves_nothing_and_frees_its_block() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxt3";
    let topo = Topology::new("t3");
    let mut cfg = config(&topo, prefix);
    // Room for exactly one session: a leaked block would make the last
    // create fail.
    cfg.veth_range = "10.200.0.0/30".parse::<Cidr>().unwrap();
    let _sweep = SweepGuard(cfg.clone());
    let net = Net::new(cfg.clone()).unwrap();
    for step in 1..=3 {
        let e = net
            .create_session_failing_after(&EgressFilter::Internet, step)
            .expect_err("injected failure");
        assert!(e.to_string().contains("injected"), "{e}");
        let left: Vec<String> = leftovers(&topo, prefix)
            .into_iter()
            .filter(|l| !l.starts_with("table"))
            .collect();
        assert!(left.is_empty(), "after failure at step {step}: {left:?}");
    }
    let mut s = net.create_session(&EgressFilter::None).unwrap();
    let e = net
        .create_session(&EgressFilter::None)
        .expect_err("range full");
    assert!(e.to_string().contains("no free address block"), "{e}");
    s.teardown().unwrap();
    drop(s);
    // The block comes free once the kernel has removed the old host link.
    let s = net.create_session(&EgressFilter::None).unwrap();
    drop(s); // Drop tears down too
    net.close().unwrap();
    assert!(leftovers(&topo, prefix).is_empty());
}

#[test]
fn parallel_sessions_do_not_collide() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxt4";
    let topo = Topology::new("t4");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let net = Net::new(cfg).unwrap();
    let sessions: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let net = net.clone();
                sc.spawn(move || {
                    (0..5)
                        .map(|_| net.create_session(&EgressFilter::Internet).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let mut addrs: Vec<_> = sessions.iter().map(|s| s.host_addr()).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 20);
    let mut names: Vec<_> = sessions.iter().map(|s| s.netns().to_string()).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 20);
    drop(sessions);
    // Someone flushes our host table: the next session puts it back first.
    sh(&[
        "ip",
        "netns",
        "exec",
        &topo.host,
        "nft",
        &format!("delete table ip {prefix}"),
    ]);
    let s = net.create_session(&EgressFilter::Internet).unwrap();
    let t = sh(&[
        "ip", "netns", "exec", &topo.host, "nft", "list", "table", "ip", prefix,
    ]);
    assert!(t.contains("masquerade"), "{t}");
    drop(s);
    net.close().unwrap();
    assert!(leftovers(&topo, prefix).is_empty());
}

#[test]
fn nft_batch_is_atomic_and_names_the_failing_message() {
    use agent_sandbox::net::netns as ans;
    use agent_sandbox::net::nft::{Chain, Match, Nft, Rule, Table, Verdict};
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let topo = Topology::new("t5");
    let ns = ans::open(&topo.host_path()).unwrap();
    let r = ans::run_in(Some(&ns), "t5", || {
        let mut nft = Nft::open("t5")?;
        let t = Table {
            name: "asbxt5".into(),
            sets: vec![],
            chains: vec![Chain {
                name: "c".into(),
                base: None,
                rules: vec![Rule::new(vec![Match::L4Proto(6)], Verdict::Accept)],
            }],
        };
        let mut b = nft.batch();
        b.create_table(&t);
        // A rule in a chain that does not exist: the whole batch must fail.
        b.add_rule("asbxt5", "missing", &Rule::new(vec![], Verdict::Drop));
        let err = nft.commit(b).expect_err("batch with a bad rule");
        let tables = nft.tables()?;
        let mut b = nft.batch();
        b.create_table(&t);
        nft.commit(b)?;
        let n = nft.rule_count("asbxt5")?;
        Ok((err.to_string(), tables, n))
    });
    let (err, tables, n) = r.unwrap();
    assert!(err.contains("add rule asbxt5 missing"), "{err}");
    assert!(
        !tables.contains(&"asbxt5".to_string()),
        "half a batch applied: {tables:?}"
    );
    assert_eq!(n, 1);
}

/// The uplink's own networks are blocked like RFC 1918 space, whatever
/// their addresses: here TEST-NET ranges (not in the built-in set), one
/// the uplink has at start (its gateway's), one it gains later as a
/// second address (seen at the next session start) and one reached by an
/// on-link route. Each has a listener the host itself reaches; the guests
/// reach none of them, while the internet address stays reachable.
#[test]
fn uplink_networks_are_blocked_whatever_their_addresses() {
    if !is_root() {
        skip!("{NEEDS_ROOT}");
    }
    let prefix = "asbxu1";
    let mut topo = Topology::new("u1");
    let cfg = config(&topo, prefix);
    let _sweep = SweepGuard(cfg.clone());
    let (h, i) = (topo.host.clone(), topo.internet.clone());
    let gateway = Ipv4Addr::new(192, 0, 2, 1);
    let later = Ipv4Addr::new(203, 0, 113, 1);
    let onlink = Ipv4Addr::new(192, 88, 99, 1);
    let _srv = Servers::start(&i, &[INTERNET, gateway]);
    // The host namespace reaches the listener: a None below is the firewall.
    assert!(tcp_probe(&h, gateway).is_some(), "test bench broken");

    let net = Net::new(cfg.clone()).unwrap();
    let mut s1 = net.create_session(EgressFilter::Internet).unwrap();
    let g1 = Guest::attach(&mut topo, s1.netns(), "tap0", 1);
    assert_eq!(tcp_probe(&g1.ns, INTERNET).as_deref(), Some("192.0.2.2"));
    blocked(&g1.ns, gateway);

    // The uplink gains a network (a second address) and an on-link route.
    sh(&[
        "ip",
        "-n",
        &h,
        "addr",
        "add",
        "203.0.113.2/24",
        "dev",
        "up0",
    ]);
    sh(&[
        "ip",
        "-n",
        &i,
        "addr",
        "add",
        "203.0.113.1/24",
        "dev",
        "wan0",
    ]);
    sh(&[
        "ip",
        "-n",
        &h,
        "route",
        "add",
        "192.88.99.0/24",
        "dev",
        "up0",
    ]);
    sh(&[
        "ip",
        "-n",
        &i,
        "addr",
        "add",
        "192.88.99.1/32",
        "dev",
        "wan0",
    ]);
    let _srv2 = Servers::start(&i, &[later, onlink]);
    for dst in [later, onlink] {
        assert!(tcp_probe(&h, dst).is_some(), "test bench broken for {dst}");
    }
    let mut s2 = net.create_session(EgressFilter::Internet).unwrap();
    let g2 = Guest::attach(&mut topo, s2.netns(), "tap0", 2);
    for g in [&g1, &g2] {
        for dst in [gateway, later, onlink] {
            blocked(&g.ns, dst);
        }
        assert_eq!(tcp_probe(&g.ns, INTERNET).as_deref(), Some("192.0.2.2"));
        assert_eq!(udp_probe(&g.ns, INTERNET).as_deref(), Some("192.0.2.2"));
    }
    // No allowlist opens them either (only the host's allow_exceptions do).
    let allow: EgressFilter =
        serde_json::from_str(r#"{"mode":"allowlist","rules":["0.0.0.0/0"]}"#).unwrap();
    s1.set_policy(&allow).unwrap();
    blocked(&g1.ns, later);
    assert!(tcp_probe(&g1.ns, INTERNET).is_some());

    drop((g1, g2));
    s1.teardown().unwrap();
    s2.teardown().unwrap();
    net.close().unwrap();
    assert_eq!(leftovers(&topo, prefix), Vec::<String>::new());
}
