//! Guest ports reached from outside (preview URLs, issue #26), through the
//! real daemon, real guests and the preview listener: a guest web server
//! by path and by host, a server-sent stream that arrives as it is
//! written, a WebSocket echo; a wrong, expired, closed or other session's
//! token gets nothing and reaches no guest; a port that is not public
//! needs the owner's key, which the guest never sees; a paused session's
//! ports answer 503 until it resumes.
//!
//! Networking is on, in a test uplink namespace (`tests/common/netns.rs`);
//! the guests' servers are reached only by the daemon.

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/ws.rs"]
mod ws;

use common::daemon::{stdout_of, Daemon};
use netns::{is_root, Topology};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const DOMAIN: &str = "preview.test";

fn daemon(topo: &Topology) -> Daemon {
    let mut args = common::daemon::net_args(&topo.host_path(), None);
    args.extend(
        [
            "--preview-listen",
            "127.0.0.1:0",
            "--preview-domain",
            DOMAIN,
        ]
        .map(String::from),
    );
    Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn sh(d: &Daemon, s: &str, cmd: &str) -> String {
    let r = d.http().post(
        &format!("/v1/sessions/{s}/exec"),
        &json!({"command": cmd, "timeout": 60_000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["exitCode"], 0, "{cmd}: {v}");
    stdout_of(&v)
}

/// Starts `script` (python3) in the background in session `s` and waits
/// until it listens on `port` inside the guest.
fn guest_server(d: &Daemon, s: &str, port: u16, script: &str) {
    guest_server_in(d, s, port, "python3", script)
}

/// [`guest_server`] with another interpreter (`node`).
fn guest_server_in(d: &Daemon, s: &str, port: u16, interp: &str, script: &str) {
    let flag = if interp == "node" { "-e" } else { "-c" };
    let r = d.http().post(
        &format!("/v1/sessions/{s}/exec"),
        &json!({"argv": [interp, flag, script], "background": true}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let probe = format!(
        "for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)' \
         2>/dev/null && exit 0; sleep 0.1; done; exit 1"
    );
    sh(d, s, &probe);
}

/// A directory listing server, logging each request path to /tmp/seen.
const FILES: &str = r#"
import http.server, os
os.chdir("/workspace")
class H(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *a):
        h = self.headers
        open("/tmp/seen", "a").write("%s %s auth=%s cookie=%s tok=%s\n" % (self.command, self.path, h.get("Authorization"), h.get("Cookie"), h.get("X-Asbx-Token")))
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

/// Five server-sent events, 300 ms apart.
const SSE: &str = r#"
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(5):
            self.wfile.write(b"data: %d\n\n" % i)
            self.wfile.flush()
            time.sleep(0.3)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8001), H).serve_forever()
"#;

/// A node WebSocket echo server (RFC 6455 handshake on `http`'s upgrade,
/// unfragmented frames), logging each message to /tmp/ws-seen.
const WS: &str = r#"
const http = require("http"), crypto = require("crypto"), fs = require("fs");
const srv = http.createServer((q, r) => { r.end("ws only\n"); });
srv.on("upgrade", (req, sock) => {
  const acc = crypto.createHash("sha1")
    .update(req.headers["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest("base64");
  sock.write("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" +
             "Sec-WebSocket-Accept: " + acc + "\r\n\r\n");
  let buf = Buffer.alloc(0);
  sock.on("data", (d) => {
    buf = Buffer.concat([buf, d]);
    for (;;) {
      if (buf.length < 2) return;
      let n = buf[1] & 127, off = 2;
      if (n === 126) { if (buf.length < 4) return; n = buf.readUInt16BE(2); off = 4; }
      if (buf.length < off + 4 + n) return;
      const mask = buf.slice(off, off + 4), data = Buffer.alloc(n);
      for (let i = 0; i < n; i++) data[i] = buf[off + 4 + i] ^ mask[i % 4];
      const op = buf[0] & 15;
      buf = buf.slice(off + 4 + n);
      if (op === 8) { sock.end(); return; }
      fs.appendFileSync("/tmp/ws-seen", data.toString() + "\n");
      const head = n < 126 ? Buffer.from([0x81, n]) : Buffer.from([0x81, 126, n >> 8, n & 255]);
      sock.write(Buffer.concat([head, data]));
    }
  });
});
srv.listen(8002, "0.0.0.0");
"#;

/// `host:port` of a preview URL.
fn addr_of(url: &str) -> String {
    url.trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

/// One request to the preview listener: status and body.
fn raw(addr: &str, path: &str, host: &str, extra: &str) -> (u16, String) {
    common::daemon::raw_get(addr, path, host, extra)
}

/// One request to the preview listener: status and the whole answer.
fn raw_whole(addr: &str, path: &str, host: &str, extra: &str) -> (u16, String) {
    common::daemon::raw_get_whole(addr, path, host, extra)
}

fn expose(d: &Daemon, s: &str, body: Value) -> Value {
    let r = d.http().post(&format!("/v1/sessions/{s}/ports"), &body);
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

fn path_of(url: &str) -> String {
    let rest = url.trim_start_matches("http://");
    rest[rest.find('/').unwrap()..].to_string()
}

#[test]
fn guest_ports_through_preview_urls() {
    if !is_root() || !common::daemon::vm_backend() {
        skip!("needs root and the QEMU backend (guest images)");
    }
    let topo = Topology::new("prv");
    let d = daemon(&topo);
    let h = d.http();
    for id in ["a", "b"] {
        let r = h.post("/v1/sessions", &json!({"id": id, "template": "dev"}));
        assert_eq!(r.status, 201, "{}", r.text());
        sh(&d, id, &format!("echo from-{id} > /workspace/who.txt"));
        guest_server(&d, id, 8000, FILES);
    }
    let key_header = format!("Authorization: Bearer {}\r\n", d.key);

    // Not public: the URL alone gets 401 and reaches no guest; with the
    // owner's key the guest answers, and never sees the key.
    let p = expose(&d, "a", json!({"port": 8000}));
    assert_eq!(p["public"], false);
    let url = p["url"].as_str().unwrap().to_string();
    let addr = addr_of(&url);
    let path = path_of(&url);
    assert!(path.starts_with("/ports/") && path.ends_with('/'), "{url}");
    let (st, _) = raw(&addr, &format!("{path}who.txt"), &addr, "");
    assert_eq!(st, 401);
    let (st, body) = raw(&addr, &format!("{path}who.txt"), &addr, &key_header);
    assert_eq!((st, body.as_str()), (200, "from-a\n"));
    let seen = sh(&d, "a", "cat /tmp/seen");
    assert_eq!(
        seen, "GET /who.txt auth=None cookie=None tok=None\n",
        "what the guest saw"
    );

    // Public: a new token; the old URL is dead; no key needed, by path
    // and by host.
    let p = expose(&d, "a", json!({"port": 8000, "public": true, "ttl": 60}));
    let (st, _) = raw(&addr, &format!("{path}who.txt"), &addr, &key_header);
    assert_eq!(st, 404, "the replaced token");
    let pub_path = path_of(p["url"].as_str().unwrap());
    let (st, body) = raw(&addr, &format!("{pub_path}who.txt"), &addr, "");
    assert_eq!((st, body.as_str()), (200, "from-a\n"));
    // The host form `<port>-<session>.<domain>`: the URL's query token
    // becomes a host-only cookie (307 back without it); the cookie or an
    // X-Asbx-Token header opens it; the guest sees neither.
    let host_url = p["hostUrl"]
        .as_str()
        .expect("hostUrl with a preview domain");
    let lport = addr.rsplit(':').next().unwrap();
    let host = addr_of(host_url);
    assert_eq!(host, format!("8000-a.{DOMAIN}:{lport}"), "{host_url}");
    let token = host_url.split_once("?asbx_token=").expect("token").1;
    assert_eq!(
        path_of(p["url"].as_str().unwrap()),
        format!("/ports/{token}/")
    );
    let (st, whole) = raw_whole(&addr, &format!("/who.txt?asbx_token={token}"), &host, "");
    assert_eq!(st, 307, "{whole}");
    assert!(whole.contains("\r\nLocation: /who.txt\r\n"), "{whole}");
    assert!(
        whole.contains(&format!(
            "\r\nSet-Cookie: asbx_token={token}; Path=/; HttpOnly; SameSite=Lax\r\n"
        )),
        "{whole}"
    );
    let cookie = format!("Cookie: app=1; asbx_token={token}\r\n");
    let (st, body) = raw(&addr, "/who.txt", &host, &cookie);
    assert_eq!((st, body.as_str()), (200, "from-a\n"), "host form, cookie");
    let (st, body) = raw(
        &addr,
        "/who.txt",
        &host,
        &format!("X-Asbx-Token: {token}\r\n"),
    );
    assert_eq!((st, body.as_str()), (200, "from-a\n"), "host form, header");
    let (st, _) = raw(&addr, "/who.txt", &host, "");
    assert_eq!(st, 401, "host form without a token");
    for other in [format!("8001-a.{DOMAIN}"), format!("8000-b.{DOMAIN}")] {
        let (st, _) = raw(&addr, "/who.txt", &other, &cookie);
        assert_eq!(st, 404, "a's token on {other}");
        let (st, _) = raw(&addr, &format!("/?asbx_token={token}"), &other, "");
        assert_eq!(st, 404, "a's token in the query of {other}");
    }
    let seen = sh(&d, "a", "tail -n 2 /tmp/seen");
    assert_eq!(
        seen,
        "GET /who.txt auth=None cookie=app=1 tok=None\nGET /who.txt auth=None cookie=None tok=None\n",
        "the guest sees neither the cookie nor the header"
    );

    // Wrong tokens, by path and host, and another session's: nothing.
    let bad = "0123456789abcdef0123456789abcdef";
    let bad_tok = format!("X-Asbx-Token: {bad}\r\n{key_header}");
    for (p, host, extra) in [
        (
            format!("/ports/{bad}/who.txt"),
            addr.clone(),
            key_header.clone(),
        ),
        (
            "/ports/nope/who.txt".to_string(),
            addr.clone(),
            key_header.clone(),
        ),
        (
            "/who.txt".to_string(),
            format!("{bad}.{DOMAIN}"),
            key_header.clone(),
        ),
        (
            "/who.txt".to_string(),
            format!("8000-a.{DOMAIN}"),
            bad_tok.clone(),
        ),
        (
            "/who.txt".to_string(),
            "elsewhere.test".to_string(),
            key_header.clone(),
        ),
    ] {
        let (st, _) = raw(&addr, &p, &host, &extra);
        assert_eq!(st, 404, "{p} {host}");
    }
    // A body over the passthrough limit: 413, nothing reaches the guest.
    let (st, _) = raw(
        &addr,
        &format!("{pub_path}who.txt"),
        &addr,
        "Content-Length: 300000000\r\n",
    );
    assert_eq!(st, 413, "a body over the limit");
    let pb = expose(&d, "b", json!({"port": 8000, "public": true}));
    let b_path = path_of(pb["url"].as_str().unwrap());
    let (_, body) = raw(&addr, &format!("{b_path}who.txt"), &addr, "");
    assert_eq!(body, "from-b\n", "b's token reaches b");
    let (_, body) = raw(&addr, &format!("{pub_path}who.txt"), &addr, "");
    assert_eq!(body, "from-a\n", "a's token reaches a only");
    let seen = sh(&d, "a", "cat /tmp/seen");
    assert_eq!(
        seen.lines().count(),
        5,
        "only the good requests reached a:\n{seen}"
    );

    // Listed; closed: gone.
    let list = h.get("/v1/sessions/b/ports").json();
    assert_eq!(list["ports"][0]["port"], 8000, "{list}");
    assert_eq!(h.delete("/v1/sessions/b/ports/8000").status, 200);
    assert_eq!(h.delete("/v1/sessions/b/ports/8000").status, 404);
    let (st, _) = raw(&addr, &format!("{b_path}who.txt"), &addr, "");
    assert_eq!(st, 404, "a closed port");

    // A TTL passes.
    let short = expose(&d, "b", json!({"port": 8000, "public": true, "ttl": 1}));
    let short_path = path_of(short["url"].as_str().unwrap());
    std::thread::sleep(Duration::from_millis(1500));
    let (st, _) = raw(&addr, &format!("{short_path}who.txt"), &addr, "");
    assert_eq!(st, 404, "an expired token");

    // Server-sent events arrive as the guest writes them.
    guest_server(&d, "a", 8001, SSE);
    let sse = expose(&d, "a", json!({"port": 8001, "public": true}));
    let mut c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "GET {}events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n",
        path_of(sse["url"].as_str().unwrap())
    )
    .unwrap();
    let t0 = Instant::now();
    let mut got = String::new();
    let mut when = Vec::new();
    let mut b = [0u8; 1024];
    while when.len() < 5 {
        let n = c.read(&mut b).unwrap();
        assert!(n > 0, "stream ended early: {got}");
        got.push_str(&String::from_utf8_lossy(&b[..n]));
        while when.len() < got.matches("data: ").count() {
            when.push(t0.elapsed());
        }
    }
    assert!(got.contains("data: 4\n\n"), "{got}");
    let spread = when[4] - when[0];
    assert!(
        spread >= Duration::from_millis(900),
        "events came together ({when:?}), not as written"
    );

    // A WebSocket through the preview URL: upgrade, echo, close.
    guest_server_in(&d, "a", 8002, "node", WS);
    let ws = expose(&d, "a", json!({"port": 8002, "public": true}));
    let mut c = TcpStream::connect(&addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        c,
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        path_of(ws["url"].as_str().unwrap())
    )
    .unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = c.read(&mut b).unwrap();
        assert!(n > 0);
        head.extend_from_slice(&b[..n]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(head.contains("s3pPLMBiTxaQ9kYGzzhZRbK+xOo="), "{head}");
    let msg = b"hello guest";
    let mask = [1u8, 2, 3, 4];
    let mut frame = vec![0x81, 0x80 | msg.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(msg.iter().enumerate().map(|(i, x)| x ^ mask[i % 4]));
    c.write_all(&frame).unwrap();
    let mut echo = [0u8; 2 + 11];
    c.read_exact(&mut echo).unwrap();
    assert_eq!(&echo[2..], msg, "the echo");

    // A real browser (headless Chromium) renders a page the guest
    // serves: its script runs and fetches a relative URL through the
    // preview; a screenshot of it is taken.
    browser(&d, &pub_path, &addr, ws["url"].as_str().unwrap());

    // Paused: 503 and nothing; resumed: the same URL works again.
    let r = h.post("/v1/sessions/a/pause", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (st, _) = raw(&addr, &format!("{pub_path}who.txt"), &addr, "");
    assert_eq!(st, 503, "a paused session's port");
    let r = h.post("/v1/sessions/a/resume", &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (st, body) = raw(&addr, &format!("{pub_path}who.txt"), &addr, "");
    assert_eq!((st, body.as_str()), (200, "from-a\n"), "after resume");

    // Bad requests; a session's end closes its ports.
    for (body, want) in [
        (json!({"port": 0}), 400),
        (json!({"port": 70000}), 400),
        (json!({"port": 80, "ttl": "2d"}), 400),
        (json!({"port": 80, "extra": 1}), 400),
    ] {
        let r = h.post("/v1/sessions/a/ports", &body);
        assert_eq!(r.status, want, "{body}: {}", r.text());
    }
    assert_eq!(h.delete("/v1/sessions/a").status, 200);
    let (st, _) = raw(&addr, &format!("{pub_path}who.txt"), &addr, "");
    assert_eq!(st, 404, "a deleted session's port");
}

/// The guest's page: its script runs, fetches a relative URL and talks to
/// the guest's WebSocket echo through that port's own preview URL.
const PAGE: &str = r#"<!doctype html><html><body><h1 id="out">not run</h1><p id="who">?</p>
<p id="echo">no echo</p>
<script>
document.getElementById("out").textContent = "rendered " + (6 * 7);
fetch("who.txt").then(r => r.text()).then(t => { document.getElementById("who").textContent = "fetched " + t; });
const ws = new WebSocket("WSURL");
ws.onopen = () => ws.send("from-browser");
ws.onmessage = (e) => { document.getElementById("echo").textContent = "echo " + e.data; };
</script></body></html>
"#;

fn browser(d: &Daemon, path: &str, addr: &str, ws_url: &str) {
    let Some(bin) = common::chromium() else {
        skip::not_checked("no chromium on this host (images/install-deps.sh installs it)");
        return;
    };
    let page = PAGE
        .replace("WSURL", &ws_url.replacen("http://", "ws://", 1))
        .replace('\'', "'\\''");
    sh(
        d,
        "a",
        &format!("printf '%s' '{page}' > /workspace/page.html"),
    );
    let url = format!("http://{addr}{path}page.html");
    let dir = tempfile::tempdir().unwrap();
    let mut b = ws::Browser::open(bin, dir.path(), &url, "page.html");
    let text = |id: &str| format!("document.getElementById('{id}').textContent");
    let done = format!(
        "{} === 'rendered 42' && {} === 'fetched from-a\\n' && {} === 'echo from-browser'",
        text("out"),
        text("who"),
        text("echo")
    );
    if !b.wait_for(&done, Duration::from_secs(60)) {
        let dom = b.eval("document.body.innerText");
        panic!("the page did not run, fetch and echo through the preview: {dom}");
    }
    let seen = sh(d, "a", "cat /tmp/ws-seen");
    assert!(
        seen.lines().any(|l| l == "from-browser"),
        "the browser's WebSocket message reached the guest: {seen:?}"
    );
    let png = b.screenshot();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 2000,
        "{} bytes",
        png.len()
    );
    eprintln!(
        "chromium screenshot of the guest's page: {} bytes",
        png.len()
    );
}
