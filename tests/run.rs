//! The guide's execution contract through the real daemon: every finished
//! command's `durationMs`, `timedOut` and `resourceUsage` (measured for
//! that command alone), and `POST /v1/run` / MCP `run_code` (a fresh
//! sandbox per call, limits enforced, destroyed after). The VM tests boot
//! QEMU guests; the validation test needs no VM.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, stdout_of, vm_backend, Daemon, Http};
use common::wait_until;
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::{Duration, Instant};

/// A python program that holds 200 MiB of written (not lazily mapped)
/// bytes: `b'\x01' * n` fills every page.
const ALLOC_200: &str = "x = b'\\x01' * (200 << 20); print(len(x))";
/// Busy for 1.5 s of wall time.
const BUSY: &str = "import time\nt = time.time()\nwhile time.time() - t < 1.5:\n    pass\n";

fn usage(v: &Value) -> (f64, f64) {
    let u = &v["resourceUsage"];
    assert!(u.is_object(), "no resourceUsage in {v}");
    (
        u["memoryMb"].as_f64().expect("memoryMb"),
        u["cpuPercent"].as_f64().expect("cpuPercent"),
    )
}

/// The `result` line of an NDJSON or SSE exec stream.
fn stream_result(h: &Http, path: &str, body: &Value, accept: &str) -> Value {
    let (status, r) = h.post_stream(path, body, accept);
    assert_eq!(status, 200, "{path}");
    for line in r.lines() {
        let line = line.expect("read stream");
        let data = line.strip_prefix("data: ").unwrap_or(&line);
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            if v["type"] == "result" {
                return v;
            }
        }
    }
    panic!("{path}: stream ended without a result line");
}

fn run(h: &Http, body: Value) -> Value {
    let t = Instant::now();
    let r = h.post("/v1/run", &body);
    assert_eq!(r.status, 200, "POST /v1/run {body}: {}", r.text());
    let v = r.json();
    eprintln!(
        "run {} in {:?}: exit {} timedOut {} usage {}",
        body["language"],
        t.elapsed(),
        v["exitCode"],
        v["timedOut"],
        v["resourceUsage"]
    );
    v
}

/// No session or sandbox left of a run once it answered.
fn assert_gone(d: &Daemon, v: &Value) {
    let id = v["sandboxId"].as_str().expect("sandboxId");
    assert!(id.starts_with("run-"), "{v}");
    let r = d.http().get(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 404, "run session {id} still there: {}", r.text());
    assert!(
        wait_until(Duration::from_secs(30), || d.session_procs().is_empty()),
        "sandbox processes left after the runs: {:?}",
        d.session_procs()
    );
}

