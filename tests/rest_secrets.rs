//! Episodic secret files and output masking through the real daemon and
//! real VMs (issue #25): `exec {secrets}` on /v1 and MCP.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{mcp_call, stdout_of, Daemon, Http};
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::{Duration, Instant};

const VALUE: &str = "sk-test-5f1e2d3c4b5a69788796a5b4";

fn vm_daemon() -> Option<Daemon> {
    if !common::daemon::vm_backend() {
        return None;
    }
    Some(Daemon::start(&[]))
}

fn exec(h: &Http, id: &str, body: Value) -> Value {
    let r = h.post(&format!("/v1/sessions/{id}/exec"), &body);
    assert_eq!(r.status, 200, "exec {body}: {}", r.text());
    let v = r.json();
    assert!(!v.to_string().contains(VALUE), "value in an answer: {v}");
    v
}

fn sh(h: &Http, id: &str, cmd: &str) -> String {
    let v = exec(h, id, json!({"command": cmd, "timeout": 60_000}));
    assert_eq!(v["exitCode"], 0, "{cmd}: {v}");
    stdout_of(&v)
}

fn secrets() -> Value {
    json!({"API_KEY": VALUE})
}

/// `ls` of /run/secrets from a plain exec: empty when the files are gone.
fn listing(h: &Http, id: &str) -> String {
    sh(h, id, "ls -A /run/secrets 2>/dev/null; true")
}

