//! "Any exec key can take the host" (issue #17), through the real daemon:
//! session shapes bounded by the configured maxima and the host's capacity
//! (400 `invalid_shape`), per-key quotas on sessions, vCPUs and memory
//! (429 `quota_exceeded`, also under concurrent creates), and a cold-booted
//! QEMU guest whose RAM is a memfd, not a file on the host's disk.
//!
//! The shape and quota tests run on the local-process backend (they are
//! about the API); the RAM test needs QEMU and the guest images.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon, Http};
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn online_cpus() -> u32 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) as u32 }
}

fn mem_total_mib() -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    let kib: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("MemTotal");
    kib / 1024
}

/// An error answer with `status`, `code`, and a message containing every
/// one of `words`.
fn assert_error(r: &common::daemon::Resp, status: u16, code: &str, words: &[&str]) {
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.code(), code, "{}", r.text());
    let msg = r.message();
    for w in words {
        assert!(msg.contains(w), "{w:?} not in {msg:?}");
    }
}

/// Calls an MCP tool over `/mcp` (one handshake per call) and returns its
/// result object.
fn mcp_tool(h: &Http, key: &str, tool: &str, args: Value) -> Value {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let url = format!("{}/mcp", h.base);
    let post = |body: Value, sid: Option<&str>| {
        let mut rb = agent
            .post(&url)
            .header("Authorization", format!("Bearer {key}"))
            .header("Accept", "application/json")
            .content_type("application/json");
        if let Some(s) = sid {
            rb = rb
                .header("Mcp-Session-Id", s)
                .header("MCP-Protocol-Version", "2025-06-18");
        }
        rb.send(body.to_string()).expect("POST /mcp")
    };
    let init = post(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "security_quota", "version": "1"}}}),
        None,
    );
    assert_eq!(init.status(), 200);
    let sid = init
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .expect("Mcp-Session-Id")
        .to_string();
    post(
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        Some(&sid),
    );
    let mut r = post(
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
               "params": {"name": tool, "arguments": args}}),
        Some(&sid),
    );
    assert_eq!(r.status(), 200);
    let v: Value = serde_json::from_reader(r.body_mut().as_reader()).expect("JSON-RPC answer");
    v["result"].clone()
}

/// The text of an MCP tool error (`isError`), or panics.
fn mcp_error_text(result: &Value) -> String {
    assert_eq!(result["isError"], true, "{result}");
    result["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

fn session_ids(h: &Http) -> Vec<String> {
    let mut v: Vec<String> = h.get("/v1/sessions").json()["sessions"]
        .as_array()
        .expect("sessions")
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_string))
        .collect();
    v.sort();
    v
}

