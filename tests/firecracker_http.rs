//! The small Unix-socket HTTP/1.1 client used for Firecracker's API, against
//! scripted servers: framing, limits, and deadlines.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use agent_sandbox::vm::http::{request, HttpError};

struct Sock(PathBuf);

impl Drop for Sock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// One-connection server: captures the raw request, then writes `reply`
/// (in the given pieces) and, if `hold`, keeps the connection open.
fn server(reply: Vec<&'static [u8]>, hold: Duration) -> (Sock, mpsc::Receiver<Vec<u8>>) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let p = std::env::temp_dir().join(format!(
        "fch-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = fs::remove_file(&p);
    let l = UnixListener::bind(&p).unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let Ok((c, _)) = l.accept() else { return };
        let mut r = BufReader::new(c);
        let mut raw = Vec::new();
        let mut len = 0;
        loop {
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            raw.extend_from_slice(line.as_bytes());
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        raw.extend_from_slice(&body);
        let _ = tx.send(raw);
        let mut c = r.into_inner();
        for piece in reply {
            if c.write_all(piece).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(hold);
    });
    (Sock(p), rx)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(2)
}

#[test]
fn put_with_json_body_and_204() {
    let (s, rx) = server(
        vec![b"HTTP/1.1 204 No Content\r\nServer: Firecracker API\r\n\r\n"],
        Duration::ZERO,
    );
    let r = request(
        &s.0,
        "PUT",
        "/actions",
        Some(br#"{"action_type":"InstanceStart"}"#),
        soon(),
        1024,
    )
    .unwrap();
    assert_eq!((r.status, r.body.len()), (204, 0));
    let raw = String::from_utf8(rx.recv().unwrap()).unwrap();
    assert!(raw.starts_with("PUT /actions HTTP/1.1\r\n"), "{raw}");
    assert!(raw.contains("Content-Type: application/json\r\n"));
    assert!(raw.contains("Content-Length: 31\r\n"));
    assert!(raw.ends_with("\r\n\r\n{\"action_type\":\"InstanceStart\"}"));
}

#[test]
fn response_split_across_reads_and_400_body() {
    let (s, _rx) = server(
        vec![
            b"HTTP/1.1 400 Bad",
            b" Request\r\nContent-Le",
            b"ngth: 23\r\n\r\n{\"fault_mes",
            b"sage\":\"bad\"}",
        ],
        Duration::ZERO,
    );
    let r = request(&s.0, "PATCH", "/vm", Some(b"{}"), soon(), 1024).unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.body, br#"{"fault_message":"bad"}"#);
    assert!(!r.is_success());
}

#[test]
fn get_without_body_reads_to_content_length() {
    let (s, rx) = server(
        vec![b"HTTP/1.1 200 OK\r\nContent-Length: 35\r\n\r\n{\"firecracker_version\":\"1.16.1\"}   extra"],
        Duration::from_millis(200),
    );
    let r = request(&s.0, "GET", "/version", None, soon(), 1024).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 35);
    let raw = String::from_utf8(rx.recv().unwrap()).unwrap();
    assert!(!raw.contains("Content-Length"), "{raw}");
}

#[test]
fn oversized_body_and_bad_framing_are_errors() {
    for (reply, want) in [
        (
            &b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n"[..],
            "limit",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "Transfer-Encoding",
        ),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            "Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            "closed after 5",
        ),
        (b"", "closed before any response"),
    ] {
        let (s, _rx) = server(vec![reply], Duration::ZERO);
        let e = request(&s.0, "GET", "/", None, soon(), 1024).unwrap_err();
        assert!(matches!(e, HttpError::Protocol { .. }), "{e}");
        assert!(e.to_string().contains(want), "{e} should mention {want}");
    }
}

#[test]
fn endless_head_is_bounded() {
    let (s, _rx) = server(vec![&[b'a'; 20000][..]], Duration::from_millis(500));
    let e = request(&s.0, "GET", "/", None, soon(), 1024).unwrap_err();
    assert!(e.to_string().contains("head longer"), "{e}");
}

#[test]
fn silent_or_trickling_server_hits_the_deadline() {
    // Silent for a minute: a client that missed its deadline would wait
    // that long, far beyond the bound below.
    let (s, _rx) = server(vec![], Duration::from_secs(60));
    let t = Instant::now();
    let e = request(
        &s.0,
        "GET",
        "/",
        None,
        Instant::now() + Duration::from_millis(200),
        1024,
    )
    .unwrap_err();
    assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());

    // A byte every 5 ms (for 20 s and more) never completes the head; the
    // deadline still holds.
    let pieces: Vec<&'static [u8]> = std::iter::repeat_n(&b"X"[..], 4000).collect();
    let (s, _rx) = server(pieces, Duration::ZERO);
    let t = Instant::now();
    let e = request(
        &s.0,
        "GET",
        "/",
        None,
        Instant::now() + Duration::from_millis(300),
        1024,
    )
    .unwrap_err();
    assert!(matches!(e, HttpError::Timeout { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

#[test]
fn missing_socket_names_the_path() {
    let p = std::env::temp_dir().join("fch-does-not-exist.sock");
    let e = request(&p, "GET", "/", None, soon(), 1024).unwrap_err();
    assert!(
        matches!(e, HttpError::Io { .. }) && e.to_string().contains("fch-does-not-exist.sock"),
        "{e}"
    );
}
