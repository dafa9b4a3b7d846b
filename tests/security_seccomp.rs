//! seccomp filters and capability drops, observed from outside: every case
//! runs in a re-executed child of this program, so the test runner itself
//! is never restricted.
//!
//! Run: `cargo test --test security_seccomp` (as root for the capability
//! and namespace cases).

#[path = "common/harden.rs"]
mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::harden::{self, caps, seccomp, Mode, ThreadKind};
use common::{describe, is_root, run_case, Runner};
use std::sync::mpsc;

fn main() {
    if let Some(case) = common::case_arg() {
        env_logger::init();
        child(&case);
        std::process::exit(0);
    }
    let mut t = Runner::new();
    t.check("forbidden_syscall_is_named_and_stops_the_process", || {
        let o = run_case("trap");
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        expect(
            o.status.code() == Some(seccomp::SIGSYS_EXIT),
            &o,
            "exit status 159",
        )?;
        expect(out.contains("allowed getpid ok"), &o, "allowed syscall ran")?;
        expect(
            err.contains("forbidden syscall ptrace (101) on http thread"),
            &o,
            "SIGSYS line naming ptrace",
        )?;
        expect(
            !out.contains("after ptrace"),
            &o,
            "nothing ran after the trap",
        )
    });
    t.check("per_thread_filters_do_not_leak", || {
        let o = run_case("per_thread");
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        expect(
            out.contains("session unshare: ok"),
            &o,
            "session thread may unshare",
        )?;
        expect(
            out.contains("main personality: ok"),
            &o,
            "unfiltered main thread unaffected",
        )?;
        expect(
            o.status.code() == Some(seccomp::SIGSYS_EXIT),
            &o,
            "exit status 159",
        )?;
        expect(
            err.contains("forbidden syscall unshare (272) on http thread"),
            &o,
            "http thread stopped at unshare",
        )
    });
    t.check("log_mode_lets_the_syscall_run", || {
        let o = run_case("log_mode");
        let out = String::from_utf8_lossy(&o.stdout);
        expect(o.status.success(), &o, "exit 0")?;
        expect(out.contains("personality returned"), &o, "syscall ran")
    });
    if !is_root() {
        t.skip_rest("the apply() cases need root");
    }
    t.check("apply_reduces_caps_sets_nnp_and_seccomp", || {
        let o = run_case("apply_status");
        let out = String::from_utf8_lossy(&o.stdout);
        expect(o.status.success(), &o, "exit 0")?;
        let want = caps::mask(
            &caps::plan(caps::DAEMON)
                .into_iter()
                .map(|(c, _)| c)
                .collect::<Vec<_>>(),
        ) & common::own_permitted();
        let hex = format!("{want:016x}");
        for (field, val) in [
            ("CapInh", "0000000000000000"),
            ("CapPrm", hex.as_str()),
            ("CapEff", hex.as_str()),
            ("CapBnd", hex.as_str()),
            ("CapAmb", "0000000000000000"),
            ("NoNewPrivs", "1"),
            ("Seccomp", "2"),
        ] {
            let line = format!("{field}:\t{val}");
            expect(out.contains(&line), &o, &format!("status line {line:?}"))?;
        }
        expect(out.contains("core limit 0"), &o, "RLIMIT_CORE 0")?;
        expect(out.contains("dumpable 0"), &o, "not dumpable")
    });
    t.check("broker_threads_get_their_own_filter", || {
        let o = run_case("broker");
        let out = String::from_utf8_lossy(&o.stdout);
        let err = String::from_utf8_lossy(&o.stderr);
        expect(
            out.contains("session thread started by an http thread: unshare ok"),
            &o,
            "session thread not limited by its starter's filter",
        )?;
        expect(
            o.status.code() == Some(seccomp::SIGSYS_EXIT),
            &o,
            "exit status 159",
        )?;
        expect(
            err.contains("forbidden syscall unshare (272) on http thread"),
            &o,
            "http thread stopped",
        )
    });
    t.check("real_network_setup_fits_the_session_allowlist", || {
        // The real src/net code, under enforced filters: the daemon's main
        // thread (baseline) owns the Net, a session thread (Session kind)
        // creates, re-policies and tears down a session namespace.
        let topo = netns::Topology::new("hsec");
        let cfg = net_config(&topo.host_path());
        let _sweep = netns::SweepGuard(cfg);
        let o = std::process::Command::new(std::env::current_exe().expect("exe"))
            .args(["--case", "net"])
            .env("HSEC_HOST_NETNS", topo.host_path())
            .output()
            .map_err(|e| e.to_string())?;
        let out = String::from_utf8_lossy(&o.stdout);
        expect(o.status.success(), &o, "exit 0 (no forbidden syscall)")?;
        expect(
            out.contains("session net up and torn down"),
            &o,
            "session ran",
        )
    });
    t.check(
        "dns_allowlist_session_fits_the_session_dns_and_reaper_allowlists",
        || {
            // A domain-allowlist session under enforced filters: its DNS
            // forwarder thread (kind Dns) answers a guest's query by asking
            // an upstream (a test server in the test "internet" namespace) and
            // opening the answer in the session's nf_tables set; the net
            // reaper (kind NetReaper) tears down. The guest side and the
            // upstream run here, outside the filtered child.
            use std::io::{BufRead, BufReader, Write};
            let mut topo = netns::Topology::new("hdns");
            let mut cfg = net_config(&topo.host_path());
            cfg.prefix = "asbxhd".into();
            cfg.dns_upstreams = vec![(netns::INTERNET, 53).into()];
            let _sweep = netns::SweepGuard(cfg);
            let _dns = netns::DnsServer::start(
                &topo.internet,
                netns::INTERNET,
                &[("files.pypi.org", netns::Rr::A(netns::INTERNET, 300))],
            );
            let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
                .args(["--case", "net_dns"])
                .env("HSEC_HOST_NETNS", topo.host_path())
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| e.to_string())?;
            let mut lines = BufReader::new(child.stdout.take().ok_or("stdout")?).lines();
            let ns = lines
                .by_ref()
                .map_while(Result::ok)
                .find_map(|l| l.strip_prefix("SESSION ").map(str::to_string));
            let answer = ns.as_ref().and_then(|ns| {
                let g = netns::Guest::attach(&mut topo, ns, "tap0", 1);
                let gw: std::net::Ipv4Addr = netns::GUEST_GW.parse().ok()?;
                netns::dns_ask(&g.ns, gw, "files.pypi.org", 1, false)
            });
            if let Some(mut i) = child.stdin.take() {
                let _ = writeln!(i, "done");
            }
            let rest: Vec<String> = lines.map_while(Result::ok).collect();
            let o = child.wait_with_output().map_err(|e| e.to_string())?;
            let o = std::process::Output {
                stdout: rest.join("\n").into_bytes(),
                ..o
            };
            expect(ns.is_some(), &o, "a session namespace")?;
            expect(
                answer
                    .as_ref()
                    .is_some_and(|r| r.rcode == 0 && r.addrs == vec![netns::INTERNET]),
                &o,
                &format!("an answer through the forwarder, got {answer:?}"),
            )?;
            expect(o.status.success(), &o, "exit 0 (no forbidden syscall)")?;
            expect(
                rest.iter()
                    .any(|l| l.contains("dns session up and torn down")),
                &o,
                "session torn down",
            )
        },
    );
    t.check("baseline_stops_the_main_thread", || {
        let o = run_case("baseline");
        let err = String::from_utf8_lossy(&o.stderr);
        expect(
            o.status.code() == Some(seccomp::SIGSYS_EXIT),
            &o,
            "exit status 159",
        )?;
        expect(
            err.contains("forbidden syscall execve (59) on baseline thread"),
            &o,
            "execve named",
        )
    });
    t.finish();
}

