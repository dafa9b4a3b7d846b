//! Processes over WebSocket (issue #26), through the real daemon and a real
//! guest: a PTY shell started by the socket (typed input, resize, the exit
//! as the last message, killed when its client vanishes), an attach to a
//! background process (stdin, EOF, detach on close), the same auth as the
//! API (a key, or a one-use ticket for browsers), bad messages refused
//! harmlessly; and a browser terminal (xterm.js from npm in headless
//! Chromium, typed into over the DevTools protocol) driving a guest shell.

mod common;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/ws.rs"]
mod ws;

use common::daemon::{stdout_of, Daemon, Http};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};
use ws::{Frame, Ws};

fn addr(d: &Daemon) -> String {
    d.base.trim_start_matches("http://").to_string()
}

fn auth(d: &Daemon) -> String {
    format!("Authorization: Bearer {}\r\n", d.key)
}

fn sh(h: &Http, id: &str, cmd: &str) -> String {
    let r = h.post(
        &format!("/v1/sessions/{id}/exec"),
        &json!({"command": cmd, "timeout": 60_000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    stdout_of(&r.json())
}

/// Reads messages until the terminal's output (all `stream` data so far)
/// satisfies `done`; the output.
fn until(w: &mut Ws, seen: &mut String, what: &str, done: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    while !done(seen) {
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {seen:?}");
        match w.recv_json() {
            Some(v) if v["type"] == "stream" => seen.push_str(v["data"].as_str().unwrap_or("")),
            Some(v) if v["type"] == "started" || v["type"] == "dropped" => {}
            other => panic!("{what}: {other:?} after {seen:?}"),
        }
    }
}

/// Whether a line of the terminal's output is exactly `line`.
fn has_line(out: &str, line: &str) -> bool {
    out.split(['\r', '\n']).any(|l| l.trim() == line)
}

fn gone(h: &Http, id: &str, pattern: &str) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        let out = sh(h, id, &format!("pgrep -f '{pattern}' || echo none"));
        if out.trim() == "none" {
            return true;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    false
}

/// Starts a background command in session `t` and attaches a socket to it.
fn attach_new(d: &Daemon, body: Value) -> Ws {
    let r = d.http().post("/v1/sessions/t/exec", &body);
    assert_eq!(r.status, 202, "{}", r.text());
    let proc = r.json()["procId"].as_u64().unwrap();
    Ws::connect(
        &addr(d),
        &format!("/v1/sessions/t/processes/{proc}/ws"),
        &auth(d),
    )
    .expect("attach")
}

#[test]
fn processes_over_websocket() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let d = Daemon::start(&[]);
    let h = d.http();
    let a = addr(&d);
    for id in ["t", "u"] {
        let r = h.post("/v1/sessions", &json!({"id": id}));
        assert_eq!(r.status, 201, "{}", r.text());
    }

    // A PTY shell: typed input, its echo and answer, a resize, the exit
    // as the last message.
    let mut w =
        Ws::connect(&a, "/v1/sessions/t/pty/ws?rows=24&cols=80", &auth(&d)).expect("upgrade");
    let first = w.recv_json().expect("a first message");
    assert_eq!(first["type"], "started", "{first}");
    assert!(first["procId"].as_u64().is_some(), "{first}");
    let mut out = String::new();
    w.json(&json!({"type": "stdin", "data": "echo $((6*7))\n"}));
    until(&mut w, &mut out, "6*7", |o| has_line(o, "42"));
    w.json(&json!({"type": "resize", "rows": 30, "cols": 100}));
    std::thread::sleep(Duration::from_millis(300));
    // Binary frames are stdin bytes too.
    w.send(0x2, b"stty size\n");
    until(&mut w, &mut out, "stty size", |o| has_line(o, "30 100"));
    // Bad messages: an error each, the shell unharmed.
    w.json(&json!({"type": "nope"}));
    let e = loop {
        let v = w.recv_json().expect("an answer to a bad message");
        if v["type"] == "error" {
            break v;
        }
    };
    assert_eq!(e["error"]["code"], "bad_request", "{e}");
    w.json(&json!({"type": "resize", "rows": 0, "cols": 5}));
    let e = loop {
        let v = w.recv_json().expect("an answer to a bad resize");
        if v["type"] == "error" {
            break v;
        }
    };
    assert_eq!(e["error"]["code"], "bad_request", "{e}");
    w.json(&json!({"type": "stdin", "data": "exit 3\n"}));
    let last = loop {
        match w.recv() {
            Some(Frame::Text(t)) => {
                let v: Value = serde_json::from_str(&t).unwrap();
                if v["type"] == "result" {
                    break v;
                }
            }
            other => panic!("before the result: {other:?}"),
        }
    };
    assert_eq!(last["exitCode"], 3, "{last}");
    assert_eq!(
        w.recv(),
        Some(Frame::Close(1000)),
        "a close after the result"
    );

    // Not an upgrade: a plain 400; no key: 401; another's session: 404.
    let r = h.get("/v1/sessions/t/pty/ws");
    assert_eq!(r.status, 400, "{}", r.text());
    let refused = Ws::connect(&a, "/v1/sessions/t/pty/ws", "")
        .err()
        .expect("no key");
    assert_eq!(refused.status, 401, "{}", refused.text);
    let refused = Ws::connect(&a, "/v1/sessions/none/pty/ws", &auth(&d))
        .err()
        .expect("no such session");
    assert_eq!(refused.status, 404, "{}", refused.text);

    // A ticket for browsers: one connection, its own session only.
    let ticket = |id: &str| {
        let r = h.post(&format!("/v1/sessions/{id}/ws-token"), &json!({}));
        assert_eq!(r.status, 201, "{}", r.text());
        let v = r.json();
        assert_eq!(v["ttl"], 60, "{v}");
        v["token"].as_str().unwrap().to_string()
    };
    let t1 = ticket("t");
    let path = format!("/v1/sessions/t/pty/ws?token={t1}&command=exec+sleep+4242");
    let mut w = Ws::connect(&a, &path, "").expect("a ticket opens it");
    assert_eq!(w.recv_json().unwrap()["type"], "started");
    let refused = Ws::connect(&a, &path, "").err().expect("used up");
    assert_eq!(refused.status, 401, "{}", refused.text);
    let t2 = ticket("t");
    let refused = Ws::connect(&a, &format!("/v1/sessions/u/pty/ws?token={t2}"), "")
        .err()
        .expect("another session's ticket");
    assert_eq!(refused.status, 401, "{}", refused.text);
    let r = h.get(&format!("/v1/sessions/t/processes?token={}", ticket("t")));
    assert_eq!(r.status, 200, "the key still works beside a ticket");
    let http_only = h.anonymous();
    let r = http_only.get(&format!("/v1/sessions/t/processes?token={}", ticket("t")));
    assert_eq!(r.status, 401, "a ticket opens WebSocket routes only");

    // The client vanishes: its foreground shell is killed.
    assert!(
        !gone(&h, "t", "sleep 424[2]"),
        "the shell runs while connected"
    );
    let _ = w.s.shutdown(std::net::Shutdown::Both);
    drop(w);
    assert!(gone(&h, "t", "sleep 424[2]"), "killed with its client");

    // An attach to a background process: stdin, EOF, its exit.
    let mut w = attach_new(&d, json!({"argv": ["cat"], "background": true}));
    w.send(0x2, b"hello over ws\n");
    let mut out = String::new();
    until(&mut w, &mut out, "cat", |o| o.contains("hello over ws\n"));
    w.json(&json!({"type": "eof"}));
    let last = loop {
        let v = w.recv_json().expect("until the result");
        if v["type"] == "result" {
            break v;
        }
    };
    assert_eq!(last["exitCode"], 0, "{last}");
    let refused = Ws::connect(&a, "/v1/sessions/t/processes/99999/ws", &auth(&d))
        .err()
        .expect("an unknown process");
    assert_eq!(refused.status, 404, "{}", refused.text);

    // Closing an attach detaches: the process runs on.
    let mut w = attach_new(
        &d,
        json!({"command": "exec sleep 4343", "background": true}),
    );
    w.send(0x8, &1000u16.to_be_bytes());
    assert_eq!(w.recv(), Some(Frame::Close(1000)), "the close echoed");
    std::thread::sleep(Duration::from_secs(1));
    assert!(!gone(&h, "t", "sleep 434[3]"), "a detach leaves it running");
}

/// The page: xterm.js on a WebSocket to the daemon; `window.termText()` is
/// the terminal's text, `window.fit(cols, rows)` resizes both ends.
const PAGE: &str = r#"<!doctype html><html><head>
<link rel="stylesheet" href="/xterm.css"><script src="/xterm.js"></script></head>
<body style="margin:0;background:#000"><div id="term"></div><script>
const q = new URLSearchParams(location.search);
const term = new Terminal({cols: 80, rows: 24});
term.open(document.getElementById("term"));
const ws = new WebSocket(q.get("ws"));
window.state = "connecting";
ws.onmessage = (e) => {
  const m = JSON.parse(e.data);
  if (m.type === "started") { window.state = "started"; term.focus(); }
  if (m.type === "stream") term.write(m.data);
  if (m.type === "result") window.state = "exited " + m.exitCode;
};
ws.onclose = () => { if (window.state === "connecting") window.state = "refused"; };
term.onData((d) => ws.send(JSON.stringify({type: "stdin", data: d})));
window.fit = (cols, rows) => { term.resize(cols, rows); ws.send(JSON.stringify({type: "resize", rows, cols})); };
window.termText = () => {
  const b = term.buffer.active, out = [];
  for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true));
  return out.join("\n");
};
</script></body></html>
"#;