/// The request (64 vCPUs, 65536 MiB) and every other oversized
/// shape get 400 `invalid_shape` naming the field and the maximum, on REST
/// and MCP; bounds come from the config and, lower, from the host. No
/// session is made for them and the others keep answering.
#[test]
fn oversized_sessions_get_invalid_shape() {
    let cpus = online_cpus();
    let half = mem_total_mib() / 2;
    // Configured maxima above this host: the host's capacity bounds.
    let d = Daemon::start_local(&[
        "--max-vcpus",
        "64",
        "--max-mem-mib",
        "65536",
        "--max-disk-mib",
        "4096",
    ]);
    let h = d.http();
    assert_eq!(stdout_of(&h.exec("ok", "echo ok")), "ok\n");
    let r = h.post("/v1/sessions", &json!({"vcpus": 64, "memoryMib": 65536}));
    if cpus < 64 {
        let max = format!("maximum of {cpus} (this host's {cpus} online CPUs)");
        assert_error(&r, 400, "invalid_shape", &["vcpus 64", &max]);
    }
    if half < 65536 {
        let r = h.post("/v1/sessions", &json!({"memoryMib": 65536}));
        assert_error(
            &r,
            400,
            "invalid_shape",
            &["memoryMib 65536", &format!("maximum of {half}"), "RAM"],
        );
    }
    let r = h.post("/v1/sessions", &json!({"diskMib": 8192}));
    assert_error(
        &r,
        400,
        "invalid_shape",
        &["diskMib 8192", "maximum of 4096 (config max_disk_mib)"],
    );
    let res = mcp_tool(
        &h,
        &d.key,
        "create_session",
        json!({"sessionId": "mcp-big", "limits": {"vcpus": 64, "memoryMib": 65536}}),
    );
    if cpus < 64 {
        let t = mcp_error_text(&res);
        assert!(t.contains("vcpus 64 exceeds the maximum"), "{t}");
    }
    drop(d);

    // Configured maxima below the host: the config bounds.
    let d = Daemon::start_local(&["--max-vcpus", "1", "--max-mem-mib", "1024"]);
    let h = d.http();
    assert_eq!(stdout_of(&h.exec("ok", "echo ok")), "ok\n");
    for (body, words) in [
        (
            json!({"vcpus": 64, "memoryMib": 65536}),
            ["vcpus 64", "maximum of 1 (config max_vcpus)"],
        ),
        (
            json!({"vcpus": 2}),
            ["vcpus 2", "maximum of 1 (config max_vcpus)"],
        ),
        (
            json!({"memoryMib": 1025}),
            ["memoryMib 1025", "maximum of 1024 (config max_mem_mib)"],
        ),
        (json!({"vcpus": 0}), ["vcpus 0", "minimum of 1"]),
    ] {
        let r = h.post("/v1/sessions", &body);
        assert_error(&r, 400, "invalid_shape", &words);
    }
    let t = mcp_error_text(&mcp_tool(
        &h,
        &d.key,
        "create_session",
        json!({"limits": {"memoryMib": 2048}}),
    ));
    assert!(
        t.contains("memoryMib 2048 exceeds the maximum of 1024 (config max_mem_mib)"),
        "{t}"
    );
    let t = mcp_error_text(&mcp_tool(
        &h,
        &d.key,
        "create_session",
        json!({"limits": {"vcpus": 100000000000u64}}),
    ));
    assert!(
        t.contains("limits.vcpus 100000000000 is outside 1..=64"),
        "{t}"
    );
    // At the bound is fine; nothing was made for the refused requests.
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "edge", "vcpus": 1, "memoryMib": 1024}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(session_ids(&h), ["edge", "ok"]);
    assert_eq!(stdout_of(&h.exec("ok", "echo still")), "still\n");
    assert_eq!(h.anonymous().get("/health").status, 200);
}

