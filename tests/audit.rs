//! The audit log (issue #26) through the real binary: `audit verify` on
//! good and tampered files, the HTTP sink against loopback servers (one
//! that answers, one that hangs), a local-process session's records read
//! back with `GET /v1/sessions/:id/audit`, and a real VM session with env
//! values and secret files that never reach the log.

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::audit::{Log, Settings};
use common::daemon::{Daemon, Http};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn verify(files: &[PathBuf]) -> (bool, String, String) {
    verify_with(files, &[])
}

fn verify_with(files: &[PathBuf], extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .arg("audit")
        .arg("verify")
        .args(extra)
        .args(files)
        .output()
        .expect("run audit verify");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn copy_to(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write copy");
    p
}

fn records(files: &[PathBuf]) -> Vec<Value> {
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .expect("read audit file")
                .lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("record JSON"))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn verify_passes_good_files_and_fails_a_changed_byte_or_a_removed_record() {
    let d = tempfile::tempdir().unwrap();
    let s = Settings {
        rotate_bytes: 4096,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().join("audit"), None).unwrap();
    for i in 0..60 {
        log.record(
            "key1",
            "s1",
            "exec",
            json!({"argv": ["echo", i], "cwd": "/w"}),
        );
    }
    assert!(log.flush(Duration::from_secs(5)));
    let files = log.files("key1", "s1");
    assert!(files.len() >= 2, "rotated into several files: {files:?}");

    // Two (or more) rotated files verify together, in chain order.
    let (ok, out, err) = verify(&files);
    assert!(ok, "{err}");
    assert!(out.contains("60 records, seq 1..60"), "{out}");
    let (ok, _, err) = verify(&files[1..]);
    assert!(ok, "a tail of the set continues a chain: {err}");
    let mut wrong = files.clone();
    wrong.swap(0, 1);
    assert!(!verify(&wrong).0, "files out of order");

    let cur = files.last().unwrap();
    let good = std::fs::read(cur).unwrap();
    let (ok, _, _) = verify(&[copy_to(d.path(), "same.jsonl", &good)]);
    assert!(ok);

    // One byte changed: in a value, and in a hash.
    for at in [good.len() / 3, good.len() - 10] {
        let mut b = good.clone();
        b[at] = if b[at] == b'1' { b'2' } else { b'1' };
        let (ok, _, err) = verify(&[copy_to(d.path(), "flip.jsonl", &b)]);
        assert!(!ok, "byte {at} changed yet verified");
        assert!(err.contains("flip.jsonl:"), "names the line: {err}");
        assert!(
            err.contains("hash mismatch") || err.contains("prev mismatch") || err.contains("JSON"),
            "{err}"
        );
    }

    // One record removed.
    let text = String::from_utf8(good).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let cut = [&lines[..2], &lines[3..]].concat().join("\n") + "\n";
    let (ok, _, err) = verify(&[copy_to(d.path(), "cut.jsonl", cut.as_bytes())]);
    assert!(!ok, "a removed record verified");
    assert!(err.contains("seq gap") && err.contains(":3"), "{err}");
}

/// A loopback HTTP server: collects the bodies POSTed to it (answering
/// 200), or with `hang` accepts and never answers.
fn sink_server(hang: bool) -> (String, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/audit", l.local_addr().unwrap());
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let g = got.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            let Ok(c) = c else { return };
            if hang {
                held.push(c);
                continue;
            }
            let g = g.clone();
            std::thread::spawn(move || serve_one(c, &g));
        }
    });
    (url, got)
}

fn serve_one(c: std::net::TcpStream, got: &Mutex<Vec<String>>) {
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut w = c;
    loop {
        let mut len = 0usize;
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        got.lock()
            .unwrap()
            .extend(String::from_utf8_lossy(&body).lines().map(String::from));
        let _ = w.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
    }
}

