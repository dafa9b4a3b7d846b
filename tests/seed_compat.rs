//! The seed's contract (docs/api.md, "Seed compatibility"), end to end: the
//! real daemon, guests in VMs, a plain HTTP client replaying the seed
//! README's examples verbatim (no template named) and checking every shape
//! the document lists field by field; key expiry in REST, MCP and the CLI;
//! and a TypeScript seed client that uses nothing but `fetch`.
//!
//! The seed's default template has node; ours is the developer image
//! (`dev`). Test daemons default to `base` for speed
//! (`common::default_template_args`), so these name the real default.

mod common;
#[path = "mcp/harness.rs"]
mod harness;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, stdout_of, Daemon, Http, Resp};
use common::wait_until;
use serde_json::{json, Value};
use std::io::{BufRead, Read, Write};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

/// Daemon flags: on VMs the real default template (see the module
/// comment); the `local-process` backend runs the host's node.
fn seed_args() -> Vec<&'static str> {
    if common::daemon::vm_backend() {
        vec!["--default-template", "default"]
    } else {
        vec![]
    }
}

/// JSON types, as a seed client checks them.
#[derive(Clone, Copy, Debug)]
enum Ty {
    Str,
    Num,
    Bool,
    Arr,
    Obj,
    /// A number or null.
    NumOrNull,
}

/// `v` has every field of `fields` with its type (extra fields are fine).
#[track_caller]
fn assert_shape(v: &Value, fields: &[(&str, Ty)]) {
    for (name, ty) in fields {
        let f = &v[*name];
        let ok = match ty {
            Ty::Str => f.is_string(),
            Ty::Num => f.is_number(),
            Ty::Bool => f.is_boolean(),
            Ty::Arr => f.is_array(),
            Ty::Obj => f.is_object(),
            Ty::NumOrNull => f.is_number() || f.is_null(),
        };
        assert!(ok, "field {name:?} is not {ty:?} in {v}");
    }
}

/// A seed-shaped error: `{"error": "<readable message>", "code"}`.
#[track_caller]
fn assert_seed_error(r: &Resp, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let msg = v["error"]
        .as_str()
        .unwrap_or_else(|| panic!("error is not a string: {v}"));
    assert!(msg.len() > 5, "a readable message: {v}");
    assert_eq!(v["code"], code, "{v}");
}

