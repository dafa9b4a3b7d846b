//! Daemon features no other test reached through the real `serve` binary:
//! session lifetime expiry, sessions ending with their key, the metrics
//! and admin scopes, `/mcp` scope and rate limits, `reset_session`, PTY
//! resize and the warm pool really handing out its sandbox. Each test
//! asserts the behaviour, so it fails when the feature breaks.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, stdout_of, Daemon, Http};
use common::wait_until;
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::Duration;

/// Creates a key through the admin API: (id, token).
fn make_key(admin: &Http, scopes: Value, extra: Value) -> (String, String) {
    let mut body = json!({"name": "t", "scopes": scopes});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let r = admin.post("/admin/keys", &body);
    assert_eq!(r.status, 201, "create key: {}", r.text());
    let v = r.json();
    (
        v["id"].as_str().unwrap_or_default().to_string(),
        v["key"].as_str().unwrap_or_default().to_string(),
    )
}

fn alive(pid: i32) -> bool {
    common::procs_with("").contains(&pid)
}

#[test]
fn sessions_end_at_max_lifetime() {
    // An idle timeout far off: the session must end by its lifetime.
    let d = Daemon::start_local(&[
        "--max-lifetime",
        "3s",
        "--reap-interval",
        "1s",
        "--idle-timeout",
        "1h",
    ]);
    let h = d.http();
    assert_eq!(stdout_of(&h.exec("old", "echo hi")), "hi\n");
    let procs = d.sandbox_procs();
    assert!(!procs.is_empty(), "no sandbox process for the session");
    let gone = wait_until(Duration::from_secs(60), || {
        let r = h.get("/v1/sessions/old");
        r.status == 404
    });
    assert!(gone, "session outlived --max-lifetime 3s:\n{}", d.log());
    assert!(
        wait_until(Duration::from_secs(20), || procs.iter().all(|p| !alive(*p))),
        "the expired session's sandbox processes {procs:?} are still running"
    );
    // The id is free again: a new session, a new sandbox.
    assert_eq!(stdout_of(&h.exec("old", "echo again")), "again\n");
}

