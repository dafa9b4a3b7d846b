//! Attacks on the daemon's HTTP edge, run against the real `serve` binary
//! over raw TCP (issue 17): the daemon stays up, answers `/health` within a
//! second throughout, stays under an RSS bound, and each attack gets its
//! documented answer.

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The daemon's resident set stays under this through every attack here
/// (it idles at ~30 MB; before the fix one request took it past 1 GB).
const RSS_BOUND_KB: u64 = 150 * 1024;

fn addr(d: &Daemon) -> SocketAddr {
    d.base
        .trim_start_matches("http://")
        .parse()
        .expect("daemon address")
}

fn status_kb(pid: i32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn threads(pid: i32) -> u64 {
    status_kb(pid, "Threads:")
}

/// Sends `req` on a new connection and reads the whole answer (until the
/// server closes or `wait` passes).
fn raw(a: SocketAddr, req: &[u8], wait: Duration) -> String {
    let mut s = TcpStream::connect(a).expect("connect");
    s.set_read_timeout(Some(wait)).unwrap();
    let _ = s.write_all(req);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(resp: &str) -> u16 {
    resp.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A session made before an attack still runs commands during it.
fn assert_bystander(d: &Daemon, during: &str) {
    let v = d.http().exec("bystander", "echo still-here");
    assert!(
        common::daemon::stdout_of(&v).contains("still-here"),
        "bystander session during {during}: {v}"
    );
}

/// `/health` on a fresh connection answers 200 within a second.
fn assert_healthy(d: &Daemon, during: &str) {
    let t = Instant::now();
    let r = raw(
        addr(d),
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    let took = t.elapsed();
    assert_eq!(status_of(&r), 200, "/health during {during}: {r:?}");
    assert!(
        took < Duration::from_secs(1),
        "/health took {took:?} during {during}"
    );
    let rss = status_kb(d.pid(), "VmRSS:");
    assert!(
        rss < RSS_BOUND_KB,
        "daemon RSS {rss} kB over {RSS_BOUND_KB} kB during {during}"
    );
}

#[test]
fn huge_content_length_without_auth_is_refused_unread() {
    let d = Daemon::start(&[]);
    assert_bystander(&d, "start");
    for cl in ["100000000000000", "18446744073709551615"] {
        let req = format!(
            "POST /exec/x/execute HTTP/1.1\r\nHost: x\r\nContent-Length: {cl}\r\n\r\n{{\"command\":"
        );
        let r = raw(addr(&d), req.as_bytes(), Duration::from_secs(10));
        assert_eq!(status_of(&r), 413, "Content-Length {cl}: {r:?}");
        assert!(r.contains("body_too_large"), "{r}");
        assert!(r.contains("Connection: close"), "{r}");
        assert_healthy(&d, &format!("Content-Length {cl}"));
    }
    // Past u64: not a number we accept.
    let r = raw(
        addr(&d),
        b"POST /exec/x/execute HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551616\r\n\r\n",
        Duration::from_secs(10),
    );
    assert_eq!(status_of(&r), 400, "{r:?}");
    // 16 at once (the old worker count) leave the API answering.
    let hs: Vec<_> = (0..16)
        .map(|_| {
            let a = addr(&d);
            std::thread::spawn(move || {
                raw(
                    a,
                    b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000000\r\n\r\n",
                    Duration::from_secs(10),
                )
            })
        })
        .collect();
    for h in hs {
        assert_eq!(status_of(&h.join().unwrap()), 413);
    }
    assert_healthy(&d, "16 huge bodies");
    assert_bystander(&d, "16 huge bodies");
    assert!(!d.log().contains("panicked"), "{}", d.log());
}

#[test]
fn bodiless_connections_hold_nothing_shared() {
    let d = Daemon::start(&[]);
    assert_bystander(&d, "start");
    let pid = d.pid();
    let base_threads = threads(pid);
    // 32 connections that declare a body and never send it, half
    // authenticated (so the handler waits on the body), half not.
    let mut conns = Vec::new();
    for i in 0..32 {
        let mut s = TcpStream::connect(addr(&d)).unwrap();
        let auth = if i % 2 == 0 {
            format!("Authorization: Bearer {}\r\n", d.key)
        } else {
            String::new()
        };
        write!(
            s,
            "POST /exec/b{i}/execute HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1000\r\n\r\n{{"
        )
        .unwrap();
        conns.push(s);
    }
    for i in 0..5 {
        assert_healthy(&d, &format!("32 bodiless connections, probe {i}"));
        std::thread::sleep(Duration::from_millis(300));
    }
    assert_bystander(&d, "32 bodiless connections");
    // Each one ends by itself: 408 (or a close) once the body read times
    // out; nothing waits forever.
    let t = Instant::now();
    for mut s in conns {
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let r = String::from_utf8_lossy(&out);
        let st = status_of(&r);
        assert!(
            st == 408 || st == 401 || st == 0,
            "a stalled body got {r:?}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "stalled bodies were held for {:?}",
        t.elapsed()
    );
    // Up to KEEP_IDLE (8) connection threads stay for reuse; the rest end.
    assert!(common::wait_until(Duration::from_secs(30), || threads(pid)
        <= base_threads + 10));
    assert_healthy(&d, "after bodiless connections");
}

#[test]
fn endless_header_is_cut_at_the_head_limit() {
    let d = Daemon::start(&[]);
    let pid = d.pid();
    let rss0 = status_kb(pid, "VmRSS:");
    let mut s = TcpStream::connect(addr(&d)).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nX-Big: ").unwrap();
    // 64 MiB of one header value; the server answers 431 and closes long
    // before, so the writes start failing.
    let chunk = vec![b'a'; 1 << 20];
    let mut sent = 0usize;
    for _ in 0..64 {
        if s.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let r = String::from_utf8_lossy(&out);
    // The 431 may be lost to a reset once the kernel sees unread data;
    // either way the server stopped reading at the limit.
    assert!(
        r.is_empty() || status_of(&r) == 431,
        "endless header got {r:?}"
    );
    assert!(sent < 64 << 20, "the server read all 64 MiB of one header");
    let grew = status_kb(pid, "VmHWM:").saturating_sub(rss0);
    assert!(
        grew < 16 * 1024,
        "a 64 MiB header grew the daemon by {grew} kB"
    );
    assert_healthy(&d, "endless header");
    assert_bystander(&d, "endless header");
    // Too many header lines: 431.
    let mut req = String::from("GET /health HTTP/1.1\r\n");
    for i in 0..100 {
        req.push_str(&format!("X-H{i}: v\r\n"));
    }
    req.push_str("\r\n");
    let r = raw(addr(&d), req.as_bytes(), Duration::from_secs(5));
    assert_eq!(status_of(&r), 431, "{r:?}");
}

#[test]
fn slowloris_connections_are_closed_by_the_head_timeout() {
    let d = Daemon::start(&[]);
    assert_bystander(&d, "start");
    let pid = d.pid();
    let base_threads = threads(pid);
    let mut conns: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(addr(&d)).unwrap();
            s.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").unwrap();
            s
        })
        .collect();
    // One byte a second per connection: never a complete head.
    let t = Instant::now();
    let mut open = conns.len();
    while open > 0 && t.elapsed() < Duration::from_secs(40) {
        open = 0;
        for s in &mut conns {
            if s.write_all(b"a").is_ok() {
                open += 1;
            }
        }
        if t.elapsed() > Duration::from_secs(2) && t.elapsed() < Duration::from_secs(4) {
            assert_healthy(&d, "slowloris");
            assert_bystander(&d, "slowloris");
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert_eq!(open, 0, "slow heads still open after {:?}", t.elapsed());
    // The head timeout is 10 s; writes start failing once the 408 and the
    // close arrived.
    assert!(t.elapsed() >= Duration::from_secs(9), "{:?}", t.elapsed());
    // Up to KEEP_IDLE (8) connection threads stay for reuse; the rest end.
    assert!(common::wait_until(Duration::from_secs(30), || threads(pid)
        <= base_threads + 10));
    assert_healthy(&d, "after slowloris");
}

#[test]
fn ambiguous_framing_is_refused() {
    let d = Daemon::start(&[]);
    let auth = format!("Authorization: Bearer {}\r\n", d.key);
    let cases = [
        format!("POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 2\r\nContent-Length: 2\r\n\r\n{{}}"),
        format!("POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
        format!("POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: -1\r\n\r\n"),
        format!("POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1 2\r\n\r\n"),
    ];
    for req in &cases {
        let r = raw(addr(&d), req.as_bytes(), Duration::from_secs(10));
        assert_eq!(status_of(&r), 400, "{req:?} got {r:?}");
        assert!(r.contains("Connection: close"), "{r}");
    }
    // A chunked body is read and the connection kept for the next request.
    let body = r#"{"command":"echo chunked-ok"}"#;
    let (a, b) = body.split_at(10);
    let req = format!(
        "POST /exec/f/execute HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n\
         {:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n\
         GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        a.len(),
        b.len()
    );
    let r = raw(addr(&d), req.as_bytes(), Duration::from_secs(60));
    assert_eq!(status_of(&r), 200, "{r}");
    assert!(r.contains("chunked-ok"), "{r}");
    assert_eq!(r.matches("HTTP/1.1 200").count(), 2, "keep-alive: {r}");
    assert_healthy(&d, "framing");
}

#[test]
fn failed_authentication_is_throttled_per_address() {
    let d = Daemon::start(&[]);
    let bad = d.http().with_key("sbx_not_a_key");
    let mut codes = Vec::new();
    for _ in 0..60 {
        let r = bad.get("/exec");
        codes.push((r.status, r.header("retry-after").map(str::to_string)));
    }
    let unauthorized = codes.iter().filter(|(s, _)| *s == 401).count();
    let throttled: Vec<_> = codes.iter().filter(|(s, _)| *s == 429).collect();
    assert!(
        (20..=25).contains(&unauthorized),
        "{unauthorized} bad keys were checked before the throttle: {codes:?}"
    );
    assert!(!throttled.is_empty(), "{codes:?}");
    assert!(throttled.iter().all(|(_, ra)| ra.is_some()), "{codes:?}");
    // The same holds for /mcp.
    let r = bad.post(
        "/mcp",
        &serde_json::json!({"jsonrpc":"2.0","id":1,"method":"ping"}),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    // It refills: a good key from this address works again shortly.
    assert!(common::wait_until(Duration::from_secs(5), || d
        .http()
        .get("/exec")
        .status
        == 200));
    assert_healthy(&d, "auth flood");
}

/// `auth_fail_burst` is the throttle's burst: a larger one lets a burst of
/// bad keys (a conformance fuzzer's probes) through as 401s, a smaller one
/// throttles sooner.
#[test]
fn auth_fail_burst_sets_the_throttles_burst() {
    let count = |burst: &str| {
        let d = Daemon::start_local(&["--auth-fail-burst", burst]);
        let bad = d.http().with_key("sbx_not_a_key");
        let codes: Vec<u16> = (0..40).map(|_| bad.get("/exec").status).collect();
        assert!(codes.iter().all(|c| [401, 429].contains(c)), "{codes:?}");
        // A good key is refused while the address is throttled, not before.
        let good = d.http().get("/exec").status;
        (codes.iter().filter(|&&c| c == 401).count(), good)
    };
    assert_eq!(count("1000"), (40, 200));
    let (unauthorized, good) = count("5");
    assert!(
        (5..=8).contains(&unauthorized),
        "{unauthorized} checked before the throttle"
    );
    assert_eq!(good, 429);
}

/// A 405 names the path's methods in `Allow` (RFC 9110).
#[test]
fn method_not_allowed_carries_allow() {
    let d = Daemon::start_local(&[]);
    for (req, allow) in [
        (
            &b"TRACE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"[..],
            "GET, HEAD",
        ),
        (
            &b"DELETE /exec/templates HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"[..],
            "GET, HEAD",
        ),
    ] {
        let r = raw(addr(&d), req, Duration::from_secs(5));
        assert_eq!(status_of(&r), 405, "{r}");
        assert!(r.contains(&format!("\r\nAllow: {allow}\r\n")), "{r}");
    }
    assert_healthy(&d, "405");
}

#[test]
fn connections_per_address_are_bounded() {
    let d = Daemon::start(&["--max-connections-per-ip", "4"]);
    let idle: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(addr(&d)).unwrap())
        .collect();
    // Give the acceptor time to count them.
    std::thread::sleep(Duration::from_millis(300));
    let r = raw(
        addr(&d),
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        Duration::from_secs(5),
    );
    assert_eq!(status_of(&r), 503, "{r:?}");
    assert!(r.contains("too_many_connections"), "{r}");
    drop(idle);
    let m = d.http().get("/metrics").text();
    assert!(
        m.lines().any(
            |l| l.starts_with("agent_sandbox_http_connections_refused_total ")
                && !l.ends_with(" 0")
        ),
        "{m}"
    );
    assert!(common::wait_until(Duration::from_secs(5), || {
        status_of(&raw(
            addr(&d),
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(5),
        )) == 200
    }));
}
