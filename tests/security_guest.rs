//! A hostile guest must not grow the host (issue #17): every attack runs
//! through the real `serve` binary, and the daemon's memory is read from
//! `/proc/<pid>/status` (VmHWM, its peak RSS). While each attack runs,
//! `/health` is asked every 100 ms and another session runs commands.
//!
//! The hostile guest is [`fake_agent`]: this test binary run by the
//! `local-process` backend in place of the agent (through a small wrapper
//! script), speaking the real wire protocol. A session created with the
//! env `HOSTILE=<attack>` gets it; the others get the real agent. The
//! console flood needs a real guest writing to its serial port, so it runs
//! in a QEMU VM (skipped, saying so, without guest images).

mod common;
#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::proto::{
    self, encode_json, DirEntry, ErrorBody, ErrorCode, Event, FileType, FrameReader, Hello, Kind,
    Request, Response,
};
use common::daemon::{stdout_of, Daemon, Http};
use serde_json::json;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Peak resident memory of the daemon in bytes (`VmHWM`).
fn vm_hwm(pid: i32) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    st.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

const MIB: u64 = 1 << 20;

// ---- the hostile agent -----------------------------------------------------

/// Not a test: the hostile guest agent, when this binary is started as one
/// (`FAKE_AGENT_ARGS` set by the wrapper from [`wrapper`]); otherwise it
/// returns at once.
#[test]
fn fake_agent() {
    let Ok(args) = std::env::var("FAKE_AGENT_ARGS") else {
        return;
    };
    let args: Vec<&str> = args.split(' ').collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| *a == name)
            .and_then(|i| args.get(i + 1))
            .copied()
    };
    let sock = arg("--listen")
        .and_then(|l| l.strip_prefix("unix:"))
        .expect("--listen unix:PATH");
    let mode = args
        .iter()
        .find_map(|a| a.strip_prefix("HOSTILE="))
        .unwrap_or("")
        .to_string();
    let listener = UnixListener::bind(sock).expect("bind agent socket");
    // The wrapper put the daemon's pipe on fd 3 (libtest owns stdout).
    // SAFETY: fd 3 is ours, opened by the wrapper.
    let mut ready = unsafe { std::fs::File::from_raw_fd(3) };
    writeln!(ready, "{}", proto::READY_LINE).expect("ready line");
    drop(ready);
    for conn in listener.incoming() {
        let Ok(conn) = conn else { break };
        let mode = mode.clone();
        std::thread::spawn(move || serve_hostile(conn, &mode));
    }
}

fn send(w: &Mutex<UnixStream>, frame: &[u8]) -> bool {
    w.lock()
        .map(|mut s| s.write_all(frame).is_ok())
        .unwrap_or(false)
}

/// Answers the hello, then plays `mode` against the host.
fn serve_hostile(conn: UnixStream, mode: &str) {
    let w = Arc::new(Mutex::new(conn.try_clone().expect("clone")));
    let mut r = FrameReader::new(conn);
    while let Ok(Some(f)) = r.read_frame() {
        let id = f.header.id;
        match f.kind() {
            Some(Kind::Hello) => {
                let h: Hello = serde_json::from_slice(&f.payload).expect("hello");
                let reply = Hello {
                    version: proto::PROTOCOL_VERSION,
                    min_version: proto::MIN_PROTOCOL_VERSION,
                    nonce: h.nonce,
                    software: "hostile/0".into(),
                    capabilities: Vec::new(),
                    max_payload: proto::MAX_PAYLOAD as u32,
                    restored: None,
                };
                send(&w, &encode_json(Kind::Hello, 0, &reply));
                if mode == "forge" {
                    let w = w.clone();
                    std::thread::spawn(move || forge_log_lines(&w));
                }
            }
            Some(Kind::Request) => {
                let req: Request = match serde_json::from_slice(&f.payload) {
                    Ok(r) => r,
                    Err(_) => continue,
                };
                match req {
                    Request::Ping => {
                        send(
                            &w,
                            &encode_json(Kind::Response, id, &Response::Pong { uptime_ms: 1 }),
                        );
                    }
                    Request::List { .. } if mode == "list" => {
                        let w = w.clone();
                        std::thread::spawn(move || inflated_listing(&w, id));
                    }
                    _ => {
                        let e = ErrorBody::new(ErrorCode::Invalid, "hostile agent");
                        send(&w, &encode_json(Kind::Error, id, &e));
                    }
                }
            }
            _ => {}
        }
    }
}