/// xterm.js from npm into `dir`: its script and stylesheet.
fn xterm(dir: &Path) -> Option<(Vec<u8>, Vec<u8>)> {
    let out = std::process::Command::new("npm")
        .args([
            "install",
            "--no-audit",
            "--no-fund",
            "--prefer-offline",
            "--no-save",
            "@xterm/xterm@5",
        ])
        .current_dir(dir)
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "npm install @xterm/xterm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = dir.join("node_modules/@xterm/xterm");
    Some((
        std::fs::read(m.join("lib/xterm.js")).expect("xterm.js"),
        std::fs::read(m.join("css/xterm.css")).expect("xterm.css"),
    ))
}

/// Serves the page and xterm.js on loopback from its own thread.
fn serve_page(js: Vec<u8>, css: Vec<u8>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let mut c = c;
            let mut r = BufReader::new(c.try_clone().unwrap());
            let mut line = String::new();
            if r.read_line(&mut line).is_err() {
                continue;
            }
            loop {
                let mut h = String::new();
                if r.read_line(&mut h).is_err() || h == "\r\n" || h.is_empty() {
                    break;
                }
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/");
            let (ct, body): (&str, &[u8]) = if path.starts_with("/xterm.js") {
                ("text/javascript", &js)
            } else if path.starts_with("/xterm.css") {
                ("text/css", &css)
            } else {
                ("text/html", PAGE.as_bytes())
            };
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = c.write_all(body);
        }
    });
    at
}

