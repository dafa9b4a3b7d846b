//! A small blocking WebSocket client (RFC 6455) for the tests: the
//! daemon's process endpoints and Chromium's DevTools socket.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub struct Ws {
    pub s: TcpStream,
}

#[derive(Debug, PartialEq)]
pub enum Frame {
    Text(String),
    Binary(Vec<u8>),
    Close(u16),
}

/// The answer to a handshake that was refused: status and whole text.
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub text: String,
}

impl Ws {
    /// Connects to `addr` and upgrades `path` with `headers` (lines with
    /// their CRLF).
    pub fn connect(addr: &str, path: &str, headers: &str) -> Result<Ws, Refused> {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).unwrap_or(0) == 0 {
                break;
            }
            head.push(b[0]);
        }
        let text = String::from_utf8_lossy(&head).to_string();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        if status != 101 {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            return Err(Refused {
                status,
                text: text + &String::from_utf8_lossy(&rest),
            });
        }
        assert!(
            text.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
            "{text}"
        );
        Ok(Ws { s })
    }

    pub fn send(&mut self, opcode: u8, payload: &[u8]) {
        let mask = [0x37u8, 0xfa, 0x21, 0x3d];
        let mut f = vec![0x80 | opcode];
        match payload.len() {
            n @ 0..=125 => f.push(0x80 | n as u8),
            n @ 126..=0xffff => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(0x80 | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.s.write_all(&f).expect("websocket send");
    }

    pub fn text(&mut self, t: &str) {
        self.send(0x1, t.as_bytes());
    }

    pub fn json(&mut self, v: &serde_json::Value) {
        self.text(&v.to_string());
    }

    /// The next data or close frame (pings answered, pongs skipped);
    /// `None` when the connection ended.
    pub fn recv(&mut self) -> Option<Frame> {
        loop {
            let mut h = [0u8; 2];
            self.s.read_exact(&mut h).ok()?;
            let mut len = (h[1] & 0x7f) as u64;
            if len == 126 {
                let mut b = [0u8; 2];
                self.s.read_exact(&mut b).ok()?;
                len = u16::from_be_bytes(b) as u64;
            } else if len == 127 {
                let mut b = [0u8; 8];
                self.s.read_exact(&mut b).ok()?;
                len = u64::from_be_bytes(b);
            }
            assert_eq!(h[1] & 0x80, 0, "server frames are not masked");
            let mut p = vec![0u8; len as usize];
            self.s.read_exact(&mut p).ok()?;
            match h[0] & 0x0f {
                0x1 => return Some(Frame::Text(String::from_utf8(p).expect("utf-8 text"))),
                0x2 => return Some(Frame::Binary(p)),
                0x8 => {
                    let code = p
                        .get(..2)
                        .map_or(1005, |c| u16::from_be_bytes([c[0], c[1]]));
                    return Some(Frame::Close(code));
                }
                0x9 => self.send(0xA, &p),
                _ => {}
            }
        }
    }

    /// The next text frame as JSON; `None` at a close or the end.
    pub fn recv_json(&mut self) -> Option<serde_json::Value> {
        match self.recv()? {
            Frame::Text(t) => Some(serde_json::from_str(&t).expect("a JSON message")),
            _ => None,
        }
    }
}

/// Headless Chromium with its DevTools socket on the page it opened: the
/// browser tests drive real pages with it (evaluate, type, screenshot).
pub struct Browser {
    child: std::process::Child,
    page: Ws,
    id: u64,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A GET of `path` on the DevTools HTTP endpoint (which keeps connections
/// open: read by Content-Length).
fn devtools_get(addr: &str, path: &str) -> serde_json::Value {
    use std::io::BufRead;
    let mut c = TcpStream::connect(addr).expect("DevTools endpoint");
    write!(c, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = std::io::BufReader::new(c);
    let mut len = 0usize;
    loop {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
            break;
        }
        if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut b = vec![0u8; len];
    let _ = r.read_exact(&mut b);
    serde_json::from_slice(&b).unwrap_or(serde_json::json!([]))
}

impl Browser {
    /// Starts `bin` on `url` (profile under `dir`) and attaches to the
    /// page whose URL contains `marker`.
    pub fn open(bin: &str, dir: &std::path::Path, url: &str, marker: &str) -> Browser {
        use std::io::BufRead;
        let mut child = std::process::Command::new(bin)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-proxy-server",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--window-size=900,600",
            ])
            .arg(format!("--user-data-dir={}", dir.join("profile").display()))
            .arg(url)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start chromium");
        let stderr = child.stderr.take().unwrap();
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
        let mut lines = std::io::BufReader::new(stderr).lines();
        let devtools = loop {
            let l = lines
                .next()
                .expect("chromium printed no DevTools address")
                .unwrap();
            if let Some(u) = l.split("DevTools listening on ws://").nth(1) {
                break u.split('/').next().unwrap().to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        let t0 = std::time::Instant::now();
        let page_ws = loop {
            let list = devtools_get(&devtools, "/json/list");
            let hit = list.as_array().and_then(|a| {
                a.iter()
                    .find(|t| {
                        t["type"] == "page" && t["url"].as_str().unwrap_or("").contains(marker)
                    })
                    .and_then(|t| t["webSocketDebuggerUrl"].as_str())
                    .map(str::to_string)
            });
            if let Some(u) = hit {
                break u;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no page target: {list}"
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        let path = format!(
            "/{}",
            page_ws
                .trim_start_matches("ws://")
                .split_once('/')
                .unwrap()
                .1
        );
        let page = Ws::connect(&devtools, &path, "").expect("DevTools socket");
        page.s
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Browser { child, page, id: 0 }
    }

    /// One DevTools call: its result.
    pub fn cdp(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        self.id += 1;
        let id = self.id;
        self.page
            .json(&serde_json::json!({"id": id, "method": method, "params": params}));
        loop {
            let v = self.page.recv_json().expect("a DevTools answer");
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// `expr` evaluated in the page, by value.
    pub fn eval(&mut self, expr: &str) -> serde_json::Value {
        let r = self.cdp(
            "Runtime.evaluate",
            serde_json::json!({"expression": expr, "returnByValue": true}),
        );
        r["result"]["value"].clone()
    }

    /// Evaluates `expr` until it is true (at most `limit`).
    pub fn wait_for(&mut self, expr: &str, limit: Duration) -> bool {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < limit {
            if self.eval(expr) == serde_json::Value::Bool(true) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    }

    /// A PNG of the page as it is.
    pub fn screenshot(&mut self) -> Vec<u8> {
        use base64::Engine as _;
        let shot = self.cdp(
            "Page.captureScreenshot",
            serde_json::json!({"format": "png"}),
        );
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap_or(""))
            .expect("base64 screenshot")
    }
}
