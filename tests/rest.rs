//! REST API end to end: the real `agent-sandbox serve` binary, a real HTTP
//! client, real guest agents (as host processes by default; see
//! tests/common/daemon.rs to run through VMs).

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon, Http};
use common::wait_until;
use serde_json::json;
use std::io::BufRead;
use std::time::{Duration, Instant};

#[test]
fn seed_compatible_endpoints() {
    let d = Daemon::start(&[]);
    let h = d.http();

    let r = h.anonymous().get("/health");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "ok");
    assert_eq!(h.anonymous().get("/ready").status, 200);

    let t = h.get("/exec/templates");
    assert_eq!(t.status, 200);
    let tpl = t.json()["templates"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();

    // Lazy creation on first execute, shell string form.
    let v = h.exec("seed1", "echo hello; echo oops >&2; exit 3");
    assert_eq!(v["exitCode"], 3);
    assert_eq!(stdout_of(&v), "hello\n");
    let errs: Vec<_> = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["stream"] == "stderr")
        .collect();
    assert_eq!(errs[0]["data"], "oops\n");
    assert!(errs[0]["ts"].as_u64().unwrap() > 1_600_000_000_000);
    assert!(v["duration"].as_u64().is_some());

    // argv form (command + args), template, cwd, env, timeout.
    let r = h.post(
        "/exec/seed1/execute",
        &json!({"template": tpl, "command": "printf", "args": ["%s-%s", "$HOME", "b c"],
                "env": {"X": "1"}, "timeout": 5000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stdout_of(&r.json()), "$HOME-b c");
    let r = h.post(
        "/exec/seed1/execute",
        &json!({"command": "echo $X; pwd", "env": {"X": "42"}, "cwd": "/tmp"}),
    );
    assert_eq!(stdout_of(&r.json()), "42\n/tmp\n");

    // Timeout kills the command.
    let r = h.post(
        "/exec/seed1/execute",
        &json!({"command": "sleep 30", "timeout": 300}),
    );
    let v = r.json();
    assert_eq!(v["timedOut"], true, "{v}");
    assert_eq!(v["signal"], "SIGKILL");

    // NDJSON via ?format=ndjson and via Accept.
    let r = h.post(
        "/exec/seed1/execute?format=ndjson",
        &json!({"command": "echo a; echo b >&2"}),
    );
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().contains("ndjson"));
    let lines: Vec<serde_json::Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = lines.last().unwrap();
    assert_eq!(last["type"], "result");
    assert_eq!(last["exitCode"], 0);
    assert!(lines
        .iter()
        .any(|l| l["type"] == "stream" && l["stream"] == "stderr" && l["data"] == "b\n"));
    let (st, rd) = h.post_stream(
        "/exec/seed1/execute",
        &json!({"command": "echo x"}),
        "application/x-ndjson",
    );
    assert_eq!(st, 200);
    let all: Vec<String> = rd.lines().map(|l| l.unwrap()).collect();
    assert!(all.last().unwrap().contains("\"result\""));

    // Files: write, read, list.
    let r = h.post(
        "/exec/seed1/write",
        &json!({"path": "dir/hello.txt", "content": "héllo\n"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["bytesWritten"], "héllo\n".len());
    assert_eq!(r.json()["success"], true);
    let r = h.get("/exec/seed1/read?path=dir/hello.txt");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["content"], "héllo\n");
    let r = h.get("/exec/seed1/read?path=nope.txt");
    assert_eq!(r.status, 404);
    assert_eq!(r.code(), "file_not_found");
    let r = h.get("/exec/seed1/files?recursive=true");
    assert_eq!(r.status, 200);
    let files = r.json()["files"].as_array().unwrap().clone();
    assert!(files
        .iter()
        .any(|f| f["path"] == "dir/hello.txt" && f["type"] == "file"));
    let r = h.get("/exec/seed1/files");
    let top = r.json()["files"].as_array().unwrap().clone();
    assert!(top.iter().all(|f| f["path"] != "dir/hello.txt"));

    // Binary output as base64 on request.
    let r = h.post(
        "/exec/seed1/execute",
        &json!({"command": "printf '\\377\\000'", "encoding": "base64"}),
    );
    assert_eq!(r.json()["output"][0]["data"], "/wA=");

    // Listing and deletion.
    let r = h.get("/exec/");
    let ids: Vec<_> = r.json()["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, vec!["seed1"]);
    assert_eq!(h.get("/exec").status, 200);
    let before = d.session_procs().len();
    assert!(before >= 1);
    let r = h.delete("/exec/seed1");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["destroyed"], true, "{}", r.text());
    assert!(wait_until(Duration::from_secs(5), || d
        .session_procs()
        .is_empty()));
    // As the seed: gone already is 200 with destroyed false.
    let r = h.delete("/exec/seed1");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["destroyed"], false, "{}", r.text());
    assert!(h.get("/exec").json()["sessions"]
        .as_array()
        .unwrap()
        .is_empty());

    // Metrics (needs the metrics scope; the first key has it).
    let m = h.get("/metrics");
    assert_eq!(m.status, 200);
    let text = m.text();
    for name in [
        "agent_sandbox_sessions_active",
        "agent_sandbox_sessions_created_total",
        "agent_sandbox_exec_total",
        "agent_sandbox_sandbox_create_seconds",
        "agent_sandbox_agent_bytes_total",
    ] {
        assert!(text.contains(name), "{name} missing from metrics:\n{text}");
    }
    assert!(text.contains("outcome=\"timeout\""));
    assert_eq!(h.anonymous().get("/metrics").status, 401);
}