fn wait_screen(b: &mut ws::Browser, what: &str, done: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let s = b.eval("window.termText ? window.termText() : ''");
        let s = s.as_str().unwrap_or("").to_string();
        if done(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: the screen shows\n{s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Types `text` then Enter, as a keyboard would.
fn type_line(b: &mut ws::Browser, text: &str) {
    b.cdp("Input.insertText", json!({"text": text}));
    for ty in ["keyDown", "keyUp"] {
        b.cdp(
            "Input.dispatchKeyEvent",
            json!({"type": ty, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13,
                   "nativeVirtualKeyCode": 13, "text": if ty == "keyDown" { "\r" } else { "" }}),
        );
    }
}

#[test]
fn a_browser_terminal_drives_a_guest_shell() {
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let Some(bin) = common::chromium() else {
        skip!("no chromium on this host (images/install-deps.sh installs it)");
    };
    let dir = tempfile::tempdir().unwrap();
    let Some((js, css)) = xterm(dir.path()) else {
        skip!("npm is needed to fetch xterm.js (images/install-deps.sh installs it)");
    };
    let d = Daemon::start(&[]);
    let h = d.http();
    let r = h.post("/v1/sessions", &json!({"id": "b"}));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = h.post("/v1/sessions/b/ws-token", &json!({}));
    assert_eq!(r.status, 201, "{}", r.text());
    let token = r.json()["token"].as_str().unwrap().to_string();
    let page = serve_page(js, css);
    let ws_url = format!("ws://{}/v1/sessions/b/pty/ws?token={token}", addr(&d));
    let url = format!(
        "http://{page}/?ws={}",
        ws_url
            .replace(':', "%3A")
            .replace('/', "%2F")
            .replace('?', "%3F")
            .replace('=', "%3D")
    );
    let mut b = ws::Browser::open(bin, dir.path(), &url, &page);
    let t0 = Instant::now();
    loop {
        let st = b.eval("window.state || ''");
        if st == "started" {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the page's socket: {st}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_screen(&mut b, "a prompt", |s| !s.trim().is_empty());

    type_line(&mut b, "echo $((6*7))");
    let screen = wait_screen(&mut b, "6*7 typed", |s| has_line(s, "42"));
    assert!(
        screen.contains("echo $((6*7))"),
        "the typed line echoed:\n{screen}"
    );
    let png = b.screenshot();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 2000,
        "{} bytes",
        png.len()
    );
    let out = std::env::var("AGENT_SANDBOX_ARTIFACTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| dir.path().to_path_buf());
    let _ = std::fs::create_dir_all(&out);
    let file = out.join("terminal-42.png");
    std::fs::write(&file, &png).unwrap();
    eprintln!(
        "FIGURE browser_terminal_screenshot_bytes {} ({})",
        png.len(),
        file.display()
    );

    b.eval("window.fit(100, 30), true");
    std::thread::sleep(Duration::from_millis(300));
    type_line(&mut b, "stty size");
    wait_screen(&mut b, "stty size after a resize", |s| {
        has_line(s, "30 100")
    });
    type_line(&mut b, "exit 7");
    let t0 = Instant::now();
    while b.eval("window.state") != "exited 7" {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the exit reached the page"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = sh(&h, "b", "true");
}