#[test]
fn every_exec_result_reports_its_own_resource_usage() {
    if !vm_backend() {
        skip!("needs the QEMU backend (guest images)");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "ru", "template": "python"}));
    assert_eq!(r.status, 201, "{}", r.text());

    // Seed route, buffered JSON: 200 MiB held is more than 200 MiB peak.
    let r = h.post(
        "/exec/ru/execute",
        &json!({"command": "python3", "args": ["-c", ALLOC_200]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let big = r.json();
    assert_eq!(stdout_of(&big), format!("{}\n", 200 << 20), "{big}");
    let (mem, _) = usage(&big);
    eprintln!("FIGURE exec_200mib_alloc memoryMb={mem}");
    assert!(mem > 200.0, "200 MiB allocation reported {mem} MiB: {big}");
    assert_eq!(big["timedOut"], false);
    assert_eq!(big["oomKilled"], false);
    assert_eq!(big["resourceUsage"]["source"], "cgroup");
    assert!(big["durationMs"].as_u64().is_some(), "{big}");

    // The next command is measured alone: a small one stays small.
    let small = h.exec("ru", "true");
    let (mem, _) = usage(&small);
    assert!(mem < 50.0, "`true` after a 200 MiB exec reported {mem} MiB");

    // v1 NDJSON: a busy loop uses about one core.
    let busy = stream_result(
        &h,
        "/v1/sessions/ru/exec",
        &json!({"command": "python3", "args": ["-c", BUSY]}),
        "application/x-ndjson",
    );
    let (_, cpu) = usage(&busy);
    eprintln!("FIGURE exec_busy_loop cpuPercent={cpu}");
    assert!(cpu > 60.0, "busy loop reported {cpu}% CPU: {busy}");
    assert!(
        busy["durationMs"].as_u64().is_some_and(|ms| ms >= 1500),
        "{busy}"
    );

    // v1 SSE: a sleep uses next to none.
    let idle = stream_result(
        &h,
        "/v1/sessions/ru/exec",
        &json!({"command": "sleep 2"}),
        "text/event-stream",
    );
    let (_, cpu) = usage(&idle);
    eprintln!("FIGURE exec_sleep cpuPercent={cpu}");
    assert!(cpu < 30.0, "sleep reported {cpu}% CPU: {idle}");
    assert!(
        idle["durationMs"].as_u64().is_some_and(|ms| ms >= 2000),
        "{idle}"
    );

    // v1 buffered JSON, and the seed route's NDJSON result line.
    let r = h.post(
        "/v1/sessions/ru/exec",
        &json!({"command": "python3", "args": ["-c", ALLOC_200]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(usage(&r.json()).0 > 200.0, "{}", r.text());
    let seed = stream_result(
        &h,
        "/exec/ru/execute",
        &json!({"command": "python3", "args": ["-c", ALLOC_200]}),
        "application/x-ndjson",
    );
    assert!(usage(&seed).0 > 200.0, "{seed}");

    // MCP execute.
    let (status, _, m) = mcp_call(
        &d,
        &d.key,
        "execute",
        json!({"sessionId": "ru", "command": "python3", "args": ["-c", ALLOC_200]}),
    );
    assert_eq!(status, 200, "{m}");
    let sc = &m["result"]["structuredContent"];
    assert!(usage(sc).0 > 200.0, "{m}");
    assert!(sc["durationMs"].as_u64().is_some(), "{m}");
}

#[test]
fn run_executes_each_language_under_its_limits_and_leaves_nothing() {
    if !vm_backend() {
        skip!("needs the QEMU backend (guest images)");
    }
    let d = Daemon::start(&[]);
    let h = d.http();

    // Each language prints and exits with its code.
    for (lang, code) in [
        ("python", "import sys\nprint('py says hi')\nsys.exit(3)\n"),
        ("node", "console.log('node says hi'); process.exit(4);"),
        ("bash", "echo bash says hi; echo oops >&2; exit 5"),
    ] {
        let v = run(&h, json!({"language": lang, "code": code}));
        let want_code = match lang {
            "python" => 3,
            "node" => 4,
            _ => 5,
        };
        assert_eq!(v["exitCode"], want_code, "{lang}: {v}");
        let name = if lang == "python" { "py" } else { lang };
        assert_eq!(v["stdout"], format!("{name} says hi\n"), "{lang}: {v}");
        assert_eq!(v["timedOut"], false, "{lang}: {v}");
        assert_eq!(v["language"], lang);
        assert!(v["durationMs"].as_u64().is_some(), "{v}");
        usage(&v);
        if lang == "bash" {
            assert_eq!(v["stderr"], "oops\n", "{v}");
        }
        assert_gone(&d, &v);
    }

    // A 300 ms sleep with a 100 ms timeout is killed at its timeout.
    let v = run(
        &h,
        json!({"language": "bash", "code": "sleep 0.3; echo done", "limits": {"timeoutMs": 100}}),
    );
    assert_eq!(v["timedOut"], true, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    assert_eq!(v["signal"], "SIGKILL", "{v}");

    // 1 GiB with a 256 MiB limit: OOM-killed, and said so. In 16 MiB
    // pieces: one 1 GiB malloc is refused outright by the guest kernel's
    // overcommit heuristic (more than its RAM), a MemoryError, not an OOM.
    let v = run(
        &h,
        json!({"language": "python",
               "code": "x = [b'\\x01' * (16 << 20) for _ in range(64)]\nprint('survived')",
               "limits": {"maxMemoryMb": 256}}),
    );
    assert_eq!(v["oomKilled"], true, "{v}");
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    assert_eq!(v["exitCode"], 137, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    let (mem, _) = usage(&v);
    assert!(
        mem <= 256.5,
        "the program got past its 256 MiB limit: {mem} MiB"
    );
    eprintln!("FIGURE run_oom_peak memoryMb={mem}");

    // cpuCores 0.25: a busy loop gets about a quarter of a core.
    let v = run(
        &h,
        json!({"language": "python", "code": BUSY, "limits": {"cpuCores": 0.25}}),
    );
    let (_, cpu) = usage(&v);
    eprintln!("FIGURE run_busy_quarter_core cpuPercent={cpu}");
    assert!(cpu < 40.0, "cpuCores 0.25 let a busy loop use {cpu}%");
    assert_gone(&d, &v);

    // The same through MCP run_code.
    let (status, _, m) = mcp_call(
        &d,
        &d.key,
        "run_code",
        json!({"language": "bash", "code": "echo via mcp; exit 7"}),
    );
    assert_eq!(status, 200, "{m}");
    let sc = &m["result"]["structuredContent"];
    assert_eq!(m["result"]["isError"], false, "{m}");
    assert_eq!(sc["exitCode"], 7, "{m}");
    assert_eq!(sc["stdout"], "via mcp\n", "{m}");
    usage(sc);
    assert_gone(&d, sc);
}

/// Bad input is a 400 naming the field, before any sandbox is made (no
/// VM needed: the local-process backend).
#[test]
fn run_rejects_bad_input_naming_the_field() {
    let d = Daemon::start_local(&["--max-body", "4096"]);
    let h = d.http();
    let long = "x".repeat(5000);
    for (body, field) in [
        (json!({"language": "ruby", "code": "p 1"}), "language"),
        (json!({"code": "echo"}), "language"),
        (json!({"language": "bash"}), "code"),
        (json!({"language": "bash", "code": 5}), "code"),
        (json!({"language": "bash", "code": long}), "code"),
        (
            json!({"language": "bash", "code": "", "limits": {"timeoutMs": 0}}),
            "limits.timeoutMs",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"maxMemoryMb": 1}}),
            "limits.maxMemoryMb",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"maxMemoryMb": 1e9}}),
            "limits.maxMemoryMb",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"cpuCores": 0}}),
            "limits.cpuCores",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"cpuCores": 1000}}),
            "limits.cpuCores",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"allowNetwork": "yes"}}),
            "limits.allowNetwork",
        ),
        (
            json!({"language": "bash", "code": "", "limits": {"memory": 5}}),
            "limits.memory",
        ),
        (
            json!({"language": "bash", "code": "", "limits": []}),
            "limits",
        ),
        (json!({"language": "bash", "code": "", "extra": 1}), "extra"),
    ] {
        let r = h.post("/v1/run", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let m = r.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(m.starts_with(&format!("{field}:")), "{body}: {m}");
        if body.to_string().len() > 4000 {
            // Over /mcp's own body limit (the same max_body): a 413 there.
            continue;
        }
        let (_, _, mcp) = mcp_call(&d, &d.key, "run_code", body.clone());
        assert_eq!(mcp["result"]["isError"], true, "{body}: {mcp}");
        let text = mcp["result"]["content"][0]["text"].as_str().unwrap_or("");
        assert!(text.contains(&format!("{field}:")), "{body}: {mcp}");
    }
    assert!(d.sandbox_procs().is_empty(), "a bad request made a sandbox");
}

/// Without per-exec cgroups (the local-process backend) the result still
/// carries what the reaped process's rusage honestly gives.
#[test]
fn local_backend_reports_rusage() {
    let d = Daemon::start_local(&[]);
    let h = d.http();
    // `tail` keeps the last 10 lines; /dev/zero has no newline, so it
    // holds all 200 MiB.
    let v = h.exec("lr", "head -c 200M /dev/zero | tail | wc -c");
    assert_eq!(stdout_of(&v).trim(), (200u64 << 20).to_string(), "{v}");
    let (mem, _) = usage(&v);
    assert_eq!(v["resourceUsage"]["source"], "rusage", "{v}");
    assert!(mem > 200.0, "200 MiB in tail reported {mem} MiB: {v}");
    let v = h.exec("lr", "sleep 0.5");
    let (_, cpu) = usage(&v);
    assert!(cpu < 20.0, "sleep reported {cpu}% CPU: {v}");
}
