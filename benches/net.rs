//! Session network setup/teardown: our netlink path versus the same steps
//! done with `ip` and `nft` commands, in the same run, inside a throwaway
//! test topology (no packet leaves it). Run as root:
//! `cargo bench --bench net` (N from ASBX_BENCH_N, default 50).

#[path = "../tests/common/netns.rs"]
mod netns;
#[path = "../tests/common/skip.rs"]
mod skip;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_sandbox::net::{firewall, EgressFilter, Net, NetConfig, NetPolicy};
use netns::{is_root, sh, SweepGuard, Topology};

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

fn report(name: &str, v: &mut [Duration]) -> (f64, f64) {
    let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
    let mean = v.iter().map(|d| d.as_secs_f64()).sum::<f64>() / v.len() as f64 * 1e3;
    println!(
        "{name:<34} n={:<3} p50 {p50:>8.3} ms   p99 {p99:>8.3} ms   mean {mean:>8.3} ms",
        v.len()
    );
    (p50, p99)
}

fn run(args: &[&str]) {
    let st = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .status()
        .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
    assert!(st.success(), "{args:?} failed");
}

fn nft_in(ns: &str, script: &str) {
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn nft");
    c.stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(c.wait().unwrap().success(), "nft -f failed:\n{script}");
}

fn main() {
    if !is_root() {
        println!("SKIP bench net: needs root (network namespaces, netlink, nftables)");
        return;
    }
    let n: usize = std::env::var("ASBX_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let topo = Topology::new("bench");
    let cfg = NetConfig {
        host_netns: Some(topo.host_path()),
        uplink_if: "up0".into(),
        prefix: "asbxb".into(),
        tap_uid: Some(4242),
        tap_gid: Some(4243),
        // Only for the forwarder's configuration: the bench sends no query.
        dns_upstreams: vec![([198, 51, 100, 1], 53).into()],
        ..NetConfig::default()
    };
    let _sweep = SweepGuard(cfg.clone());
    let _ = Net::sweep(&cfg);

    // --- ours: netlink + nf_tables netlink, in-process.
    let t = Instant::now();
    let net = Net::new(cfg.clone()).expect("net init");
    println!(
        "host init (table + sysctl + blackhole): {:.3} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut up = Vec::with_capacity(n);
    let mut down = Vec::with_capacity(n);
    let mut pol = Vec::with_capacity(n);
    let mut sessions = Vec::with_capacity(n);
    let allow: EgressFilter = serde_json::from_str(
        r#"{"mode":"allowlist","rules":["198.51.100.0/24:443/tcp","203.0.113.0/24"]}"#,
    )
    .unwrap();
    for _ in 0..n {
        let t = Instant::now();
        let s = net
            .create_session(&EgressFilter::Internet)
            .expect("create session");
        up.push(t.elapsed());
        let t = Instant::now();
        s.set_policy(&allow).expect("set policy");
        pol.push(t.elapsed());
        sessions.push(s);
    }
    for mut s in sessions.drain(..) {
        let t = Instant::now();
        s.teardown().expect("teardown");
        down.push(t.elapsed());
    }
    let t = Instant::now();
    assert!(
        net.settle(Duration::from_secs(30)),
        "session links did not drain"
    );
    let drain = t.elapsed().as_secs_f64() * 1e3;
    // Churn: each setup runs while the kernel is still destroying the
    // namespaces of the sessions before it (the daemon's steady state).
    let mut cu = Vec::with_capacity(n);
    let mut cd = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut s = net
            .create_session(&EgressFilter::Internet)
            .expect("create session");
        cu.push(t.elapsed());
        let t = Instant::now();
        s.teardown().expect("teardown");
        cd.push(t.elapsed());
    }
    assert!(
        net.settle(Duration::from_secs(30)),
        "session links did not drain"
    );
    // Full policy: a DNS forwarder (its thread and sockets) and tbf on both
    // links at setup; then a live bandwidth change (two tbf replaced and
    // read back).
    let full: NetPolicy = serde_json::from_str(
        r#"{"mode":"allowlist","domains":["*.pypi.org","github.com"],
            "bandwidth":{"down_kbit":8000,"up_kbit":8000}}"#,
    )
    .unwrap();
    let faster: NetPolicy = serde_json::from_str(
        r#"{"mode":"allowlist","domains":["*.pypi.org","github.com"],
            "bandwidth":{"down_kbit":16000,"up_kbit":16000}}"#,
    )
    .unwrap();
    let mut fu = Vec::with_capacity(n);
    let mut fp = Vec::with_capacity(n);
    let mut fd = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut s = net.create_session(&full).expect("create session");
        fu.push(t.elapsed());
        let t = Instant::now();
        s.set_policy(&faster).expect("set policy");
        fp.push(t.elapsed());
        let t = Instant::now();
        s.teardown().expect("teardown");
        fd.push(t.elapsed());
    }
    assert!(
        net.settle(Duration::from_secs(30)),
        "session links did not drain"
    );
    net.close().unwrap();

    // --- the command-line way: the same steps with ip(8) and nft(8).
    let h = topo.host.as_str();
    let mut cup = Vec::with_capacity(n);
    let mut cdown = Vec::with_capacity(n);
    let mut cdown_async = Vec::with_capacity(n);
    {
        // The uplink network, as the daemon reads it from up0.
        let uplink: agent_sandbox::net::Cidr = "192.0.2.0/24".parse().unwrap();
        let host_table = firewall::host_table(&cfg, &[uplink]).to_nft_script();
        nft_in(h, &host_table);
        run(&[
            "ip",
            "netns",
            "exec",
            h,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ]);
    }
    for i in 0..n {
        let ns = format!("asbxb-cli{i:03}");
        let hif = format!("asbxbc{i:03}h");
        let pif = format!("asbxbc{i:03}n");
        let ha = format!("10.201.{}.{}/30", i / 64, (i % 64) * 4 + 1);
        let pa = format!("10.201.{}.{}/30", i / 64, (i % 64) * 4 + 2);
        let gw = ha.trim_end_matches("/30").to_string();
        let table =
            firewall::session_table(&cfg, &pif, &NetPolicy::default(), false).to_nft_script();
        let t = Instant::now();
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip",
            "netns",
            "exec",
            &ns,
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
            "net.ipv4.conf.all.rp_filter=1",
            "net.ipv4.conf.default.rp_filter=1",
            "net.ipv4.ip_forward=1",
        ]);
        nft_in(&ns, &table);
        run(&[
            "ip", "-n", &ns, "tuntap", "add", "dev", "tap0", "mode", "tap", "vnet_hdr", "user",
            "4242", "group", "4243",
        ]);
        run(&[
            "ip", "-n", h, "link", "add", &hif, "type", "veth", "peer", "name", &pif, "netns", &ns,
        ]);
        run(&[
            "ip",
            "netns",
            "exec",
            h,
            "sysctl",
            "-qw",
            &format!("net.ipv6.conf.{hif}.disable_ipv6=1"),
            &format!("net.ipv4.conf.{hif}.rp_filter=1"),
        ]);
        run(&["ip", "-n", h, "addr", "add", &ha, "dev", &hif]);
        run(&["ip", "-n", h, "link", "set", &hif, "up"]);
        run(&["ip", "-n", &ns, "addr", "add", &pa, "dev", &pif]);
        run(&["ip", "-n", &ns, "link", "set", &pif, "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "add",
            "172.16.0.1/30",
            "dev",
            "tap0",
        ]);
        run(&["ip", "-n", &ns, "link", "set", "tap0", "up"]);
        run(&["ip", "-n", &ns, "route", "add", "default", "via", &gw]);
        cup.push(t.elapsed());
    }
    for i in 0..n {
        let ns = format!("asbxb-cli{i:03}");
        let hif = format!("asbxbc{i:03}h");
        let t = Instant::now();
        if i % 2 == 0 {
            // The seed's way: delete the veth, then the namespace.
            run(&["ip", "-n", h, "link", "del", &hif]);
            run(&["ip", "netns", "del", &ns]);
            cdown.push(t.elapsed());
        } else {
            // Same semantics as ours: drop the namespace, the kernel does the rest.
            run(&["ip", "netns", "del", &ns]);
            cdown_async.push(t.elapsed());
        }
    }
    nft_in(h, "delete table ip asbxb\n");
    let left = sh(&["ip", "netns", "list"]);
    assert!(!left.contains("asbxb-"), "bench left namespaces: {left}");

    println!();
    let (up50, up99) = report("netlink setup", &mut up);
    let (dn50, dn99) = report("netlink teardown", &mut down);
    println!(
        "{:<34} all {n} host links gone {drain:.1} ms after the last teardown",
        "  (kernel, async)"
    );
    report("netlink live policy change", &mut pol);
    report("netlink setup, churn", &mut cu);
    report("netlink teardown, churn", &mut cd);
    report("setup, domains + bandwidth", &mut fu);
    report("live bandwidth change", &mut fp);
    report("teardown, domains + bandwidth", &mut fd);
    let (cup50, _) = report("ip+nft commands setup (13 cmds)", &mut cup);
    let (cdn50, _) = report("ip teardown link+netns (2 cmds)", &mut cdown);
    let (cdna50, _) = report("ip teardown netns del (1 cmd)", &mut cdown_async);
    println!();
    println!(
        "speedup p50: setup {:.1}x, teardown {:.1}x (vs link+netns) / {:.1}x (vs netns del)   targets: < 5 ms each ({}), >= 10x ({})",
        cup50 / up50,
        cdn50 / dn50,
        cdna50 / dn50,
        if up99 < 5.0 && dn99 < 5.0 { "met at p99" } else if up50 < 5.0 && dn50 < 5.0 { "met at p50" } else { "MISSED" },
        if cup50 / up50 >= 10.0 && cdn50 / dn50 >= 10.0 { "met" } else { "MISSED" },
    );
}