#[test]
fn the_http_sink_gets_every_record_and_a_hung_one_blocks_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (url, got) = sink_server(false);
    let s = Settings {
        http_url: Some(url),
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().join("a"), None).unwrap();
    for i in 0..100 {
        log.record("k", "s", "api", json!({"i": i}));
    }
    assert!(log.flush(Duration::from_secs(5)));
    let end = Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().len() < 100 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let lines = got.lock().unwrap().clone();
    assert_eq!(lines.len(), 100, "every record forwarded");
    let file = std::fs::read_to_string(log.files("k", "s").pop().unwrap()).unwrap();
    assert_eq!(
        lines.join("\n") + "\n",
        file,
        "the sink gets the file's very lines (same hashes)"
    );
    log.stop();

    // A sink that accepts and never answers: records are still written at
    // once, what its queue cannot hold is counted and recorded.
    let (url, _) = sink_server(true);
    let s = Settings {
        http_url: Some(url),
        http_queue: 8,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().join("b"), None).unwrap();
    let t0 = Instant::now();
    for i in 0..2000 {
        log.record("k", "s", "api", json!({"i": i}));
    }
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "recording waited for the sink: {:?}",
        t0.elapsed()
    );
    assert!(
        log.flush(Duration::from_secs(5)),
        "the writer is not held up"
    );
    let files = log.files("k", "s");
    let recs = records(&files);
    assert_eq!(recs.iter().filter(|r| r["kind"] == "api").count(), 2000);
    let dropped: u64 = recs
        .iter()
        .filter(|r| r["kind"] == "dropped" && r["reason"] == "sink_queue_full")
        .map(|r| r["dropped"].as_u64().unwrap())
        .sum();
    let counted = log
        .counters()
        .unwrap()
        .sink_dropped
        .load(std::sync::atomic::Ordering::Relaxed);
    // At most one batch (256) in the sink's hands and 8 queued.
    assert!(dropped >= 2000 - 256 - 8, "{dropped} recorded as dropped");
    assert_eq!(dropped, counted, "recorded = counted");
    assert!(verify(&files).0);
}

/// The key id the daemon's records name as owner: the one its banner key has.
fn audit_of(h: &Http, id: &str) -> (Vec<Value>, String) {
    let r = h.get(&format!("/v1/sessions/{id}/audit"));
    assert_eq!(r.status, 200, "{}", r.text());
    let head = r.header("audit-head").expect("Audit-Head").to_string();
    let recs = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("NDJSON record"))
        .collect();
    (recs, head)
}

fn of<'a>(recs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    recs.iter().filter(|r| r["kind"] == kind).collect()
}

fn files_in(d: &Daemon, owner: &str, id: &str) -> Vec<PathBuf> {
    let dir = d.state_dir().join("audit").join(owner);
    let mut rotated: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .expect("audit dir")
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().into_string().ok()?;
            let k = n.strip_prefix(&format!("{id}."))?.strip_suffix(".jsonl")?;
            Some((k.parse().ok()?, e.path()))
        })
        .collect();
    rotated.sort();
    let mut v: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    v.push(dir.join(format!("{id}.jsonl")));
    v
}