/// 64 MiB of made-up entries for a listing the host capped at 100k.
fn inflated_listing(w: &Mutex<UnixStream>, id: u64) {
    let entry = |i: usize| DirEntry {
        path: format!("fake/{i:08}/{}", "x".repeat(80)),
        file_type: FileType::File,
        size: 1,
        mode: 0o644,
        mtime_ms: 0,
    };
    let mut sent = 0u64;
    let mut i = 0;
    while sent < 64 * MIB {
        // ~900 KB per frame, under the 1 MiB payload limit.
        let entries: Vec<DirEntry> = (0..6000).map(|k| entry(i + k)).collect();
        i += entries.len();
        let frame = encode_json(Kind::Event, id, &Event::Entries { entries });
        sent += frame.len() as u64;
        if !send(w, &frame) {
            return;
        }
    }
    let done = Response::Listed {
        count: i as u64,
        truncated: false,
    };
    send(w, &encode_json(Kind::Response, id, &done));
}

/// A line the daemon itself writes, to be forged.
const FORGED: &str = "[2099-01-01T00:00:00Z INFO  agent_sandbox::session::worker] \
                      session k-victim/s-victim: destroyed";

/// Connection-level error frames carrying forged daemon log lines: a
/// flood of 300, then one more after the bucket refilled (it carries the
/// suppressed-lines note).
fn forge_log_lines(w: &Mutex<UnixStream>) {
    let msg = format!("boom\n{FORGED}\n\x1b[2J{}", "A".repeat(200_000));
    let e = ErrorBody::new(ErrorCode::Io, msg);
    for _ in 0..300 {
        if !send(w, &encode_json(Kind::Error, 0, &e)) {
            return;
        }
    }
    std::thread::sleep(Duration::from_millis(2500));
    let last = ErrorBody::new(ErrorCode::Io, format!("last\n{FORGED}"));
    send(w, &encode_json(Kind::Error, 0, &last));
}

