//! Raw JSON-RPC against our MCP server on stdio and Streamable HTTP, for
//! protocol versions 2025-06-18, 2025-11-25 and 2026-07-28: every server
//! message validated against the official schemas, bad input (malformed
//! JSON, batches, unknown methods, wrong params, oversized messages, wrong
//! versions and headers, auth, Origin), and clients that disconnect
//! mid-execute. See tests/mcp/raw_protocol.py.

mod common;
#[path = "mcp/harness.rs"]
mod harness;
#[path = "common/skip.rs"]
mod skip;

use harness::*;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

fn script() -> String {
    repo()
        .join("tests/mcp/raw_protocol.py")
        .display()
        .to_string()
}

#[test]
fn stdio_all_versions_schemas_and_bad_input() {
    let Some(py) = python() else { return };
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(&py);
    cmd.arg(script())
        .arg(schema_dir())
        .args(["stdio", "--"])
        .args(stdio_cmd(state.path()));
    run_script(cmd, "raw protocol stdio", LIMIT);
    let left = common::procs_with(&state.path().display().to_string());
    assert!(left.is_empty(), "sandbox processes left behind: {left:?}");
}

#[test]
fn http_all_versions_schemas_and_bad_input() {
    let Some(py) = python() else { return };
    let mut d = Daemon::start();
    let mut cmd = Command::new(&py);
    cmd.arg(script())
        .arg(schema_dir())
        .args(["http", &d.base, &d.key]);
    run_script(cmd, "raw protocol http", LIMIT);
    // Every sandbox the script made is gone (deleted MCP sessions and
    // destroy_session), and the daemon still answers.
    assert!(
        common::wait_until(Duration::from_secs(10), || d.session_procs().is_empty()),
        "sandboxes left: {:?}\n{}",
        d.session_procs(),
        d.log()
    );
    assert!(!d.log().contains("panicked"), "{}", d.log());
    assert_eq!(d.terminate().and_then(|s| s.code()), Some(0));
}

/// SIGTERM to a stdio server with a command running: it exits 0 and
/// leaves no sandbox (and no command) behind. The command is first seen
/// running inside the sandbox (a second, concurrent call counts it there),
/// so the check holds under a VM backend too, where the guest's processes
/// die with its VMM.
#[test]
fn stdio_sigterm_destroys_everything() {
    use std::io::{BufRead, Write};
    let state = tempfile::tempdir().expect("tempdir");
    let _cleanup = KillOnDrop(state.path().to_path_buf());
    let cmd = stdio_cmd(state.path());
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn agent-sandbox mcp");
    let mut stdin = child.stdin.take().expect("stdin");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let msg = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("server wrote non-JSON {line:?}: {e}"));
            if tx.send(msg).is_err() {
                break;
            }
        }
    });
    let mut send = |m: serde_json::Value| {
        writeln!(stdin, "{m}").expect("write");
        stdin.flush().expect("flush");
    };
    let marker = common::marker();
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"}}}),
    );
    send(
        serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "execute", "arguments": {"sessionId": "s1", "command": "sleep", "args": [marker]}}}),
    );
    // Count it from inside the sandbox until it runs.
    let count = common::count_sleepers_cmd(&marker);
    let end = std::time::Instant::now() + Duration::from_secs(180);
    let mut id = 10;
    let running = loop {
        id += 1;
        send(
            serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
            "name": "execute", "arguments": {"sessionId": "s1", "command": count}}}),
        );
        let answer = loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(m) if m["id"] == id => break Some(m),
                Ok(_) => {}
                Err(_) => break None,
            }
        };
        let Some(answer) = answer else { break false };
        let n = answer["result"]["structuredContent"]["stdout"]
            .as_str()
            .unwrap_or_else(|| panic!("count answer: {answer}"))
            .trim()
            .to_string();
        if n == "1" {
            break true;
        }
        if std::time::Instant::now() > end {
            break false;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(running, "the command did not start in the sandbox");
    if local_procs() {
        assert_eq!(common::sleepers(&marker), 1, "command not on the host");
    }
    // The VMMs (none under local-process): the guest's processes die with
    // them.
    let vmms: Vec<i32> = common::procs_with(&state.path().display().to_string())
        .into_iter()
        .filter(|p| common::daemon::vm_id_of(*p).is_some())
        .collect();
    if !local_procs() {
        assert!(!vmms.is_empty(), "no VMM runs the session");
    }
    eprintln!(
        "backend {}: `sleep {marker}` seen in the sandbox; VMMs {vmms:?}",
        backend()
    );
    // SAFETY: our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break Some(st);
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.and_then(|s| s.code()), Some(0), "exit after SIGTERM");
    assert!(
        common::wait_until(Duration::from_secs(10), || vmms
            .iter()
            .all(|p| common::pid_gone(*p))),
        "VMMs outlived the server: {vmms:?}"
    );
    assert!(
        common::wait_until(Duration::from_secs(10), || common::sleepers(&marker) == 0),
        "command outlived the server"
    );
    let left = common::leftovers(state.path(), None);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Kills whatever still names the state dir (the server, its VMMs) and
/// removes its cgroups, even when the test fails half-way.
struct KillOnDrop(std::path::PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in common::procs_with(&self.0.display().to_string()) {
            // SAFETY: processes carrying our private temp dir in their argv.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        common::remove_daemon_cgroups(&self.0);
    }
}