/// A v1-shaped error: `{"error": {code, message}}`.
#[track_caller]
fn assert_v1_error(r: &Resp, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

/// One raw request (for what a client library would not send: a
/// `Content-Length` larger than the server takes) and its status + body.
fn raw(base: &str, head: &str) -> (u16, Value) {
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    s.write_all(head.as_bytes()).expect("send head");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn create_key(admin: &Http, body: Value) -> (String, Value) {
    let r = admin.post("/admin/keys", &body);
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    (v["key"].as_str().expect("key").to_string(), v)
}

const RECORD: &[(&str, Ty)] = &[
    ("id", Ty::Str),
    ("name", Ty::Str),
    ("keyPrefix", Ty::Str),
    ("scopes", Ty::Arr),
    ("rateLimit", Ty::Obj),
    ("createdAt", Ty::Num),
    ("expiresAt", Ty::NumOrNull),
    ("enabled", Ty::Bool),
];

#[test]
fn seed_readme_examples_answer_in_the_seed_shapes() {
    let mut args = seed_args();
    // One session fills the host: /ready says so.
    args.extend(["--max-sessions", "1"]);
    let d = Daemon::start(&args);
    let h = d.http();

    // GET /health, GET /ready (no key).
    let r = h.anonymous().get("/health");
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_shape(&v, &[("status", Ty::Str), ("uptime", Ty::Num)]);
    assert_eq!(v["status"], "ok");
    assert!(v["uptime"].as_f64().unwrap() >= 0.0);
    eprintln!("seed compat: daemon backend {}", v["backend"]);
    assert_eq!(
        v["backend"] != "local-process",
        common::daemon::vm_backend()
    );
    let r = h.anonymous().get("/ready");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_shape(&v, &[("status", Ty::Str), ("checks", Ty::Obj)]);
    assert_eq!(v["status"], "ready");
    for c in ["accepting", "vmm", "images", "capacity"] {
        assert_eq!(v["checks"][c], true, "{v}");
    }

    // The README's first example, verbatim: no template named.
    let t0 = Instant::now();
    let r = h.post_raw(
        "/exec/my-session/execute",
        br#"{"command":"node","args":["-e","console.log(1+1)"]}"#,
        "application/json",
    );
    eprintln!(
        "FIGURE seed_first_execute_ms={} (create + first exec, node)",
        t0.elapsed().as_millis()
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_shape(
        &v,
        &[
            ("exitCode", Ty::Num),
            ("timedOut", Ty::Bool),
            ("output", Ty::Arr),
        ],
    );
    assert_eq!(v["exitCode"], 0, "{v}");
    assert_eq!(v["timedOut"], false);
    assert_eq!(stdout_of(&v), "2\n");
    for o in v["output"].as_array().unwrap() {
        assert_shape(
            o,
            &[("stream", Ty::Str), ("data", Ty::Str), ("ts", Ty::Num)],
        );
    }
    // The session fills the host now.
    let r = h.anonymous().get("/ready");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["status"], "not_ready");
    assert_eq!(r.json()["checks"]["capacity"], false);

    // Streaming (NDJSON), as the README shows it.
    let (st, rd) = h.post_stream(
        "/exec/my-session/execute",
        &json!({"command": "node", "args": ["-e", "console.log('a'); console.error('b')"]}),
        "application/x-ndjson",
    );
    assert_eq!(st, 200);
    let lines: Vec<Value> = rd
        .lines()
        .map(|l| serde_json::from_str(&l.expect("line")).expect("JSON line"))
        .collect();
    assert_eq!(lines[0]["type"], "started", "{lines:?}");
    assert!(lines
        .iter()
        .any(|l| l["type"] == "stream" && l["stream"] == "stdout" && l["data"] == "a\n"));
    assert!(lines
        .iter()
        .any(|l| l["type"] == "stream" && l["stream"] == "stderr" && l["data"] == "b\n"));
    let last = lines.last().unwrap();
    assert_shape(
        last,
        &[
            ("type", Ty::Str),
            ("exitCode", Ty::Num),
            ("timedOut", Ty::Bool),
        ],
    );
    assert_eq!(
        (&last["type"], &last["exitCode"]),
        (&json!("result"), &json!(0))
    );

    // Write a file, run it, read it back, list the directory.
    let r = h.post_raw(
        "/exec/my-session/write",
        br#"{"path":"/workspace/hello.js","content":"console.log('hello')"}"#,
        "application/json",
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_shape(&r.json(), &[("bytesWritten", Ty::Num)]);
    assert_eq!(r.json()["bytesWritten"], 20);
    let r = h.post_raw(
        "/exec/my-session/execute",
        br#"{"command":"node","args":["/workspace/hello.js"]}"#,
        "application/json",
    );
    assert_eq!(stdout_of(&r.json()), "hello\n", "{}", r.text());
    let r = h.get("/exec/my-session/read?path=/workspace/hello.js");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_shape(
        &r.json(),
        &[("content", Ty::Str), ("path", Ty::Str), ("size", Ty::Num)],
    );
    assert_eq!(r.json()["content"], "console.log('hello')");
    h.exec("my-session", "mkdir -p /workspace/lib");
    let r = h.get("/exec/my-session/files?path=/workspace");
    assert_eq!(r.status, 200, "{}", r.text());
    let files = r.json()["files"].as_array().expect("files").clone();
    for f in &files {
        assert_shape(
            f,
            &[("path", Ty::Str), ("type", Ty::Str), ("size", Ty::Num)],
        );
        assert!(f["type"] == "file" || f["type"] == "dir", "{f}");
    }
    let find = |name: &str| {
        files
            .iter()
            .find(|f| f["path"].as_str().unwrap_or("").ends_with(name))
            .unwrap_or_else(|| panic!("{name} not listed: {files:?}"))
    };
    assert_eq!(find("hello.js")["type"], "file");
    assert_eq!(find("hello.js")["size"], 20);
    assert_eq!(find("lib")["type"], "dir");
    // v1 keeps its own name for a directory.
    let v1 = h
        .get("/v1/sessions/my-session/files/list?path=/workspace")
        .json();
    assert!(
        v1["files"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["type"] == "directory"),
        "{v1}"
    );

    // GET /exec/ lists the sessions.
    let r = h.get("/exec/");
    assert_eq!(r.status, 200);
    let s = r.json()["sessions"][0].clone();
    assert_shape(
        &s,
        &[
            ("id", Ty::Str),
            ("state", Ty::Str),
            ("createdAt", Ty::Num),
            ("lastActivityAt", Ty::Num),
            ("ownerId", Ty::Str),
            ("templateName", Ty::Str),
        ],
    );
    assert_eq!(s["id"], "my-session");
    assert_eq!(s["state"], "active");
    assert!(
        s["templateName"].as_str().is_some_and(|t| !t.is_empty()),
        "{s}"
    );
    let created = s["createdAt"].as_u64().unwrap();
    let active = s["lastActivityAt"].as_u64().unwrap();
    assert!(created <= active && active <= now_ms(), "{s}");
    assert!(now_ms() - created < 3_600_000, "{s}");
    // v1 keeps its own states.
    assert_eq!(h.get("/v1/sessions/my-session").json()["state"], "ready");

    // Templates: listed (their shape is another change's).
    let r = h.get("/exec/templates");
    assert_eq!(r.status, 200);
    assert!(r.json()["templates"].is_array());

    // Errors in the seed's shape, wherever they arise.
    let exec_only = create_key(&h, json!({"name": "exec-only"})).0;
    let e = h.with_key(&exec_only);
    assert_seed_error(&h.anonymous().get("/exec/"), 401, "unauthorized");
    assert_seed_error(
        &h.with_key("asbx_kffff_00").get("/exec/"),
        401,
        "unauthorized",
    );
    assert_seed_error(&e.get("/admin/keys"), 403, "forbidden");
    assert_seed_error(&h.get("/exec/my-session/nothing"), 404, "route_not_found");
    assert_seed_error(&h.get("/exec/ghost/files"), 404, "session_not_found");
    assert_seed_error(
        &h.get("/exec/my-session/read?path=/workspace/nope"),
        404,
        "file_not_found",
    );
    assert_seed_error(
        &h.get("/exec/my-session/execute"),
        405,
        "method_not_allowed",
    );
    assert_seed_error(&h.post("/health", &json!({})), 405, "method_not_allowed");
    assert_seed_error(
        &h.post_raw("/exec/my-session/execute", b"{nope", "application/json"),
        400,
        "bad_request",
    );
    assert_seed_error(
        &h.post("/admin/keys", &json!({"scopes": ["root"]})),
        400,
        "bad_request",
    );
    assert_seed_error(
        &h.post(
            "/exec/my-session/execute",
            &json!({"command": "no-such-program", "args": []}),
        ),
        400,
        "spawn_failed",
    );
    // ...also on a stream's error line.
    let (_, rd) = h.post_stream(
        "/exec/my-session/execute",
        &json!({"command": "no-such-program", "args": []}),
        "application/x-ndjson",
    );
    let last: Value = rd
        .lines()
        .map_while(Result::ok)
        .last()
        .and_then(|l| serde_json::from_str(&l).ok())
        .expect("an error line");
    assert_eq!(last["type"], "error", "{last}");
    assert!(last["error"].is_string(), "{last}");
    assert_eq!(last["code"], "spawn_failed", "{last}");
    // The HTTP layer's own refusal (before any byte of the body).
    let head = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: 99999999999\r\nConnection: close\r\n\r\n"
        )
    };
    let (st, v) = raw(&d.base, &head("/exec/my-session/write"));
    assert_eq!(st, 413, "{v}");
    assert!(
        v["error"].is_string() && v["code"] == "body_too_large",
        "{v}"
    );
    let (st, v) = raw(&d.base, &head("/v1/sessions"));
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_large", "{v}");
    // Rate limits.
    let slow = create_key(
        &h,
        json!({"name": "slow", "rateLimit": {"requestsPerSecond": 0.01, "burst": 1}}),
    );
    assert_eq!(slow.1["record"]["rateLimit"]["requestsPerSecond"], 0.01);
    let s = h.with_key(&slow.0);
    assert_eq!(s.get("/exec/").status, 200);
    let r = s.get("/exec/");
    assert_seed_error(&r, 429, "rate_limited");
    assert!(r.header("retry-after").is_some());
    // v1 keeps its shape.
    assert_v1_error(&h.anonymous().get("/v1/sessions"), 401, "unauthorized");
    assert_v1_error(&h.get("/v1/sessions/ghost"), 404, "session_not_found");

    // DELETE /exec/my-session, then again.
    let r = h.delete("/exec/my-session");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["destroyed"], true);
    let r = h.delete("/exec/my-session");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["destroyed"], false);
    assert_eq!(h.delete("/exec/never-was").json()["destroyed"], false);
    assert!(wait_until(Duration::from_secs(10), || d
        .session_procs()
        .is_empty()));
    assert_eq!(h.anonymous().get("/ready").status, 200);
}