/// The agent binary for [`Daemon::start_local`]: the real agent, or this
/// test binary as [`fake_agent`] for sessions created with `HOSTILE=...`.
fn wrapper(dir: &Path) -> PathBuf {
    let me = std::env::current_exe().expect("test exe");
    let real = common::agent_bin();
    let path = dir.join("agent-wrapper.sh");
    let script = format!(
        "#!/bin/sh\n\
         case \"$*\" in\n\
         *HOSTILE=*) FAKE_AGENT_ARGS=\"$*\" exec {me} fake_agent --exact --nocapture \
         --test-threads=1 3>&1 1>&2 ;;\n\
         esac\n\
         exec {real} \"$@\"\n",
        me = me.display(),
        real = real.display()
    );
    std::fs::write(&path, script).expect("write wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

// ---- watching the daemon while an attack runs ------------------------------

/// Asks `/health` every 100 ms and runs `echo` in a bystander session,
/// until stopped; reports the slowest health answer and every failure.
struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(Duration, u32, Vec<String>)>>,
}

impl Watch {
    fn start(http: Http, bystander: String) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut worst, mut execs, mut fails) = (Duration::ZERO, 0u32, Vec::new());
            let mut last_exec = Instant::now() - Duration::from_secs(10);
            while !s.load(Ordering::Acquire) {
                let t = Instant::now();
                let r = http.get("/health");
                worst = worst.max(t.elapsed());
                if r.status != 200 {
                    fails.push(format!("/health: {} {}", r.status, r.text()));
                }
                if last_exec.elapsed() > Duration::from_millis(500) {
                    last_exec = Instant::now();
                    let r = http.post(
                        &format!("/v1/sessions/{bystander}/exec"),
                        &json!({"command": "echo still-here"}),
                    );
                    if r.status == 200 && stdout_of(&r.json()).trim() == "still-here" {
                        execs += 1;
                    } else {
                        fails.push(format!("bystander exec: {} {}", r.status, r.text()));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (worst, execs, fails)
        });
        Watch {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops and checks: health always within two seconds, the bystander
    /// answered every time (and at least once). (Two, not one: with other
    /// VM suites on the same 2 cores a /health answer once waited 1.4 s on
    /// the scheduler alone; a daemon stalled by an attack waits far longer.)
    fn finish(mut self, what: &str) {
        self.stop.store(true, Ordering::Release);
        let (worst, execs, fails) = self
            .thread
            .take()
            .expect("watch thread")
            .join()
            .expect("watch thread panicked");
        eprintln!("{what}: slowest /health {worst:?}, bystander answered {execs} times");
        assert!(fails.is_empty(), "{what}: {fails:?}");
        assert!(execs >= 1, "{what}: the bystander never ran");
        assert!(
            worst < Duration::from_secs(2),
            "{what}: /health took {worst:?}"
        );
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn create(d: &Daemon, env: serde_json::Value) -> String {
    let r = d.http().post("/v1/sessions", &json!({ "env": env }));
    assert!(
        (200..300).contains(&r.status),
        "create session: {} {}\n{}",
        r.status,
        r.text(),
        d.log()
    );
    r.json()["id"].as_str().expect("session id").to_string()
}

fn local_daemon(tmp: &Path, extra: &[&str]) -> Daemon {
    Daemon::start_local_agent(&wrapper(tmp), extra)
}

// ---- the attacks -----------------------------------------------------------

/// The host asks for 100k entries; the guest sends 64 MiB of them (before
/// the fix: 31 MB -> 1.8 GB). Now the call ends with 502
/// `guest_reply_too_large` and the daemon's peak RSS stays under 256 MiB.
#[test]
fn an_inflated_listing_is_refused_and_the_daemon_stays_small() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = local_daemon(tmp.path(), &[]);
    let bystander = create(&d, json!({}));
    let hostile = create(&d, json!({"HOSTILE": "list"}));
    let before = vm_hwm(d.pid());
    let watch = Watch::start(d.http(), bystander);
    for route in [
        format!("/v1/sessions/{hostile}/files/list?path=.&recursive=true"),
        format!("/exec/{hostile}/files?path=."),
    ] {
        let r = d.http().get(&route);
        assert_eq!(r.status, 502, "{route}: {}", r.text());
        assert_eq!(r.code(), "guest_reply_too_large", "{}", r.text());
        assert!(r.text().contains("100000 entries"), "{}", r.text());
    }
    watch.finish("inflated listing");
    let peak = vm_hwm(d.pid());
    eprintln!(
        "daemon VmHWM: {} MiB before, {} MiB after the inflated listings",
        before / MIB,
        peak / MIB
    );
    assert!(peak > 0, "no VmHWM for pid {}", d.pid());
    assert!(peak < 256 * MIB, "daemon peaked at {} MiB", peak / MIB);
    // The hostile session's connection survives: it still answers.
    let r = d.http().get(&format!("/v1/sessions/{hostile}"));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A 64 MiB file of control bytes read as JSON text would be ~384 MiB
/// (`\u0001` per byte; before the fix two such reads peaked at 939 MB).
/// Now: 413 `reply_too_large` naming the size and the other routes, while
/// the base64 read of the same file works, and the daemon's peak RSS stays
/// under 400 MiB through two concurrent refused reads and the base64 one.
#[test]
fn a_control_byte_read_is_refused_before_it_is_built() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = local_daemon(tmp.path(), &[]);
    let bystander = create(&d, json!({}));
    let victim = create(&d, json!({}));
    let r = d.http().post(
        &format!("/v1/sessions/{victim}/exec"),
        &json!({"command": "head -c 67108864 /dev/zero | tr '\\000' '\\001' > ctl.bin && wc -c < ctl.bin"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stdout_of(&r.json()).trim(), "67108864", "{}", r.text());
    let before = vm_hwm(d.pid());
    let watch = Watch::start(d.http(), bystander);
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let http = d.http();
            let url = format!("/exec/{victim}/read?path=ctl.bin");
            std::thread::spawn(move || http.get(&url))
        })
        .collect();
    for t in readers {
        let r = t.join().expect("reader");
        assert_eq!(r.status, 413, "{}", r.text());
        assert_eq!(r.code(), "reply_too_large");
        let m = r.message();
        assert!(m.contains("402653"), "names the size: {m}");
        assert!(
            m.contains("encoding=base64") && m.contains("files/content"),
            "{m}"
        );
    }
    let r = d
        .http()
        .get(&format!("/exec/{victim}/read?path=ctl.bin&encoding=base64"));
    assert_eq!(
        r.status,
        200,
        "{}",
        r.text().chars().take(300).collect::<String>()
    );
    let v = r.json();
    assert_eq!(v["encoding"], "base64");
    assert_eq!(v["size"], 67108864);
    assert_eq!(v["content"].as_str().map(str::len), Some(89478488));
    drop(v);
    drop(r);
    watch.finish("control-byte read");
    let peak = vm_hwm(d.pid());
    eprintln!(
        "daemon VmHWM: {} MiB before, {} MiB after the control-byte reads",
        before / MIB,
        peak / MIB
    );
    assert!(peak < 400 * MIB, "daemon peaked at {} MiB", peak / MIB);
}

/// A full reply budget is a 503 with `Retry-After` up front. The budget is
/// made smaller than one read (a config the daemon refuses at start: it
/// must hold one `max_file` read), so the check is shown at the edge.
#[test]
fn a_reply_budget_below_one_read_is_refused_at_start() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(
        &cfg,
        r#"{"max_file": 1048576, "max_reply_memory": 2000000}"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .args(["config", "check"])
        .arg(&cfg)
        .output()
        .expect("run config check");
    let err =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("max_reply_memory 2000000"), "{err}");
}

/// A guest's connection error frames carry forged daemon log lines
/// (newlines, escape sequences, 200 KB each). In the daemon's log they
/// appear escaped on one line, cut to 512 bytes, at most a burst of 10
/// plus one a second, with a note of how many were suppressed.
#[test]
fn forged_log_lines_are_escaped_cut_and_rate_limited() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let d = local_daemon(tmp.path(), &[]);
    let bystander = create(&d, json!({}));
    let watch = Watch::start(d.http(), bystander);
    let t0 = Instant::now();
    let _hostile = create(&d, json!({"HOSTILE": "forge"}));
    // The last frame comes after the flood and a pause.
    let noted = common::wait_until(Duration::from_secs(30), || {
        d.log().contains("agent reports: io: last\\n[2099-")
    });
    let took = t0.elapsed();
    watch.finish("forged log lines");
    let log = d.log();
    assert!(noted, "the last forged line never came; log:\n{log}");
    let forged: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("agent reports"))
        .collect();
    eprintln!(
        "{} guest lines logged of 301 sent, in {took:?}; first: {}",
        forged.len(),
        forged.first().unwrap_or(&"")
    );
    // Nothing the guest sent starts a line of its own.
    for l in log.lines() {
        assert!(!l.starts_with("[2099-"), "forged line in the log: {l}");
        assert!(!l.contains('\x1b'), "escape sequence in the log: {l:?}");
    }
    assert!(
        forged[0].contains("boom\\n[2099-01-01T00:00:00Z INFO  agent_sandbox::session::worker]"),
        "{}",
        forged[0]
    );
    assert!(forged[0].contains("\\u{1b}[2J"), "{}", forged[0]);
    assert!(forged[0].contains("more bytes]"), "{}", forged[0]);
    for l in &forged {
        assert!(l.len() < 1024, "a {}-byte guest line", l.len());
    }
    let allowed = 10 + took.as_secs() as usize + 2;
    assert!(
        forged.len() <= allowed,
        "{} guest lines in {took:?} (at most {allowed})",
        forged.len()
    );
    assert!(
        forged
            .iter()
            .any(|l| l.contains("earlier guest log lines suppressed")),
        "no suppressed-lines note: {forged:?}"
    );
}