#[test]
fn revoking_a_key_ends_its_sessions() {
    let d = Daemon::start_local(&[]);
    let admin = d.http();
    let (id, key) = make_key(&admin, json!(["exec"]), json!({}));
    let (_, other) = make_key(&admin, json!(["exec"]), json!({}));
    let k = admin.with_key(&key);
    let o = admin.with_key(&other);
    k.exec("mine", "echo x > f");
    o.exec("theirs", "echo y > f");
    let mine = of_owner(&admin, &id);
    assert_eq!(mine.len(), 1, "{mine:?}");
    let before = d.sandbox_procs();
    assert_eq!(before.len(), 2, "{before:?}");

    let r = admin.post(&format!("/admin/keys/{id}/revoke"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(k.get("/v1/sessions/mine").status, 401);
    // Its session is gone (admin sees all sessions) and so is its sandbox;
    // the other key's session is untouched.
    assert!(of_owner(&admin, &id).is_empty());
    assert!(
        wait_until(Duration::from_secs(20), || d.sandbox_procs().len() == 1),
        "revoked key's sandbox still running: {:?}",
        d.sandbox_procs()
    );
    assert_eq!(
        stdout_of(&o.exec("theirs", "cat f")),
        "y\n",
        "the other key's session was harmed"
    );
}

/// Sessions the admin listing shows as owned by key `id`.
fn of_owner(admin: &Http, id: &str) -> Vec<Value> {
    let all = admin.get("/v1/sessions").json();
    all["sessions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s["owner"] == id)
        .collect()
}

#[test]
fn metrics_only_and_admin_only_keys() {
    let d = Daemon::start_local(&[]);
    let admin = d.http();
    let (_, m) = make_key(&admin, json!(["metrics"]), json!({}));
    let m = admin.with_key(&m);
    let r = m.get("/metrics");
    assert_eq!(r.status, 200);
    assert!(r.text().contains("agent_sandbox_"), "{}", r.text());
    assert_eq!(m.get("/v1/sessions").status, 403);
    let r = m.post("/v1/sessions/x/exec", &json!({"command": "true"}));
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(m.get("/admin/keys").status, 403);
    assert_eq!(
        m.post("/admin/keys", &json!({"scopes": ["exec"]})).status,
        403
    );

    let (_, a) = make_key(&admin, json!(["admin"]), json!({}));
    let a = admin.with_key(&a);
    // Manages keys: creates one that works, lists it, revokes it.
    let (new_id, new_key) = make_key(&a, json!(["exec"]), json!({}));
    let e = admin.with_key(&new_key);
    assert_eq!(e.get("/v1/sessions").status, 200);
    assert!(a.get("/admin/keys").text().contains(&new_id));
    assert_eq!(
        a.post(&format!("/admin/keys/{new_id}/revoke"), &json!({}))
            .status,
        200
    );
    assert_eq!(e.get("/v1/sessions").status, 401);
    // Admin implies every scope (the route check in src/api/mod.rs).
    assert_eq!(a.get("/metrics").status, 200);
}

#[test]
fn mcp_needs_exec_and_is_rate_limited() {
    let d = Daemon::start_local(&[]);
    let admin = d.http();
    let (_, m) = make_key(&admin, json!(["metrics"]), json!({}));
    let (status, _, v) = mcp_call(&d, &m, "list_sessions", json!({}));
    assert_eq!(status, 403, "{v}");
    assert!(v.to_string().contains("exec"), "{v}");

    // An exec key with a burst of 2 at 1 request/s.
    let (_, slow) = make_key(&admin, json!(["exec"]), json!({"rate": 1.0, "burst": 2.0}));
    let statuses: Vec<u16> = (0..2)
        .map(|_| mcp_call(&d, &slow, "list_sessions", json!({})).0)
        .collect();
    assert_eq!(statuses, [200, 200]);
    let (status, retry, v) = mcp_call(&d, &slow, "list_sessions", json!({}));
    assert_eq!(status, 429, "{v}");
    let retry: u64 = retry
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("429 without a numeric Retry-After: {v}"));
    assert!((1..=2).contains(&retry), "Retry-After {retry}");
    std::thread::sleep(Duration::from_millis(1100 * retry));
    assert_eq!(mcp_call(&d, &slow, "list_sessions", json!({})).0, 200);
}

#[test]
fn mcp_reset_session_gives_a_fresh_sandbox() {
    let d = Daemon::start_local(&[]);
    let h = d.http();
    h.exec("rs", "echo here > marker && sleep 1000 >/dev/null 2>&1 &");
    assert_eq!(stdout_of(&h.exec("rs", "cat marker")), "here\n");
    let before = d.sandbox_procs();
    assert!(!before.is_empty());

    let (status, _, v) = mcp_call(&d, &d.key, "reset_session", json!({"sessionId": "rs"}));
    assert_eq!(status, 200, "{v}");
    assert_ne!(v["result"]["isError"], true, "{v}");
    assert_eq!(
        v["result"]["structuredContent"]["sessionId"], "rs",
        "reset answered another session: {v}"
    );
    // Same id, nothing of the old sandbox: its files and processes.
    assert_eq!(h.get("/v1/sessions/rs").status, 200);
    let out = stdout_of(&h.exec("rs", "cat marker 2>/dev/null || echo gone"));
    assert_eq!(out, "gone\n", "the marker survived the reset");
    assert!(
        wait_until(Duration::from_secs(20), || before
            .iter()
            .all(|p| !alive(*p))),
        "old sandbox processes {before:?} outlived the reset"
    );
}

#[test]
fn pty_resize_reaches_the_terminal() {
    let d = Daemon::start_local(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "tty"}));
    assert_eq!(r.status, 201, "{}", r.text());
    // Waits for a line on stdin, so the size is read after the resize.
    let r = h.post(
        "/v1/sessions/tty/exec",
        &json!({"command": "read x; stty size", "background": true,
                "pty": {"rows": 24, "cols": 80}}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let proc = r.json()["procId"].as_u64().expect("procId");
    let base = format!("/v1/sessions/tty/processes/{proc}");
    let r = h.post(&format!("{base}/resize"), &json!({"rows": 41, "cols": 117}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = h.post_raw(
        &format!("{base}/stdin"),
        b"go\n",
        "application/octet-stream",
    );
    assert!(r.status < 300, "{}", r.text());
    let (status, body) = h.get_stream(&format!("{base}/output"));
    assert_eq!(status, 200);
    let mut out = String::new();
    for line in body.lines() {
        let Ok(line) = line else { break };
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(s) = v["data"].as_str() {
            out.push_str(s);
        }
        if v["type"] == "result" || v["type"] == "error" {
            break;
        }
    }
    assert!(out.contains("41 117"), "stty size after resize: {out:?}");
}

/// The warm pool's own sandbox is the one a new session gets. With every
/// template's pool full, the pooled sandboxes' processes are known; a
/// session is made, the pool refilled, the session deleted: a pooled
/// process must be gone with it. Had the session booted a sandbox of its
/// own, all the pooled ones would still run.
#[test]
fn warm_pool_sandbox_is_the_one_handed_out() {
    let d = Daemon::start(&["--pool-size", "1", "--standby-vmms", "0"]);
    let h = d.http();
    let templates: Vec<String> = h.get("/v1/templates").json()["templates"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t["name"].as_str().map(str::to_string))
        .collect();
    assert!(!templates.is_empty());
    // Every template's pool holds one sandbox (the pool fills them all).
    let full = |h: &Http| {
        let m = h.get("/metrics").text();
        templates.iter().all(|t| {
            m.lines()
                .any(|l| l == format!("agent_sandbox_pool_size{{template=\"{t}\"}} 1"))
        })
    };
    // Generous: under TCG each template's first boot makes its snapshot.
    assert!(
        wait_until(Duration::from_secs(600), || full(&h)),
        "pools never filled ({templates:?}):\n{}",
        d.log()
    );
    let warm = d.sandbox_procs();
    assert!(!warm.is_empty(), "no process for the warm sandboxes");
    let exes: Vec<String> = warm
        .iter()
        .filter_map(|p| std::fs::read_link(format!("/proc/{p}/exe")).ok())
        .map(|e| e.display().to_string())
        .collect();
    eprintln!("warm sandboxes of {templates:?}: {warm:?} running {exes:?}");
    assert_eq!(stdout_of(&h.exec("w", "echo warm")), "warm\n");
    assert!(
        wait_until(Duration::from_secs(300), || full(&h)),
        "pool not refilled"
    );
    let all = d.sandbox_procs();
    assert!(
        warm.iter().all(|p| all.contains(p)),
        "a warm sandbox of {warm:?} is gone before the session ended: {all:?}"
    );
    assert!(all.len() > warm.len(), "no refill process: {all:?}");
    assert_eq!(h.delete("/v1/sessions/w").status, 200);
    assert!(
        wait_until(Duration::from_secs(30), || warm.iter().any(|p| !alive(*p))),
        "deleting the session left every once-pooled sandbox {warm:?} running: \
         the session had a sandbox of its own"
    );
    // The pool's entries (one of them the refill) are still there, unused.
    assert!(full(&h));
    // As many sandbox processes as when only the pools ran: the session's
    // are gone and the refill took the place of the one it was handed.
    assert!(
        wait_until(Duration::from_secs(30), || d.sandbox_procs().len()
            == warm.len()),
        "{:?} after the delete, {warm:?} before the session",
        d.sandbox_procs()
    );
}