#[test]
fn secret_files_live_for_one_exec_and_output_is_masked() {
    let Some(d) = vm_daemon() else {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    };
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "s"}));
    assert_eq!(r.status, 201, "{}", r.text());

    // Readable, right content and mode, owned by root; output masked;
    // not in the environment. (The command names the value in two
    // pieces, so that only the output could show it whole.)
    let (p1, p2) = VALUE.split_at(10);
    let v = exec(
        &h,
        "s",
        json!({"command": format!("stat -c '%a %u %U' /run/secrets/API_KEY; stat -c '%a' /run/secrets; \
                           echo $(cat /run/secrets/API_KEY); \
                           [ \"$(cat /run/secrets/API_KEY)\" = '{p1}''{p2}' ] && echo same; \
                           cat /run/secrets/API_KEY | base64; env | grep -c {p2} || true"),
               "secrets": secrets()}),
    );
    let out = stdout_of(&v);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        ["400 0 root", "700", "****", "same", "****", "0"],
        "{v}"
    );

    // Gone after a normal exit; a second exec cannot see it.
    assert_eq!(listing(&h, "s"), "");
    let v = exec(&h, "s", json!({"command": "cat /run/secrets/API_KEY"}));
    assert_ne!(v["exitCode"], 0, "{v}");

    // Gone after a timeout.
    let v = exec(
        &h,
        "s",
        json!({"command": "cat /run/secrets/API_KEY; sleep 30", "timeout": 1500,
               "secrets": secrets()}),
    );
    assert_eq!(v["timedOut"], true, "{v}");
    assert_eq!(stdout_of(&v), "****", "{v}");
    assert_eq!(listing(&h, "s"), "");

    // Split across two chunks, streamed (NDJSON): masked as a whole.
    let half = VALUE.len() / 2;
    let (a, b) = VALUE.split_at(half);
    let (status, body) = h.post_stream(
        "/v1/sessions/s/exec",
        &json!({"command": format!("printf 'x{a}'; sleep 1; printf '{b}y\\n'"),
                "secrets": secrets()}),
        "application/x-ndjson",
    );
    assert_eq!(status, 200);
    let mut data = String::new();
    let mut chunks = 0;
    for line in body.lines() {
        let line = line.expect("stream line");
        assert!(!line.contains(VALUE) && !line.contains(a), "leak: {line}");
        let ev: Value = serde_json::from_str(&line).expect("JSON line");
        if ev["type"] == "stream" {
            chunks += 1;
            data.push_str(ev["data"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(data, "x****y\n");
    assert!(chunks >= 2, "the output came in {chunks} chunk(s)");
    // The same split in a base64-encoded buffered answer.
    let v = exec(
        &h,
        "s",
        json!({"command": format!("printf 'x{a}'; sleep 1; printf '{b}y'"),
               "encoding": "base64", "secrets": secrets()}),
    );
    let mut raw = Vec::new();
    for e in v["output"].as_array().cloned().unwrap_or_default() {
        use base64::Engine;
        raw.extend(
            base64::engine::general_purpose::STANDARD
                .decode(e["data"].as_str().unwrap_or(""))
                .expect("base64 chunk"),
        );
    }
    assert_eq!(raw, b"x****y", "{v}");

    // Gone after a kill (a signal to the running exec's process).
    let (status, mut body) = h.post_stream(
        "/v1/sessions/s/exec",
        &json!({"command": "cat /run/secrets/API_KEY; echo; sleep 60", "secrets": secrets()}),
        "application/x-ndjson",
    );
    assert_eq!(status, 200);
    let mut line = String::new();
    body.read_line(&mut line).expect("started line");
    let started: Value = serde_json::from_str(&line).expect("started JSON");
    assert_eq!(started["type"], "started", "{started}");
    let proc = started["procId"].as_u64().expect("procId");
    // While it runs: a checkpoint (and fork, pause) is refused, typed.
    for (path, body) in [
        ("/v1/sessions/s/snapshots", json!({})),
        ("/v1/sessions/s/fork", json!({"count": 1})),
        ("/v1/sessions/s/pause", json!({})),
    ] {
        let r = h.post(path, &body);
        assert_eq!(r.status, 409, "{path}: {}", r.text());
        assert_eq!(r.code(), "session_busy", "{path}: {}", r.text());
        assert!(r.message().contains("secret files"), "{}", r.text());
    }
    // Its output is not replayed, while it runs, to an attach (only its own answer masked it).
    let r = h.get(&format!("/v1/sessions/s/processes/{proc}/output"));
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(!r.text().contains(VALUE), "{}", r.text());
    // Another exec may not take the same name meanwhile.
    let r = h.post(
        "/v1/sessions/s/exec",
        &json!({"command": "true", "secrets": secrets()}),
    );
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.message().contains("/run/secrets/API_KEY"), "{}", r.text());
    let r = h.post(
        &format!("/v1/sessions/s/processes/{proc}/signal"),
        &json!({"signal": "KILL"}),
    );
    assert!(r.status < 300, "signal: {}", r.text());
    let rest: Vec<String> = body.lines().map_while(Result::ok).collect();
    let result = rest.last().cloned().unwrap_or_default();
    assert!(result.contains("\"result\""), "{rest:?}");
    assert!(!rest.concat().contains(VALUE), "{rest:?}");
    assert_eq!(listing(&h, "s"), "");
    // And a checkpoint is fine again.
    let r = h.post("/v1/sessions/s/snapshots", &json!({}));
    assert_eq!(r.status, 201, "{}", r.text());

    // Gone after the client disconnects mid-exec.
    {
        let (status, mut body) = h.post_stream(
            "/v1/sessions/s/exec",
            // Output now and then: a stream notices a gone client when
            // it writes.
            &json!({"command": "while true; do echo .; sleep 0.3; done",
                    "timeout": 60_000, "secrets": secrets()}),
            "application/x-ndjson",
        );
        assert_eq!(status, 200);
        let mut line = String::new();
        body.read_line(&mut line).expect("started line");
        assert_eq!(listing(&h, "s"), "API_KEY\n");
    }
    let t0 = Instant::now();
    while !listing(&h, "s").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "file left after disconnect"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // MCP's execute: masked, and gone after.
    let (status, _, v) = mcp_call(
        &d,
        &d.key,
        "execute",
        json!({"sessionId": "s", "command": "cat /run/secrets/API_KEY",
               "secrets": secrets()}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v.to_string().contains("****"), "{v}");
    assert!(!v.to_string().contains(VALUE), "{v}");
    assert_eq!(listing(&h, "s"), "");

    // No GET answer and no log line holds the value.
    for path in [
        "/v1/sessions",
        "/v1/sessions/s",
        "/v1/sessions/s/processes",
        "/v1/snapshots",
    ] {
        let r = h.get(path);
        assert!(!r.text().contains(VALUE), "{path}: {}", r.text());
    }
    let log = d.log();
    assert!(!log.contains(VALUE), "value in the daemon log");
}

#[test]
fn bad_secrets_are_refused_with_a_400_that_never_shows_the_value() {
    // The checks run before any guest is asked: the local backend serves.
    let d = Daemon::start_local(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "b"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let big = "v".repeat(64 * 1024 + 1);
    let many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!(VALUE))).collect();
    for (secrets, want) in [
        (json!({"a/b": VALUE}), "secret name"),
        (json!({"..": VALUE}), "secret name"),
        (json!({"": VALUE}), "secret name"),
        (json!({"K": "abc"}), "secret \"K\" is 3 characters"),
        (json!({"K": big}), "65537 bytes: a value takes"),
        (Value::Object(many), "too many secrets"),
        (json!({"K": 5}), "secret \"K\" must be a string"),
        (json!(VALUE), "secrets must be an object"),
    ] {
        let r = h.post(
            "/v1/sessions/b/exec",
            &json!({"command": "true", "secrets": secrets}),
        );
        assert_eq!(r.status, 400, "{secrets}: {}", r.text());
        assert!(r.message().contains(want), "{}", r.text());
        assert!(!r.text().contains(VALUE), "{}", r.text());
        assert!(!r.text().contains("vvvv"), "{}", r.text());
    }
    let r = h.post(
        "/v1/sessions/b/exec",
        &json!({"command": "true", "background": true, "secrets": secrets()}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.message().contains("foreground"), "{}", r.text());
    // Valid secrets, but this backend's /run is the host's.
    let r = h.post(
        "/v1/sessions/b/exec",
        &json!({"command": "true", "secrets": secrets()}),
    );
    assert_eq!(r.code(), "not_supported", "{}", r.text());
    assert!(!d.log().contains(VALUE));
}