#[test]
fn v1_streaming_is_live_and_sse_works() {
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "live"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["state"], "ready");

    let t0 = Instant::now();
    let (st, mut rd) = h.post_stream(
        "/v1/sessions/live/exec",
        &json!({"command": "echo first; sleep 4; echo second"}),
        "application/x-ndjson",
    );
    assert_eq!(st, 200);
    let mut first_at = None;
    let mut result_at = None;
    let mut line = String::new();
    while rd.read_line(&mut line).unwrap() > 0 {
        let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
        if v["type"] == "stream" && first_at.is_none() {
            assert_eq!(v["data"], "first\n");
            first_at = Some(t0.elapsed());
        }
        if v["type"] == "result" {
            result_at = Some(t0.elapsed());
        }
        line.clear();
    }
    let (first, result) = (first_at.unwrap(), result_at.unwrap());
    // The first chunk arrived while the process was still sleeping (4 s;
    // buffered output would come with the result, ~0 s apart).
    assert!(
        result >= first + Duration::from_secs(2),
        "first chunk at {first:?}, result at {result:?}: output was not streamed live"
    );

    // SSE.
    let (st, rd) = h.post_stream(
        "/v1/sessions/live/exec",
        &json!({"argv": ["sh", "-c", "echo sse"]}),
        "text/event-stream",
    );
    assert_eq!(st, 200);
    let text: Vec<String> = rd.lines().map(|l| l.unwrap()).collect();
    assert!(text.iter().any(|l| l == "event: stream"), "{text:?}");
    assert!(text
        .iter()
        .any(|l| l.starts_with("data: ") && l.contains("\"sse\\n\"")));
    assert!(text.iter().any(|l| l == "event: result"));

    // stdin for a foreground command.
    let r = h.post(
        "/v1/sessions/live/exec",
        &json!({"argv": ["cat"], "stdin": "fed in"}),
    );
    assert_eq!(stdout_of(&r.json()), "fed in");
}