/// Per-key quotas: sessions, vCPUs and memory summed over a key's live
/// sessions, 429 `quota_exceeded` naming the quota (REST create, the seed
/// routes' lazy create, MCP), independent per key, freed by a delete;
/// the key's other sessions keep answering.
#[test]
fn per_key_quotas_get_quota_exceeded() {
    let d = Daemon::start_local(&[
        "--max-sessions-per-key",
        "2",
        "--max-vcpus-per-key",
        "3",
        "--max-mem-mib-per-key",
        "1024",
    ]);
    let a = d.http();
    let r = a.post("/admin/keys", &json!({"name": "b", "scopes": ["exec"]}));
    assert_eq!(r.status, 201, "{}", r.text());
    let b = a.with_key(r.json()["key"].as_str().expect("key"));

    // Key A: two sessions, then every way to make a third is refused.
    assert_eq!(a.post("/v1/sessions", &json!({"id": "a1"})).status, 201);
    assert_eq!(stdout_of(&a.exec("a2", "echo a2")), "a2\n");
    let sessions_quota = ["holds 2 sessions", "max_sessions_per_key is 2"];
    let r = a.post("/v1/sessions", &json!({"id": "a3"}));
    assert_error(&r, 429, "quota_exceeded", &sessions_quota);
    // Not a retry-later condition: it frees only when the key ends one.
    assert!(r.header("retry-after").is_none());
    let r = a.post("/exec/a3/execute", &json!({"command": "true"}));
    assert_error(&r, 429, "quota_exceeded", &sessions_quota);
    let r = a.post("/exec/a3/write", &json!({"path": "x", "content": "y"}));
    assert_error(&r, 429, "quota_exceeded", &sessions_quota);
    let t = mcp_error_text(&mcp_tool(&a, &d.key, "create_session", json!({})));
    assert!(t.contains("max_sessions_per_key is 2"), "{t}");
    // Its live sessions still answer.
    assert_eq!(stdout_of(&a.exec("a1", "echo alive")), "alive\n");

    // Key B is not held to A's count; its own vCPU and memory sums are.
    let r = b.post("/v1/sessions", &json!({"id": "b1", "vcpus": 2}));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = b.post("/v1/sessions", &json!({"id": "b2", "vcpus": 2}));
    assert_error(
        &r,
        429,
        "quota_exceeded",
        &["holds 2 vCPUs", "max_vcpus_per_key is 3"],
    );
    // b1 counts 256 MiB (the default shape).
    let r = b.post("/v1/sessions", &json!({"id": "b2", "memoryMib": 1024}));
    assert_error(
        &r,
        429,
        "quota_exceeded",
        &["holds 256 MiB", "max_mem_mib_per_key is 1024"],
    );
    let r = b.post("/v1/sessions", &json!({"id": "b2", "memoryMib": 768}));
    assert_eq!(r.status, 201, "{}", r.text());

    // A delete frees the slot.
    assert_eq!(a.delete("/v1/sessions/a1").status, 200);
    assert_eq!(a.post("/v1/sessions", &json!({"id": "a3"})).status, 201);
    assert_eq!(stdout_of(&a.exec("a2", "echo a2")), "a2\n");
    assert_eq!(session_ids(&b), ["b1", "b2"]);
    assert_eq!(a.anonymous().get("/health").status, 200);
}

/// Eight creates of one key at once against a quota of three: exactly
/// three get a session, the rest 429, and three sessions exist.
#[test]
fn concurrent_creates_do_not_pass_the_last_slot() {
    let d = Daemon::start_local(&["--max-sessions-per-key", "3"]);
    let h = d.http();
    let n = 8;
    let start = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (h, start) = (h.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let r = h.post("/v1/sessions", &json!({"id": format!("c{i}")}));
                (r.status, r.code())
            })
        })
        .collect();
    let results: Vec<(u16, String)> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    let made = results.iter().filter(|(s, _)| *s == 201).count();
    let refused = results
        .iter()
        .filter(|(s, c)| *s == 429 && c == "quota_exceeded")
        .count();
    assert_eq!((made, refused), (3, n - 3), "{results:?}");
    assert_eq!(session_ids(&h).len(), 3);
}

/// Files under `dir` (recursively) with their allocated bytes.
fn allocated_files(dir: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if m.is_dir() {
            out.extend(allocated_files(&p));
        } else if m.is_file() {
            out.push((p.display().to_string(), m.blocks() * 512));
        }
    }
    out
}

/// The QEMU of the session whose guest has `mem_mib` MiB.
fn qemu_with_mem(d: &Daemon, mem_mib: u32) -> Option<(i32, Vec<String>)> {
    let want = format!("size={mem_mib}M,");
    d.sandbox_procs().into_iter().find_map(|pid| {
        let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        args.iter()
            .any(|a| a.contains(&want))
            .then_some((pid, args))
    })
}

