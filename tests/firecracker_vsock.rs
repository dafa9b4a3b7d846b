//! Firecracker's host-side vsock handshake (`CONNECT n\n` -> `OK m\n`)
//! against fake Unix-socket servers: good, garbage, closing, silent.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use agent_sandbox::vm::firecracker::vsock_connect;
use agent_sandbox::vm::VmError;

struct Sock(PathBuf);

impl Sock {
    fn new(tag: &str) -> Sock {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "fcv-{tag}-{}-{}.sock",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_file(&p);
        Sock(p)
    }
}

impl Drop for Sock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Serve each connection with `f(conn_index, stream, request_line)`.
fn serve<F>(sock: &Sock, f: F) -> Arc<Mutex<Vec<String>>>
where
    F: Fn(usize, UnixStream, String) + Send + Sync + 'static,
{
    let l = UnixListener::bind(&sock.0).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let f = Arc::new(f);
    thread::spawn(move || {
        for (i, c) in l.incoming().enumerate() {
            let Ok(c) = c else { return };
            let f = f.clone();
            let seen = seen2.clone();
            thread::spawn(move || {
                let mut r = BufReader::new(c);
                let mut line = String::new();
                let _ = r.read_line(&mut line);
                seen.lock().unwrap().push(line.clone());
                f(i, r.into_inner(), line);
            });
        }
    });
    seen
}

fn alive() -> bool {
    true
}

#[test]
fn ok_answer_gives_the_guest_stream() {
    let s = Sock::new("ok");
    let seen = serve(&s, |_, mut c, _| {
        // The answer and the guest's first bytes may arrive together: the
        // bytes after the newline belong to the caller.
        c.write_all(b"OK 1073741824\nhello").unwrap();
        let mut b = [0u8; 4];
        if c.read_exact(&mut b).is_ok() {
            c.write_all(&b).unwrap();
        }
    });
    let mut st =
        vsock_connect(&s.0, 5000, Instant::now() + Duration::from_secs(2), &alive).unwrap();
    let mut b = [0u8; 5];
    st.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"hello");
    st.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    st.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    assert_eq!(seen.lock().unwrap().as_slice(), ["CONNECT 5000\n"]);
}

#[test]
fn retries_while_the_guest_is_not_listening_yet() {
    let s = Sock::new("late");
    // Firecracker closes the connection while nothing listens on the port.
    serve(&s, |i, mut c, _| {
        if i >= 3 {
            c.write_all(b"OK 1073741825\n").unwrap();
            thread::sleep(Duration::from_millis(200));
        }
    });
    vsock_connect(&s.0, 5000, Instant::now() + Duration::from_secs(2), &alive).unwrap();
}

#[test]
fn waits_for_the_socket_to_appear() {
    let s = Sock::new("appear");
    let p = s.0.clone();
    let t = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        let l = UnixListener::bind(&p).unwrap();
        let (c, _) = l.accept().unwrap();
        let mut r = BufReader::new(c);
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        r.into_inner().write_all(b"OK 7\n").unwrap();
        thread::sleep(Duration::from_millis(100));
    });
    vsock_connect(&s.0, 5000, Instant::now() + Duration::from_secs(2), &alive).unwrap();
    t.join().unwrap();
}

#[test]
fn garbage_answer_is_an_immediate_clear_error() {
    for answer in [
        &b"ERR no such port\n"[..],
        b"OK\n",
        b"OK abc\n",
        b"ok 5\n",
        b"OK 99999999999\n",
        &[b'x'; 100],
    ] {
        let s = Sock::new("garbage");
        let a = answer.to_vec();
        let seen = serve(&s, move |_, mut c, _| {
            let _ = c.write_all(&a);
            thread::sleep(Duration::from_millis(300));
        });
        let t = Instant::now();
        let e = vsock_connect(&s.0, 5000, Instant::now() + Duration::from_secs(30), &alive)
            .unwrap_err();
        // Not retried: one connection, and an answer long before the
        // deadline a retry loop would run into.
        assert_eq!(seen.lock().unwrap().len(), 1, "garbage was retried");
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "garbage should not be retried"
        );
        assert!(
            matches!(e, VmError::Api { .. }) && e.to_string().contains("expected \"OK <port>\""),
            "{e}"
        );
    }
}

#[test]
fn server_that_always_closes_times_out_at_the_deadline() {
    let s = Sock::new("close");
    serve(&s, |_, _c, _| {});
    let t = Instant::now();
    // 1 s: the server's thread must run at least once before it under load
    // (a last try still unanswered at the deadline keeps the earlier reason).
    let e = vsock_connect(
        &s.0,
        5000,
        Instant::now() + Duration::from_millis(1000),
        &alive,
    )
    .unwrap_err();
    let el = t.elapsed();
    // Retried until the deadline, then given up (not retried forever).
    assert!(
        el >= Duration::from_millis(1000) && el < Duration::from_secs(10),
        "{el:?}"
    );
    assert!(
        matches!(e, VmError::Timeout { .. }) && e.to_string().contains("closed"),
        "{e}"
    );
}

#[test]
fn a_last_silent_try_keeps_what_the_earlier_tries_saw() {
    // What a loaded host did in CI: the server closed the first tries, but
    // the last one was still unanswered when the deadline came.
    let s = Sock::new("close-then-silent");
    serve(&s, |i, c, _| {
        if i > 0 {
            thread::sleep(Duration::from_secs(60));
        }
        drop(c);
    });
    let e = vsock_connect(
        &s.0,
        5000,
        Instant::now() + Duration::from_millis(500),
        &alive,
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, VmError::Timeout { .. })
            && msg.contains("closed before answering")
            && msg.contains("then no answer to CONNECT"),
        "{msg}"
    );
}

#[test]
fn server_that_never_answers_times_out_at_the_deadline() {
    let s = Sock::new("silent");
    // Silent for a minute: waiting for it would cross the bound below.
    serve(&s, |_, c, _| {
        thread::sleep(Duration::from_secs(60));
        drop(c);
    });
    let t = Instant::now();
    let e = vsock_connect(
        &s.0,
        5000,
        Instant::now() + Duration::from_millis(300),
        &alive,
    )
    .unwrap_err();
    let el = t.elapsed();
    assert!(el < Duration::from_secs(20), "{el:?}");
    assert!(
        matches!(e, VmError::Timeout { .. }) && e.to_string().contains("no answer to CONNECT"),
        "{e}"
    );
}

#[test]
fn missing_socket_times_out_and_dead_vmm_fails_at_once() {
    let s = Sock::new("missing");
    let t = Instant::now();
    let e = vsock_connect(
        &s.0,
        5000,
        Instant::now() + Duration::from_millis(200),
        &alive,
    )
    .unwrap_err();
    // Its deadline ends the wait (without it: forever).
    assert!(
        matches!(e, VmError::Timeout { .. }) && t.elapsed() < Duration::from_secs(10),
        "{e}"
    );
    // A dead VMM ends it at once, long before its 60 s deadline.
    let t = Instant::now();
    let e = vsock_connect(
        &s.0,
        5000,
        Instant::now() + Duration::from_secs(60),
        &|| false,
    )
    .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(20) && e.to_string().contains("VMM gone"),
        "{e}"
    );
}