/// Root in a real QEMU guest writes 16 MB of base64 to its serial console
/// (~0.8 MB/s under TCG, all of it kept before the fix). `console.log` in
/// the VM's run dir rotates at 1 MiB into a single `console.log.1`: at most
/// 2 MiB.
#[test]
fn a_console_flood_stays_within_the_console_log_cap() {
    if common::test_backend() != "qemu" {
        skip!("the console flood needs a QEMU guest (no guest images)");
    }
    let d = Daemon::start(&[]);
    let bystander = create(&d, json!({}));
    let flooder = create(&d, json!({}));
    let needle = format!("/{flooder}: ready as ");
    let sandbox = d
        .log()
        .lines()
        .find_map(|l| {
            let rest = &l[l.find(&needle)? + needle.len()..];
            rest.split_whitespace().next().map(str::to_string)
        })
        .expect("sandbox id of the flooding session");
    let run = d.state_dir().join("run").join(&sandbox);
    assert!(
        run.join("console.log").exists(),
        "no console.log in {run:?}"
    );
    let watch = Watch::start(d.http(), bystander);
    let r = d.http().post(
        &format!("/v1/sessions/{flooder}/exec"),
        &json!({"command": "id -u; head -c 12000000 /dev/urandom | base64 > /dev/ttyS0; echo flooded"}),
    );
    watch.finish("console flood");
    assert_eq!(r.status, 200, "{}", r.text());
    let out = stdout_of(&r.json());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["0", "flooded"],
        "{}",
        r.text()
    );
    let size = |name: &str| std::fs::metadata(run.join(name)).map(|m| m.len());
    let cur = size("console.log").expect("console.log");
    let old = size("console.log.1").expect("console.log.1: the flood never filled 1 MiB");
    eprintln!("after the flood: console.log {cur} bytes, console.log.1 {old} bytes");
    assert!(cur <= MIB && old <= MIB, "console.log {cur}, .1 {old}");
    let logs: Vec<_> = std::fs::read_dir(&run)
        .expect("run dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("console"))
        .collect();
    assert_eq!(logs.len(), 2, "{logs:?}");
    // Still the same VM, still answering.
    let r = d.http().post(
        &format!("/v1/sessions/{flooder}/exec"),
        &json!({"command": "echo alive"}),
    );
    assert_eq!(stdout_of(&r.json()).trim(), "alive", "{}", r.text());
}