fn expect(ok: bool, o: &std::process::Output, what: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected {what}\n{}", describe(o)))
    }
}

fn say(s: &str) {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}");
    let _ = o.flush();
}

fn unshare_net() -> String {
    // SAFETY: affects only the calling thread's network namespace.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    if r == 0 {
        "ok".into()
    } else {
        format!("error {}", std::io::Error::last_os_error())
    }
}

fn net_config(host: &std::path::Path) -> agent_sandbox::net::NetConfig {
    agent_sandbox::net::NetConfig {
        host_netns: Some(host.to_path_buf()),
        uplink_if: "up0".into(),
        prefix: "asbxhs".into(),
        tap_uid: Some(4242),
        tap_gid: Some(4243),
        ..agent_sandbox::net::NetConfig::default()
    }
}

fn child(case: &str) {
    match case {
        "net" => {
            use agent_sandbox::net::{EgressFilter, Net};
            let host = std::env::var("HSEC_HOST_NETNS").expect("HSEC_HOST_NETNS");
            let opts = harden::Options {
                needs: caps::DAEMON.to_vec(),
                seccomp: Mode::Enforce,
                nofile: None,
            };
            harden::apply(&opts).expect("apply");
            let net = std::sync::Arc::new(
                Net::new(net_config(std::path::Path::new(&host))).expect("Net::new"),
            );
            let n = net.clone();
            let h = harden::thread::spawn(
                ThreadKind::Session,
                std::thread::Builder::new().name("session-net".into()),
                move || -> Result<(), String> {
                    let mut s = n
                        .create_session(&EgressFilter::Internet)
                        .map_err(|e| e.to_string())?;
                    s.set_policy(&EgressFilter::None)
                        .map_err(|e| e.to_string())?;
                    s.teardown().map_err(|e| e.to_string())
                },
            )
            .expect("spawn");
            h.join().expect("join").expect("session net");
            net.settle(std::time::Duration::from_secs(10));
            net.close().expect("close");
            say("session net up and torn down");
        }
        "net_dns" => {
            use agent_sandbox::net::{Net, NetPolicy};
            use std::io::BufRead;
            let host = std::env::var("HSEC_HOST_NETNS").expect("HSEC_HOST_NETNS");
            let mut cfg = net_config(std::path::Path::new(&host));
            cfg.prefix = "asbxhd".into();
            cfg.dns_upstreams = vec![(std::net::Ipv4Addr::new(198, 51, 100, 1), 53).into()];
            // As `serve` keeps it when networking is configured: the
            // forwarder binds port 53 in the session namespace.
            let mut needs = caps::DAEMON.to_vec();
            needs.push(caps::Need::BindLowPort);
            let opts = harden::Options {
                needs,
                seccomp: Mode::Enforce,
                nofile: None,
            };
            harden::apply(&opts).expect("apply");
            let net = std::sync::Arc::new(Net::new(cfg).expect("Net::new"));
            let n = net.clone();
            let h = harden::thread::spawn(
                ThreadKind::Session,
                std::thread::Builder::new().name("session-dns".into()),
                move || -> Result<(), String> {
                    let policy: NetPolicy =
                        serde_json::from_str(r#"{"mode":"allowlist","domains":["*.pypi.org"]}"#)
                            .map_err(|e| e.to_string())?;
                    let mut s = n.create_session(policy).map_err(|e| e.to_string())?;
                    say(&format!("SESSION {}", s.netns()));
                    // The test drives a query through the forwarder now.
                    let mut line = String::new();
                    let _ = std::io::stdin().lock().read_line(&mut line);
                    s.teardown().map_err(|e| e.to_string())
                },
            )
            .expect("spawn");
            h.join().expect("join").expect("dns session");
            net.settle(std::time::Duration::from_secs(10));
            net.close().expect("close");
            say("dns session up and torn down");
        }
        "trap" => {
            let h = std::thread::spawn(|| {
                seccomp::install_current_with(ThreadKind::Http, Mode::Enforce).expect("install");
                // SAFETY: getpid has no preconditions.
                let pid = unsafe { libc::getpid() };
                say(&format!("allowed getpid ok ({pid})"));
                // SAFETY: a syscall the filter forbids; the process ends here.
                unsafe { libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) };
                say("after ptrace");
            });
            let _ = h.join();
        }
        "per_thread" => {
            let (http_ready_tx, http_ready) = mpsc::channel();
            let (go_tx, go) = mpsc::channel::<()>();
            let http = std::thread::spawn(move || {
                seccomp::install_current_with(ThreadKind::Http, Mode::Enforce).expect("install");
                http_ready_tx.send(()).expect("send");
                go.recv().expect("recv");
                unshare_net();
                say("http unshare returned");
            });
            http_ready.recv().expect("http ready");
            let session = std::thread::spawn(|| {
                seccomp::install_current_with(ThreadKind::Session, Mode::Enforce).expect("install");
                say(&format!("session unshare: {}", unshare_net()));
            });
            session.join().expect("session thread");
            // The main thread has no filter: a syscall no kind allows works.
            // SAFETY: personality(0xffffffff) only queries.
            unsafe { libc::personality(0xffff_ffff) };
            say("main personality: ok");
            go_tx.send(()).expect("go");
            let _ = http.join();
        }
        "log_mode" => {
            let h = std::thread::spawn(|| {
                seccomp::install_current_with(ThreadKind::Http, Mode::Log).expect("install");
                // SAFETY: personality(0xffffffff) only queries.
                let p = unsafe { libc::personality(0xffff_ffff) };
                say(&format!("personality returned {p}"));
            });
            h.join().expect("join");
        }
        "apply_status" => {
            let opts = harden::Options {
                needs: caps::DAEMON.to_vec(),
                seccomp: Mode::Enforce,
                nofile: None,
            };
            let rep = harden::apply(&opts).expect("apply");
            eprintln!("{rep:?}");
            let st = std::fs::read_to_string("/proc/self/status").expect("status");
            for l in st.lines() {
                if l.starts_with("Cap") || l.starts_with("NoNewPrivs") || l.starts_with("Seccomp") {
                    say(l);
                }
            }
            let mut lim = libc::rlimit {
                rlim_cur: 1,
                rlim_max: 1,
            };
            // SAFETY: getrlimit into a local struct.
            unsafe { libc::getrlimit(libc::RLIMIT_CORE, &mut lim) };
            say(&format!("core limit {}", lim.rlim_cur));
            // SAFETY: prctl query.
            let d = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
            say(&format!("dumpable {d}"));
        }
        "broker" => {
            let opts = harden::Options {
                needs: caps::DAEMON.to_vec(),
                seccomp: Mode::Enforce,
                nofile: None,
            };
            harden::apply(&opts).expect("apply");
            let http = harden::thread::spawn(
                ThreadKind::Http,
                std::thread::Builder::new().name("http-0".into()),
                || {
                    // Like an HTTP worker opening a session.
                    let s = harden::thread::spawn(
                        ThreadKind::Session,
                        std::thread::Builder::new().name("session-x".into()),
                        unshare_net,
                    )
                    .expect("spawn session");
                    let r = s.join().expect("join session");
                    say(&format!(
                        "session thread started by an http thread: unshare {r}"
                    ));
                    unshare_net();
                    say("http unshare returned");
                },
            )
            .expect("spawn http");
            let _ = http.join();
        }
        "baseline" => {
            let opts = harden::Options {
                needs: caps::DAEMON.to_vec(),
                seccomp: Mode::Enforce,
                nofile: None,
            };
            harden::apply(&opts).expect("apply");
            // (std::process::Command would be stopped one step earlier, at
            // clone without CLONE_THREAD.)
            // SAFETY: execv with valid C strings; the filter stops it.
            unsafe {
                let p = c"/bin/true".as_ptr();
                libc::execv(p, [p, std::ptr::null()].as_ptr());
            }
            say("after exec");
        }
        other => panic!("unknown case {other}"),
    }
}