#[test]
fn a_local_session_is_audited_and_read_back() {
    let d = Daemon::start_local(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "au"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = h.post(
        "/v1/sessions/au/exec",
        &json!({"argv": ["sh", "-c", "echo hi; exit 3"], "env": {"AUDIT_ENV": "env-value-xyzzy"},
                "cwd": "/tmp", "stdin": "input"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // A PTY process typed into, and a plain one fed bytes.
    let r = h.post(
        "/v1/sessions/au/exec",
        &json!({"command": "read x; echo got $x", "background": true,
                "pty": {"rows": 24, "cols": 80}}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let pty = r.json()["procId"].as_u64().unwrap();
    let r = h.post_raw(
        &format!("/v1/sessions/au/processes/{pty}/stdin"),
        b"ls -la\n",
        "application/octet-stream",
    );
    assert!(r.status < 300, "{}", r.text());
    let r = h.post(
        "/v1/sessions/au/exec",
        &json!({"command": "cat >/dev/null", "background": true}),
    );
    let plain = r.json()["procId"].as_u64().unwrap();
    let r = h.post_raw(
        &format!("/v1/sessions/au/processes/{plain}/stdin?eof=true"),
        b"12345678",
        "application/octet-stream",
    );
    assert!(r.status < 300, "{}", r.text());

    // The PTY process ends after its line; a look at it records its end.
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        let r = h.get(&format!("/v1/sessions/au/processes/{pty}"));
        if r.json()["running"] == false || Instant::now() > end {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // MCP too: the tool and its arguments, the file's content left out.
    let (status, _, v) = common::daemon::mcp_call(
        &d,
        &d.key,
        "write_file",
        json!({"sessionId": "au", "path": "/tmp/au.txt", "content": "file-content-zzz"}),
    );
    assert_eq!(status, 200, "{v}");
    let r = h.post(
        "/v1/sessions/au/exec",
        &json!({"command": "read x; read y", "background": true,
                "pty": {"rows": 24, "cols": 80}}),
    );
    let pty2 = r.json()["procId"].as_u64().unwrap();
    let (status, _, v) = common::daemon::mcp_call(
        &d,
        &d.key,
        "write_process",
        json!({"sessionId": "au", "procId": pty2, "input": "typed-by-mcp\n"}),
    );
    assert_eq!(status, 200, "{v}");

    let (recs, head) = audit_of(&h, "au");
    let text = recs.iter().map(Value::to_string).collect::<String>();
    assert!(!text.contains("env-value-xyzzy"), "an env value in the log");
    assert!(
        !text.contains("file-content-zzz"),
        "a file's content in the log"
    );
    let m = of(&recs, "api")
        .into_iter()
        .find(|r| r["via"] == "mcp")
        .expect("the MCP call's record");
    assert_eq!(
        (&m["tool"], &m["ok"]),
        (&json!("write_file"), &json!(true)),
        "{m}"
    );
    assert_eq!(m["params"]["content"]["bytes"], 16, "{m}");
    assert_eq!(m["params"]["path"], "/tmp/au.txt");
    let created = of(&recs, "session");
    assert_eq!(created[0]["event"], "created", "{created:?}");
    let owner = created[0]["owner"].as_str().unwrap().to_string();

    let api = of(&recs, "api");
    let routes: Vec<&str> = api.iter().filter_map(|r| r["route"].as_str()).collect();
    assert!(routes.contains(&"/v1/sessions"), "{routes:?}");
    assert!(
        routes.contains(&"/v1/sessions/{session}/exec"),
        "{routes:?}"
    );
    assert!(routes.contains(&"/v1/sessions/{session}/processes/{proc}/stdin"));
    assert!(api.iter().all(|r| r["key"] == owner));
    assert!(api
        .iter()
        .filter(|r| r["via"] == "rest")
        .all(|r| r["status"].is_u64()));
    let create = api.iter().find(|r| r["route"] == "/v1/sessions").unwrap();
    assert_eq!(create["status"], 201);
    assert_eq!(create["params"]["body"]["id"], "au", "{create}");
    // The body's parameters, env values reduced to their names.
    let e = api
        .iter()
        .find(|r| r["params"]["body"]["argv"][0] == "sh")
        .expect("the exec's api record");
    assert_eq!(e["params"]["body"]["env"], json!(["AUDIT_ENV"]));
    assert_eq!(e["params"]["body"]["stdin"]["leftOut"], true);

    let execs = of(&recs, "exec");
    let first = execs
        .iter()
        .find(|e| e["argv"][0] == "sh")
        .expect("exec record");
    assert_eq!(first["cwd"], "/tmp");
    assert_eq!(
        first["envNames"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| *n == "AUDIT_ENV")
            .count(),
        1
    );
    assert_eq!(first["stdinBytes"], 5);
    assert!(first["proc"].is_u64() && first["pty"] == false);
    let exit = of(&recs, "exit")
        .into_iter()
        .find(|x| x["proc"] == first["proc"])
        .expect("exit record");
    assert_eq!(
        (&exit["exitCode"], &exit["outcome"]),
        (&json!(3), &json!("exited"))
    );
    assert!(exit["durationMs"].is_u64() && exit.get("resourceUsage").is_some());
    let bg = execs.iter().find(|e| e["proc"] == pty).unwrap();
    let ends: Vec<_> = of(&recs, "exit")
        .into_iter()
        .filter(|x| x["proc"] == pty)
        .collect();
    assert_eq!(ends.len(), 1, "a background end, once: {ends:?}");
    assert_eq!(
        (&ends[0]["exitCode"], &ends[0]["seenBy"]),
        (&json!(0), &json!("list"))
    );
    assert_eq!(
        (&bg["pty"], &bg["background"]),
        (&json!(true), &json!(true))
    );

    let typed = of(&recs, "pty_input");
    assert_eq!(typed.len(), 2, "{typed:?}");
    assert_eq!(typed[1]["data"], "typed-by-mcp\n");
    let w = of(&recs, "api")
        .into_iter()
        .find(|r| r["tool"] == "write_process")
        .expect("write_process's record");
    assert_eq!(w["params"]["input"]["leftOut"], true, "{w}");
    assert_eq!(
        (&typed[0]["data"], &typed[0]["proc"]),
        (&json!("ls -la\n"), &json!(pty))
    );
    let fed = of(&recs, "stdin");
    assert_eq!(
        (&fed[0]["bytes"], &fed[0]["eof"]),
        (&json!(8), &json!(true))
    );

    // The files the stream came from verify, up to the head it named.
    let files = files_in(&d, &owner, "au");
    let (ok, out, err) = verify(&files);
    assert!(ok, "{err}");
    let (seq, hash) = head.split_once(' ').unwrap();
    let seq: u64 = seq.parse().unwrap();
    assert!(
        recs.iter().any(|r| r["hash"] == hash && r["seq"] == seq),
        "Audit-Head {head} names a record of the stream"
    );
    assert!(out.contains("ok: "), "{out}");
    // The head catches a copy cut after a whole line; without it that
    // copy verifies.
    let (ok, _, err) = verify_with(&files, &["--head", &head]);
    assert!(ok, "{err}");
    let text = std::fs::read_to_string(files.last().unwrap()).unwrap();
    let upto: Vec<&str> = text
        .lines()
        .take_while(|l| !l.contains(&format!("\"seq\":{seq},")))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cut = files[..files.len() - 1].to_vec();
    cut.push(copy_to(
        dir.path(),
        "cut.jsonl",
        (upto.join("\n") + "\n").as_bytes(),
    ));
    assert!(verify(&cut).0, "a cut copy alone verifies");
    let (ok, _, err) = verify_with(&cut, &["--head", &head]);
    assert!(!ok && err.contains("head"), "{err}");
    let mut bytes = std::fs::read(files.last().unwrap()).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x20;
    assert!(!verify(&[copy_to(dir.path(), "x.jsonl", &bytes)]).0);

    // Another key sees nothing of it; after the delete the owner still does.
    let other = h.post("/admin/keys", &json!({"name": "o", "scopes": ["exec"]}));
    assert!(other.status < 300, "{}", other.text());
    let token = other.json()["key"].as_str().unwrap().to_string();
    let r = h.with_key(&token).get("/v1/sessions/au/audit");
    assert_eq!(r.status, 404, "{}", r.text());
    // A follower sees records as they are written, and its stream ends
    // a few seconds after the session is gone.
    let (status, body) = h.get_stream("/v1/sessions/au/audit?follow=true");
    assert_eq!(status, 200);
    let (tx, rx) = std::sync::mpsc::channel::<Value>();
    let reader = std::thread::spawn(move || {
        for line in body.lines() {
            let Ok(line) = line else { break };
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                break;
            };
            if tx.send(v).is_err() {
                break;
            }
        }
    });
    let r = h.post(
        "/v1/sessions/au/exec",
        &json!({"argv": ["echo", "followed"]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let end = Instant::now() + Duration::from_secs(20);
    let mut seen = false;
    while Instant::now() < end && !seen {
        if let Ok(v) = rx.recv_timeout(Duration::from_millis(200)) {
            seen = v["kind"] == "exec" && v["argv"][1] == "followed";
        }
    }
    assert!(seen, "the follower got the new exec record");
    assert!(h.delete("/v1/sessions/au").status < 300);
    let t0 = Instant::now();
    reader.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(15), "the follow ended");
    let (recs, _) = audit_of(&h, "au");
    assert!(
        of(&recs, "session")
            .iter()
            .any(|r| r["event"] == "destroyed"),
        "{recs:?}"
    );
}

const SECRET: &str = "sk-audit-5f1e2d3c4b5a69788796a5b4";

#[test]
fn a_vm_session_with_secrets_forks_edits_and_types_into_a_pty() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "vm"}));
    assert_eq!(r.status, 201, "{}", r.text());
    // A script that forks children which edit files, with an env value
    // and a secret file.
    let r = h.post(
        "/v1/sessions/vm/exec",
        &json!({"command": "for i in 1 2 3; do (echo $i > /tmp/f$i) & done; wait; \
                            cat /run/secrets/TOKEN; cat /tmp/f1 /tmp/f2 /tmp/f3; \
                            cat /run/secrets/TOKEN > /workspace/leak.txt; \
                            echo more >> /etc/hostname",
                "env": {"MY_ENV": "env-value-plugh"}, "secrets": {"TOKEN": SECRET},
                "timeout": 60_000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["exitCode"], 0, "{}", r.text());
    let r = h.post(
        "/v1/sessions/vm/exec",
        &json!({"command": "read x; echo got $x", "background": true,
                "pty": {"rows": 24, "cols": 80}}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let pty = r.json()["procId"].as_u64().unwrap();
    let r = h.post_raw(
        &format!("/v1/sessions/vm/processes/{pty}/stdin"),
        b"pip install requests\n",
        "application/octet-stream",
    );
    assert!(r.status < 300, "{}", r.text());

    let (recs, _) = audit_of(&h, "vm");
    let owner = recs[0]["owner"].as_str().unwrap().to_string();
    let e = of(&recs, "exec")
        .into_iter()
        .find(|e| e["shell"].as_str().is_some_and(|s| s.contains("/tmp/f$i")))
        .expect("the script's exec record");
    assert_eq!(e["secretNames"], json!(["TOKEN"]));
    assert!(e["envNames"].as_array().unwrap().contains(&json!("MY_ENV")));
    let x = of(&recs, "exit")
        .into_iter()
        .find(|x| x["proc"] == e["proc"])
        .expect("its exit");
    assert_eq!(x["exitCode"], 0);
    assert!(of(&recs, "pty_input")
        .iter()
        .any(|r| r["data"] == "pip install requests\n"));

    // What the guest says the script did: its process tree (the three
    // subshells forked by the script's shell, the `cat`s it ran) and the
    // files it changed, each with size and sha256, diffs masked.
    let mine = |kind: &str| -> Vec<Value> {
        of(&recs, kind)
            .into_iter()
            .filter(|r| r["exec"] == e["proc"] && r["reportedBy"] == "guest")
            .cloned()
            .collect()
    };
    let procs = mine("proc");
    let root = procs
        .iter()
        .find(|p| p["event"] == "exec" && p["argv"][0] == "/bin/sh")
        .unwrap_or_else(|| panic!("the script's shell in {procs:?}"));
    let forks = procs
        .iter()
        .filter(|p| p["event"] == "fork" && p["ppid"] == root["pid"])
        .count();
    assert!(forks >= 3, "the subshells forked by the script: {procs:?}");
    assert!(
        procs
            .iter()
            .any(|p| p["event"] == "exec" && p["argv"][0] == "cat" && p["uid"] == 0),
        "{procs:?}"
    );
    assert!(procs.iter().any(|p| p["event"] == "exit"), "{procs:?}");
    let files = mine("file");
    let f1 = files
        .iter()
        .find(|f| f["path"] == "/tmp/f1")
        .unwrap_or_else(|| panic!("/tmp/f1 in {files:?}"));
    assert_eq!(f1["change"], "created");
    assert_eq!(f1["size"], 2);
    assert_eq!(
        f1["sha256"],
        "4355a46b19d348dc2f57c046f8ef63d4538ebb936000f3c9ee954a27460dd865"
    );
    let host = files
        .iter()
        .find(|f| f["path"] == "/etc/hostname")
        .unwrap_or_else(|| panic!("/etc/hostname in {files:?}"));
    assert_eq!(host["change"], "modified");
    assert!(
        host["diff"].as_str().unwrap_or("").contains("+more"),
        "{host}"
    );
    let leak = files
        .iter()
        .find(|f| f["path"] == "/workspace/leak.txt")
        .unwrap_or_else(|| panic!("/workspace/leak.txt in {files:?}"));
    assert!(
        leak["diff"].as_str().unwrap_or("").contains("****"),
        "the secret copied into a file is masked in its diff: {leak}"
    );
    assert!(
        !files
            .iter()
            .any(|f| f["path"].as_str().unwrap_or("").starts_with("/run")),
        "{files:?}"
    );
    assert_eq!(x["guest"]["procsTracked"], true, "{x}");
    assert_eq!(x["guest"]["filesTracked"], true, "{x}");

    // A flood of processes: a bounded record, the rest counted.
    let r = h.post(
        "/v1/sessions/vm/exec",
        &json!({"command": "for i in $(seq 1500); do /bin/true; done; echo flood-done",
                "timeout": 120_000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let (recs, _) = audit_of(&h, "vm");
    let fe = of(&recs, "exec")
        .into_iter()
        .find(|e| {
            e["shell"]
                .as_str()
                .is_some_and(|s| s.contains("flood-done"))
        })
        .expect("the flood's exec record");
    let fx = of(&recs, "exit")
        .into_iter()
        .find(|x| x["proc"] == fe["proc"])
        .expect("the flood's exit");
    let kept = of(&recs, "proc")
        .into_iter()
        .filter(|r| r["exec"] == fe["proc"])
        .count();
    let dropped = fx["guest"]["procsDropped"].as_u64().unwrap_or(0);
    assert!(kept <= 1000, "{kept} process records for one exec");
    assert!(
        dropped > 0 && kept as u64 + dropped >= 4500,
        "1500 forks, execs and exits: {kept} kept, {dropped} counted: {fx}"
    );

    let files = files_in(&d, &owner, "vm");
    for f in &files {
        let t = std::fs::read_to_string(f).unwrap();
        assert!(!t.contains(SECRET), "the secret value in {}", f.display());
        assert!(
            !t.contains("env-value-plugh"),
            "an env value in {}",
            f.display()
        );
    }
    assert!(verify(&files).0);
    let mut bytes = std::fs::read(files.last().unwrap()).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x01;
    let dir = tempfile::tempdir().unwrap();
    assert!(!verify(&[copy_to(dir.path(), "x.jsonl", &bytes)]).0);
}

/// The daemon's HTTP sink, under its seccomp filter, through a name it
/// resolves (`localhost`): what the session does arrives there.
#[test]
fn the_daemon_forwards_records_to_its_http_sink() {
    let (url, got) = sink_server(false);
    let url = url.replace("127.0.0.1", "localhost");
    let d = Daemon::start_local(&["--audit-http-url", &url]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "fw"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = h.post("/v1/sessions/fw/exec", &json!({"argv": ["true"]}));
    assert_eq!(r.status, 200, "{}", r.text());
    let end = Instant::now() + Duration::from_secs(20);
    let has_exit = || {
        got.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("\"kind\":\"exit\"") && l.contains("\"session\":\"fw\""))
    };
    while !has_exit() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        has_exit(),
        "records forwarded: {:?}; log: {}",
        got.lock().unwrap(),
        d.log()
    );
    assert!(!d.log().contains("forbidden syscall"), "{}", d.log());
}

/// The syslog sink from a daemon (config file `audit.syslog`), under the
/// writer's seccomp filter: each record as an RFC 5424 datagram.
#[test]
fn the_daemon_sends_records_to_syslog() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("log.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let cfg = dir.path().join("config.json");
    let c = json!({"audit": {"syslog": true, "syslog_socket": sock}});
    std::fs::write(&cfg, c.to_string()).unwrap();
    let d = Daemon::start_local(&["--config", cfg.to_str().unwrap()]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "sl"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let mut buf = vec![0u8; 65536];
    let n = rx.recv(&mut buf).expect("a datagram");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    let rec = msg
        .strip_prefix("<110>1 - - agent-sandbox - audit - ")
        .unwrap_or_else(|| panic!("RFC 5424 head: {msg}"));
    let v: Value = serde_json::from_str(rec).expect("the record");
    assert_eq!((&v["session"], &v["seq"]), (&json!("sl"), &json!(1)), "{v}");
    assert!(!d.log().contains("forbidden syscall"), "{}", d.log());
}