#[test]
fn admin_keys_answer_in_the_seed_shapes() {
    // Keys need no VM: a daemon on the test backend, no session started.
    let d = Daemon::start(&[]);
    let h = d.http();
    let expires = now_ms() + 7 * 86_400_000;
    let r = h.post(
        "/admin/keys",
        &json!({"name": "ci", "scopes": ["exec"], "rateLimit": 5, "expiresAt": expires}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_shape(&v, &[("key", Ty::Str), ("record", Ty::Obj)]);
    let rec = &v["record"];
    assert_shape(rec, RECORD);
    assert_eq!(rec["name"], "ci");
    assert_eq!(rec["scopes"], json!(["exec"]));
    assert_eq!(rec["rateLimit"]["requestsPerSecond"], 5.0);
    assert_eq!(rec["expiresAt"], expires);
    assert_eq!(rec["enabled"], true);
    let created = rec["createdAt"].as_u64().unwrap();
    assert!(
        created <= now_ms() && now_ms() - created < 600_000,
        "ms: {rec}"
    );
    let key = v["key"].as_str().unwrap();
    assert!(key.starts_with(rec["keyPrefix"].as_str().unwrap()), "{v}");
    assert!(
        rec["keyPrefix"].as_str().unwrap().len() < key.len() / 2,
        "not the secret"
    );
    let id = rec["id"].as_str().unwrap().to_string();

    // Defaults: scopes exec, no expiry.
    let (_, v) = create_key(&h, json!({"name": "plain"}));
    assert_eq!(v["record"]["scopes"], json!(["exec"]));
    assert_eq!(v["record"]["expiresAt"], Value::Null);
    // Refused: a time in the past, an unknown field.
    let r = h.post("/admin/keys", &json!({"name": "x", "expiresAt": 1000}));
    assert_seed_error(&r, 400, "bad_request");
    assert!(r.message().contains("expiresAt"), "{}", r.text());
    assert_seed_error(
        &h.post("/admin/keys", &json!({"nom": "x"})),
        400,
        "bad_request",
    );

    let r = h.get("/admin/keys");
    assert_eq!(r.status, 200);
    let keys = r.json()["keys"].as_array().unwrap().clone();
    for k in &keys {
        assert_shape(k, RECORD);
        assert!(k.get("hash").is_none(), "{k}");
    }
    assert!(keys
        .iter()
        .any(|k| k["id"] == id.as_str() && k["expiresAt"] == expires));

    let r = h.post(&format!("/admin/keys/{id}/rotate"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_shape(&r.json(), &[("key", Ty::Str), ("record", Ty::Obj)]);
    assert_shape(&r.json()["record"], RECORD);
    let rotated = r.json()["key"].as_str().unwrap().to_string();
    assert_ne!(rotated, key);
    assert_eq!(
        r.json()["record"]["expiresAt"],
        expires,
        "rotation keeps the expiry"
    );
    assert_eq!(h.with_key(&rotated).get("/exec/").status, 200);

    let r = h.post(&format!("/admin/keys/{id}/revoke"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["revoked"], true);
    assert_shape(&r.json()["record"], RECORD);
    assert_eq!(r.json()["record"]["enabled"], false);
    assert_seed_error(&h.with_key(&rotated).get("/exec/"), 401, "unauthorized");
    // A revoked key is still listed; rotating it is a conflict, not a 404.
    assert_seed_error(
        &h.post(&format!("/admin/keys/{id}/rotate"), &json!({})),
        409,
        "key_revoked",
    );
    assert_seed_error(
        &h.post("/admin/keys/kffffffffffff/rotate", &json!({})),
        404,
        "key_not_found",
    );

    let r = h.delete(&format!("/admin/keys/{id}"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["deleted"], true);
    assert_seed_error(
        &h.delete(&format!("/admin/keys/{id}")),
        404,
        "key_not_found",
    );
}

/// `agent-sandbox keys ...` on the daemon's key file.
fn keys_cli(d: &Daemon, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .arg("keys")
        .arg("--key-file")
        .arg(d.state_dir().join("keys.json"))
        .args(args)
        .output()
        .expect("run agent-sandbox keys");
    assert!(
        out.status.success(),
        "keys {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn expired_keys_are_refused_in_rest_mcp_and_shown_in_keys_list() {
    let d = Daemon::start(&seed_args());
    let h = d.http();
    // The daemon re-reads a key file the CLI changed within a second.
    let record_of = |key: &str| -> Value {
        let id = key.split('_').nth(1).expect("key id");
        let mut found = None;
        wait_until(Duration::from_secs(5), || {
            found = h.get("/admin/keys").json()["keys"]
                .as_array()
                .and_then(|ks| ks.iter().find(|k| k["id"] == id).cloned());
            found.is_some()
        });
        found.unwrap_or_else(|| panic!("key {id} not listed"))
    };
    // The CLI's --expires: 7d, 12h, 30m, 90s from now.
    for (arg, ms) in [
        ("7d", 7 * 86_400_000u64),
        ("12h", 12 * 3_600_000),
        ("30m", 30 * 60_000),
        ("90s", 90_000),
    ] {
        let before = now_ms();
        let key = keys_cli(&d, &["create", "--name", arg, "--expires", arg]);
        let at = record_of(key.trim())["expiresAt"]
            .as_u64()
            .expect("expiresAt");
        assert!(
            (before + ms..=now_ms() + ms).contains(&at),
            "--expires {arg}: {at} not {ms} ms from now"
        );
    }

    // A key that expires while it holds a session. The template's snapshot
    // is made first (by another key's session), so that the short key's
    // session starts well within its 20 s.
    h.exec("warm-up", "true");
    assert_eq!(h.delete("/exec/warm-up").json()["destroyed"], true);
    let key = keys_cli(
        &d,
        &[
            "create",
            "--name",
            "short",
            "--scopes",
            "exec",
            "--expires",
            "20s",
        ],
    );
    let key = key.trim();
    let rec = record_of(key);
    let id = rec["id"].as_str().unwrap().to_string();
    let at = rec["expiresAt"].as_u64().unwrap();
    let k = h.with_key(key);
    let v = k.exec("short-lived", "node -e 'console.log(6*7)'");
    assert_eq!(stdout_of(&v), "42\n");
    let (st, _, v) = mcp_call(&d, key, "list_sessions", json!({}));
    assert_eq!(st, 200, "{v}");
    assert!(v["result"].is_object(), "{v}");
    let list = keys_cli(&d, &["list"]);
    let row = list.lines().find(|l| l.starts_with(&id)).expect("listed");
    assert!(row.contains("active"), "{row}");
    assert!(
        now_ms() < at,
        "the VM took longer than the key's 20 s to start"
    );

    // Past its expiry.
    std::thread::sleep(Duration::from_millis(at.saturating_sub(now_ms()) + 200));
    let r = k.get("/exec/");
    assert_seed_error(&r, 401, "key_expired");
    assert!(r.message().contains("expired"), "{}", r.text());
    assert_v1_error(&k.get("/v1/sessions"), 401, "key_expired");
    let (st, _, v) = mcp_call(&d, key, "list_sessions", json!({}));
    assert_eq!(st, 401, "{v}");
    assert!(v.to_string().contains("expired"), "{v}");
    let list = keys_cli(&d, &["list"]);
    let row = list.lines().find(|l| l.starts_with(&id)).expect("listed");
    assert!(row.contains("expired"), "{row}");
    assert_eq!(record_of(key)["expired"], true);
    // Its access is gone, and with it its session (as on revocation).
    assert!(
        wait_until(Duration::from_secs(10), || h.get("/exec/").json()
            ["sessions"]
            .as_array()
            .is_some_and(|s| s.is_empty())),
        "the expired key's session is still there"
    );
    assert!(wait_until(Duration::from_secs(10), || d
        .session_procs()
        .is_empty()));
}

#[test]
fn typescript_seed_client_with_fetch_only() {
    let Some(tsc) = harness::tsc() else { return };
    let out = tempfile::tempdir().expect("tempdir");
    let src = harness::repo().join("tests/seed/seed_client.ts");
    let st = Command::new("node")
        .arg(&tsc)
        .args([
            "--strict",
            "--target",
            "es2022",
            "--module",
            "commonjs",
            "--lib",
            "es2022,dom",
            "--outDir",
        ])
        .arg(out.path())
        .arg(&src)
        .status()
        .expect("run tsc");
    assert!(st.success(), "tsc failed on {}", src.display());
    let d = Daemon::start(&seed_args());
    let t0 = Instant::now();
    let mut cmd = Command::new("node");
    cmd.arg(out.path().join("seed_client.js"))
        .args([&d.base, &d.key]);
    let text = harness::run_script(cmd, "typescript seed client", Duration::from_secs(300));
    eprintln!(
        "FIGURE seed_ts_client_s={:.1} (boot, execute, stream, files, keys)",
        t0.elapsed().as_secs_f64()
    );
    assert!(text.contains("checks held"), "{text}");
    assert!(wait_until(Duration::from_secs(10), || d
        .session_procs()
        .is_empty()));
}