/// Process `proc` as `GET .../processes` lists it.
fn listed(h: &Http, session: &str, proc: u64) -> serde_json::Value {
    let procs = h.get(&format!("/v1/sessions/{session}/processes")).json();
    procs["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["procId"] == proc))
        .unwrap_or_else(|| panic!("process {proc} not listed: {procs}"))
        .clone()
}

#[test]
fn v1_sessions_processes_and_files() {
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post(
        "/v1/sessions",
        &json!({"id": "box", "env": {"GREETING": "hi"}, "ttl": 3600, "idleTimeout": "10m",
                "egress": {"mode": "none"}}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let info = r.json();
    assert_eq!(info["egress"]["mode"], "none");
    assert_eq!(info["idleTimeoutMs"], 600_000);
    assert_eq!(h.post("/v1/sessions", &json!({"id": "box"})).status, 409);
    let r = h.post("/v1/sessions", &json!({}));
    assert_eq!(r.status, 201);
    let auto = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(h.get(&format!("/v1/sessions/{auto}")).status, 200);
    assert_eq!(
        h.get("/v1/sessions").json()["sessions"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(h.post("/v1/sessions/box/keepalive", &json!({})).status, 200);
    assert_eq!(h.get("/v1/templates").status, 200);

    // Session env reaches commands.
    let r = h.post(
        "/v1/sessions/box/exec",
        &json!({"command": "echo $GREETING"}),
    );
    assert_eq!(stdout_of(&r.json()), "hi\n");

    // Background process with stdin, listing, attach, signal.
    let r = h.post(
        "/v1/sessions/box/exec",
        &json!({"argv": ["sh", "-c", "echo ready; read line; echo got:$line; sleep 60"],
                "background": true, "tag": "worker"}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let proc = r.json()["procId"].as_u64().unwrap();
    let r = h.post_raw(
        &format!("/v1/sessions/box/processes/{proc}/stdin"),
        b"abc\n",
        "application/octet-stream",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let p = listed(&h, "box", proc);
    assert_eq!(p["tag"], "worker");
    assert_eq!(p["running"], true);
    // One process: the same object as its list entry.
    let r = h.get(&format!("/v1/sessions/box/processes/{proc}"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), p);
    let r = h.get("/v1/sessions/box/processes/999");
    assert_eq!(
        (r.status, r.code().as_str()),
        (404, "process_not_found"),
        "{}",
        r.text()
    );
    let r = h.get("/v1/sessions/box/processes/0");
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "bad_request"),
        "{}",
        r.text()
    );
    let r = h.get(&format!("/v1/sessions/nobox/processes/{proc}"));
    assert_eq!(
        (r.status, r.code().as_str()),
        (404, "session_not_found"),
        "{}",
        r.text()
    );
    // Attach replays what it printed so far, then follows live.
    let h2 = h.clone();
    let reader = std::thread::spawn(move || {
        let r = h2.get(&format!("/v1/sessions/box/processes/{proc}/output"));
        (r.status, r.text())
    });
    std::thread::sleep(Duration::from_millis(700));
    let r = h.post(
        &format!("/v1/sessions/box/processes/{proc}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (st, text) = reader.join().unwrap();
    assert_eq!(st, 200);
    assert!(
        text.contains("ready\\n") && text.contains("got:abc\\n"),
        "{text}"
    );
    assert!(text.contains("\"signal\":\"SIGTERM\""), "{text}");
    assert_eq!(h.get("/v1/sessions/box/processes/999/output").status, 404);
    let r = h.post_raw("/v1/sessions/box/processes/999/stdin", b"x", "text/plain");
    assert_eq!(r.status, 404);
    assert_eq!(r.code(), "process_not_found");

    // Kill everything: a running command (answered as killed), a background
    // process and, in a VM, one left detached that no request tracks. Files
    // stay, and the session takes commands again.
    let vm = common::test_backend() != "local-process";
    let r = h.put_raw("/v1/sessions/box/files/content?path=keep.txt", b"kept");
    assert_eq!(r.status, 201, "{}", r.text());
    let r = h.post(
        "/v1/sessions/box/exec",
        &json!({"argv": ["sleep", "600"], "background": true}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let bg = r.json()["procId"].as_u64().unwrap();
    let sleeps = "grep -lx sleep /proc/[0-9]*/comm 2>/dev/null | wc -l";
    if vm {
        let r = h.post(
            "/v1/sessions/box/exec",
            &json!({"command": "setsid sleep 601 </dev/null >/dev/null 2>&1 &"}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let h3 = h.clone();
    let fg = std::thread::spawn(move || {
        h3.post("/v1/sessions/box/exec", &json!({"command": "sleep 602"}))
    });
    let want = if vm { 3 } else { 2 };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let running = if vm {
            let r = h.post("/v1/sessions/box/exec", &json!({"command": sleeps}));
            stdout_of(&r.json()).trim().parse::<usize>().unwrap_or(0)
        } else {
            h.get("/v1/sessions/box/processes").json()["processes"]
                .as_array()
                .map_or(0, |a| a.iter().filter(|p| p["running"] == true).count())
        };
        if running >= want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{running} of {want} sleeps started"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = h.delete("/v1/sessions/box/processes");
    assert_eq!(r.status, 200, "{}", r.text());
    let k = r.json();
    assert!(k["killed"].as_u64().unwrap() >= want as u64, "{k}");
    assert_eq!(k["remaining"], 0, "{k}");
    let r = fg.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["signal"], "SIGKILL", "{}", r.text());
    // Gone from the sandbox is not yet reaped and recorded: wait for that.
    let deadline = Instant::now() + Duration::from_secs(10);
    let p = loop {
        let p = listed(&h, "box", bg);
        if p["running"] == false || Instant::now() >= deadline {
            break p;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        (&p["running"], &p["signal"]),
        (&json!(false), &json!("SIGKILL")),
        "{p}"
    );
    if vm {
        let r = h.post("/v1/sessions/box/exec", &json!({"command": sleeps}));
        assert_eq!(
            stdout_of(&r.json()).trim(),
            "0",
            "sleeps left after kill-all"
        );
    }
    let r = h.get("/v1/sessions/box/files/content?path=keep.txt");
    assert_eq!(r.body, b"kept");

    // PTY.
    let r = h.post(
        "/v1/sessions/box/exec",
        &json!({"command": "test -t 1 && echo tty", "pty": {"rows": 24, "cols": 80}}),
    );
    assert!(stdout_of(&r.json()).contains("tty"), "{}", r.text());

    // Binary files: upload, download, stat, mkdir, rename, list, remove.
    let blob: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let r = h.put_raw(
        "/v1/sessions/box/files/content?path=data/blob.bin&mode=600",
        &blob,
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["bytes"], 300_000);
    let r = h.get("/v1/sessions/box/files/content?path=data/blob.bin");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert!(r.body == blob);
    let st = h
        .get("/v1/sessions/box/files/stat?path=data/blob.bin")
        .json();
    assert_eq!(st["size"], 300_000);
    assert_eq!(st["type"], "file");
    assert_eq!(st["mode"].as_u64().unwrap() & 0o777, 0o600);
    assert_eq!(
        h.post("/v1/sessions/box/files/mkdir", &json!({"path": "x/y/z"}))
            .status,
        200
    );
    assert_eq!(
        h.post(
            "/v1/sessions/box/files/rename",
            &json!({"from": "data/blob.bin", "to": "x/y/z/b.bin"})
        )
        .status,
        200
    );
    let l = h
        .get("/v1/sessions/box/files/list?path=x&recursive=true")
        .json();
    assert!(l["files"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["path"] == "y/z/b.bin"));
    let r = h.post("/v1/sessions/box/files/remove", &json!({"path": "x"}));
    assert_eq!(r.status, 409, "{}", r.text());
    let r = h.post(
        "/v1/sessions/box/files/remove",
        &json!({"path": "x", "recursive": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(h.get("/v1/sessions/box/files/stat?path=x").status, 404);

    assert_eq!(h.delete("/v1/sessions/box").status, 200);
    assert_eq!(h.get("/v1/sessions/box").status, 404);
    assert_eq!(
        h.post("/v1/sessions/box/exec", &json!({"command": "true"}))
            .status,
        404
    );
}

#[test]
fn keys_isolate_sessions_and_rate_limit() {
    let d = Daemon::start(&[]);
    let admin = d.http();
    let mk = |scopes: serde_json::Value, extra: serde_json::Value| {
        let mut body = json!({"name": "t", "scopes": scopes});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let r = admin.post("/admin/keys", &body);
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        (
            v["id"].as_str().unwrap().to_string(),
            v["key"].as_str().unwrap().to_string(),
        )
    };
    let (a_id, a_key) = mk(json!(["exec"]), json!({}));
    let (_, b_key) = mk(json!(["exec"]), json!({}));
    let a = admin.with_key(&a_key);
    let b = admin.with_key(&b_key);

    a.exec("mine", "echo a > owner.txt");
    // B cannot see, read, run in or delete A's session...
    assert!(b.get("/exec").json()["sessions"]
        .as_array()
        .unwrap()
        .is_empty());
    assert_eq!(b.get("/v1/sessions/mine").status, 404);
    let r = b.delete("/exec/mine");
    assert_eq!((r.status, &r.json()["destroyed"]), (200, &json!(false)));
    assert_eq!(b.get("/exec/mine/read?path=owner.txt").status, 404);
    // ...and the same id for B is a different session.
    let v = b.exec("mine", "cat owner.txt 2>/dev/null || echo none");
    assert_eq!(stdout_of(&v), "none\n");
    assert_eq!(
        a.get("/exec").json()["sessions"].as_array().unwrap().len(),
        1
    );
    // Admin sees all, with owners.
    let all = admin.get("/v1/sessions").json();
    assert_eq!(all["sessions"].as_array().unwrap().len(), 2);
    // Scopes: an exec key cannot administer keys or read metrics.
    assert_eq!(a.get("/admin/keys").status, 403);
    assert_eq!(a.get("/metrics").status, 403);
    // No or wrong key.
    assert_eq!(a.anonymous().get("/exec").status, 401);
    assert_eq!(a.with_key("asbx_kffffffffffff_00").get("/exec").status, 401);

    // Key listing never shows secrets; rotation and revocation.
    let keys = admin.get("/admin/keys").text();
    assert!(!keys.contains(&a_key) && !keys.contains("hash"));
    let r = admin.post(&format!("/admin/keys/{a_id}/rotate"), &json!({}));
    assert_eq!(r.status, 200);
    let a2 = admin.with_key(r.json()["key"].as_str().unwrap());
    assert_eq!(a.get("/exec").status, 401);
    assert_eq!(
        a2.get("/exec").json()["sessions"].as_array().unwrap().len(),
        1
    );
    assert_eq!(
        admin
            .post(&format!("/admin/keys/{a_id}/revoke"), &json!({}))
            .status,
        200
    );
    assert_eq!(a2.get("/exec").status, 401);
    assert_eq!(admin.delete(&format!("/admin/keys/{a_id}")).status, 200);
    assert_eq!(admin.delete(&format!("/admin/keys/{a_id}")).status, 404);

    // Rate limit: 1/s with a burst of 2.
    let (_, slow_key) = mk(json!(["exec"]), json!({"rate": 1.0, "burst": 2.0}));
    let slow = admin.with_key(&slow_key);
    let statuses: Vec<u16> = (0..4).map(|_| slow.get("/exec").status).collect();
    assert_eq!(&statuses[..2], &[200, 200]);
    let r = slow.get("/exec");
    assert_eq!(r.status, 429);
    assert_eq!(r.code(), "rate_limited");
    let ra: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&ra));
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(slow.get("/exec").status, 200);
}

#[test]
fn idle_sessions_are_reaped_and_capacity_is_enforced() {
    // The idle timeout leaves room for a snapshot restore under TCG on a
    // loaded machine between the first session's exec and the third's.
    let d = Daemon::start(&[
        "--idle-timeout",
        "4s",
        "--reap-interval",
        "100ms",
        "--max-sessions",
        "2",
    ]);
    let h = d.http();
    h.exec("one", "true");
    h.exec("two", "true");
    let r = h.post("/exec/three/execute", &json!({"command": "true"}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.code(), "at_capacity");
    assert!(r.header("retry-after").is_some());
    assert_eq!(d.session_procs().len(), 2);
    // A running command keeps its session alive past the idle timeout.
    let busy = h.post(
        "/exec/one/execute",
        &json!({"command": "sleep 5; echo done"}),
    );
    assert_eq!(stdout_of(&busy.json()), "done\n");
    assert!(wait_until(Duration::from_secs(15), || {
        h.get("/exec").json()["sessions"]
            .as_array()
            .unwrap()
            .is_empty()
    }));
    assert!(
        wait_until(Duration::from_secs(5), || d.session_procs().is_empty()),
        "sandboxes left after reaping: {:?}",
        d.session_procs()
    );
    let m = h.get("/metrics").text();
    assert!(m.contains("agent_sandbox_sessions_active 0"), "{m}");
    // Room again.
    h.exec("three", "true");
}

#[test]
fn bad_input_gets_clear_4xx() {
    let d = Daemon::start(&["--max-body", "1024"]);
    let h = d.http();
    let cases: Vec<(u16, &str, common::daemon::Resp)> = vec![
        (
            400,
            "bad_request",
            h.post_raw("/exec/s/execute", b"{not json", "application/json"),
        ),
        (
            400,
            "bad_request",
            h.post_raw("/exec/s/execute", b"[1,2]", "application/json"),
        ),
        (400, "bad_request", h.post("/exec/s/execute", &json!({}))),
        (
            400,
            "bad_request",
            h.post("/exec/s/execute", &json!({"command": ""})),
        ),
        (
            400,
            "bad_request",
            h.post("/exec/s/execute", &json!({"command": 5})),
        ),
        (
            400,
            "bad_request",
            h.post("/exec/s/execute", &json!({"command": "x", "timeout": -1})),
        ),
        (
            400,
            "bad_request",
            h.post("/exec/s/execute", &json!({"command": "x", "timeout": 0})),
        ),
        (
            400,
            "bad_request",
            h.post(
                "/exec/s/execute",
                &json!({"command": "x", "env": {"A=B": "1"}}),
            ),
        ),
        (
            413,
            "body_too_large",
            h.post_raw("/exec/s/execute", &vec![b' '; 4096], "application/json"),
        ),
        (
            400,
            "invalid_session_id",
            h.post("/exec/a.b/execute", &json!({"command": "true"})),
        ),
        (
            400,
            "invalid_session_id",
            h.post(
                &format!("/exec/{}/execute", "x".repeat(65)),
                &json!({"command": "true"}),
            ),
        ),
        (400, "invalid_session_id", h.get("/v1/sessions/%2e%2e")),
        (400, "bad_request", h.get("/exec/s/read?path=%zz")),
        (400, "bad_request", h.get("/exec/s/read")),
        (400, "invalid_path", h.get("/exec/s/read?path=a%00b")),
        (400, "invalid_path", h.get("/exec/s/read?path=")),
        (404, "route_not_found", h.get("/nope")),
        (404, "route_not_found", h.get("/exec/s/execute/more")),
        (405, "method_not_allowed", h.get("/exec/s/execute")),
        (
            400,
            "unknown_template",
            h.post(
                "/exec/s/execute",
                &json!({"command": "true", "template": "nope"}),
            ),
        ),
        (
            400,
            "invalid_shape",
            h.post("/v1/sessions", &json!({"vcpus": 0})),
        ),
        (
            400,
            "bad_request",
            h.post(
                "/v1/sessions",
                &json!({"egress": {"mode": "allowlist", "rules": ["nonsense"]}}),
            ),
        ),
        (
            400,
            "bad_request",
            h.post("/v1/sessions", &json!({"unknown": 1})),
        ),
        (
            400,
            "bad_request",
            h.post("/admin/keys", &json!({"scopes": ["root"]})),
        ),
        (404, "session_not_found", h.get("/v1/sessions/ghost")),
        (404, "session_not_found", h.get("/exec/ghost/files")),
        // Signals as MCP's kill_process reads them: a string is a name
        // ("9" refused), a name parses (then the session is looked up).
        (
            400,
            "bad_request",
            h.post(
                "/v1/sessions/ghost/processes/1/signal",
                &json!({"signal": "9"}),
            ),
        ),
        (
            400,
            "bad_request",
            h.post(
                "/v1/sessions/ghost/processes/1/signal",
                &json!({"signal": 65}),
            ),
        ),
        (
            404,
            "session_not_found",
            h.post(
                "/v1/sessions/ghost/processes/1/signal",
                &json!({"signal": "sigsegv"}),
            ),
        ),
    ];
    for (status, code, r) in cases {
        assert_eq!(
            r.status,
            status,
            "expected {status} {code}, got {}",
            r.text()
        );
        assert_eq!(r.code(), code, "{}", r.text());
    }
    // The seed routes answer errors in the seed's shape, the rest in v1's.
    assert!(h.get("/exec/s/read").json()["error"].is_string());
    assert!(h.get("/nope").json()["error"]["message"].is_string());
    assert!(h.get("/v1/sessions/ghost").json()["error"]["code"].is_string());
    // Still healthy, nothing leaked.
    assert_eq!(h.get("/health").status, 200);
    assert!(h.get("/exec").json()["sessions"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[test]
fn slow_commands_do_not_block_the_api_or_other_sessions() {
    // Few connections allowed: long commands and streams hold only their
    // own connection, never the API.
    let d = Daemon::start(&["--max-connections-per-ip", "8", "--max-streams", "6"]);
    let h = d.http();
    let busy = |h: &common::daemon::Http| {
        h.get("/exec").json()["sessions"]
            .as_array()
            .map_or(0, |a| a.iter().filter(|s| s["busy"] == true).count())
    };
    let mut slow = Vec::new();
    // Started one after another, as before.
    for i in 0..4 {
        let h2 = h.clone();
        slow.push(std::thread::spawn(move || {
            if i % 2 == 0 {
                h2.post(
                    &format!("/exec/slow{i}/execute"),
                    &json!({"command": "sleep 15"}),
                )
                .status
            } else {
                h2.post(
                    &format!("/exec/slow{i}/execute?format=ndjson"),
                    &json!({"command": "sleep 15"}),
                )
                .status
            }
        }));
        assert!(
            wait_until(Duration::from_secs(20), || busy(&h) > i),
            "{}",
            d.log()
        );
    }
    // Four long requests run on two HTTP workers...
    assert_eq!(busy(&h), 4);
    let t0 = Instant::now();
    assert_eq!(h.get("/health").status, 200);
    let v = h.exec("fast", "echo quick");
    assert_eq!(stdout_of(&v), "quick\n");
    eprintln!("fast session beside four long ones: {:?}", t0.elapsed());
    // Answered while all four still run (a new session restores from a
    // snapshot; under TCG on a loaded machine that alone can take a second
    // or two, far below the sleeps' 15 s): not queued behind them.
    assert_eq!(busy(&h), 4, "the fast session waited for the slow ones");
    // Beyond --max-streams long requests: a clear 503, not a hang.
    let extra: Vec<_> = (0..4)
        .map(|i| {
            let h = h.clone();
            std::thread::spawn(move || {
                h.post(
                    &format!("/exec/x{i}/execute"),
                    &json!({"command": "sleep 1"}),
                )
                .status
            })
        })
        .collect();
    let statuses: Vec<u16> = extra.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(statuses.contains(&503), "{statuses:?}");
    for t in slow {
        assert_eq!(t.join().unwrap(), 200);
    }
}

/// An allowlist rule whose every address is always blocked (here: RFC 1918
/// space and the metadata address) can never match: REST (create and PUT
/// network) answers 400 naming the rule, the MCP `create_session` tool an
/// error naming it, and nothing is created. A rule that is only partly
/// blocked (`0.0.0.0/0:443`) is still accepted.
#[test]
fn always_blocked_allowlist_rules_are_refused_naming_the_rule() {
    let d = Daemon::start(&[]);
    let h = d.http();
    // Canonical forms: the error names the rule as the API shows it.
    for rule in ["10.1.2.0/24:443/tcp", "169.254.169.254/32"] {
        let body = json!({"mode": "allowlist", "rules": ["198.51.100.0/24", rule]});
        let r = h.post("/v1/sessions", &json!({"id": "blk", "egress": body}));
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.code(), "bad_request", "{}", r.text());
        assert!(r.text().contains(rule), "rule not named: {}", r.text());
        let r = h.put("/v1/sessions/blk/network", &body);
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(r.text().contains(rule), "rule not named: {}", r.text());

        // MCP, stateless 2026-07-28 over the daemon's /mcp.
        let (_, _, m) = common::daemon::mcp_call(
            &d,
            &d.key,
            "create_session",
            json!({"sessionId": "blk", "egress": body}),
        );
        assert_eq!(m["result"]["isError"], true, "{m}");
        let msg = m["result"]["content"][0]["text"].as_str().unwrap_or("");
        assert!(msg.contains(rule) && msg.contains("always-blocked"), "{m}");
    }
    assert_eq!(h.get("/v1/sessions/blk").status, 404, "nothing was created");
    // Partly public: accepted (the request gets past validation).
    let ok = json!({"mode": "allowlist", "rules": ["0.0.0.0/0:443/tcp"]});
    let r = h.put("/v1/sessions/ghost/network", &ok);
    assert_eq!(r.status, 404, "{}", r.text());
}