/// Rss (KiB) of the mappings of `pid` whose path starts with `name`.
fn mapped_rss_kib(pid: i32, name: &str) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("read smaps");
    let mut rss = 0;
    let mut inside = false;
    for l in smaps.lines() {
        let header = l.split_whitespace().next().is_some_and(|f| {
            f.contains('-') && f.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        });
        if header {
            inside = l
                .split_whitespace()
                .nth(5)
                .is_some_and(|p| p.starts_with(name));
        } else if inside {
            if let Some(v) = l.strip_prefix("Rss:") {
                rss += v
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    rss
}

/// A session whose shape does not fit its template's snapshot cold-boots;
/// its guest fills 256 MiB of RAM (a tmpfs file). QEMU's RAM is the
/// daemon's memfd (command line, fd 5, mappings holding the guest's
/// pages); nothing RAM-sized is on disk in the state dir; a restored
/// session beside it keeps answering.
#[test]
fn cold_booted_guest_ram_is_a_memfd_not_a_disk_file() {
    if !common::daemon::vm_backend() || common::test_backend() != "qemu" {
        skip!("needs the QEMU backend and guest images");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip!("reading another uid's /proc/<pid>/smaps needs root");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    // The base snapshot is 512 MiB: 768 MiB does not fit, so it boots.
    let mem = 768;
    let r = h.post("/v1/sessions", &json!({"id": "big", "memoryMib": mem}));
    assert_eq!(r.status, 201, "{}\n{}", r.text(), d.log());
    let (pid, args) = qemu_with_mem(&d, mem).expect("the session's QEMU");
    eprintln!("cold-booted QEMU pid {pid}");
    let object = args
        .windows(2)
        .find(|w| w[0] == "-object" && w[1].starts_with("memory-backend"))
        .map(|w| w[1].clone())
        .expect("memory backend");
    assert!(
        object.contains("mem-path=/proc/self/fd/5,") && object.contains("share=on"),
        "{object}"
    );
    assert!(
        args.iter().all(|a| a != "-incoming"),
        "it was not cold-booted"
    );
    let fd5 = std::fs::read_link(format!("/proc/{pid}/fd/5")).expect("QEMU fd 5");
    assert!(
        fd5.to_string_lossy()
            .starts_with("/memfd:agent-sandbox-ram"),
        "{fd5:?}"
    );

    // Touch guest RAM: 256 MiB into a tmpfs file.
    let before = mapped_rss_kib(pid, "/memfd:agent-sandbox-ram");
    let v = h.exec(
        "big",
        "dd if=/dev/zero of=/dev/shm/fill bs=1M count=256 2>&1 | tail -n1; \
         du -m /dev/shm/fill | cut -f1",
    );
    let out = stdout_of(&v);
    assert!(out.trim_end().ends_with("256"), "{out}");
    let after = mapped_rss_kib(pid, "/memfd:agent-sandbox-ram");
    eprintln!("guest RAM resident in the memfd: {before} KiB before, {after} KiB after");
    assert!(
        after >= before + 200 * 1024,
        "the guest's pages are not in the memfd: {before} -> {after} KiB"
    );

    // Nothing RAM-sized on disk: the run dirs hold sockets and the console
    // log (well under 64 MiB each), and the state dir all told little.
    let files = allocated_files(&d.state_dir());
    let big: Vec<_> = files.iter().filter(|(_, b)| *b >= 64 << 20).collect();
    assert!(big.is_empty(), "RAM-sized files on disk: {big:?}");
    let total: u64 = files.iter().map(|(_, b)| b).sum();
    assert!(
        total < 128 << 20,
        "state dir holds {total} bytes: {files:?}"
    );

    // A session restored from the snapshot beside it keeps answering.
    assert_eq!(stdout_of(&h.exec("small", "echo small")), "small\n");
    assert_eq!(h.anonymous().get("/health").status, 200);
    // Deleting the session frees its RAM with its QEMU.
    assert_eq!(h.delete("/v1/sessions/big").status, 200);
    assert!(common::wait_until(Duration::from_secs(20), || {
        qemu_with_mem(&d, mem).is_none()
    }));
}
