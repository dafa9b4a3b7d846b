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
/// leaves no sandbox (and no command) behind.
#[test]
fn stdio_sigterm_destroys_everything() {
    use std::io::Write;
    let state = tempfile::tempdir().expect("tempdir");
    let cmd = stdio_cmd(state.path());
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn agent-sandbox mcp");
    let mut stdin = child.stdin.take().expect("stdin");
    let marker = common::marker();
    let msgs = [
        serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"}}}),
        serde_json::json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "execute", "arguments": {"sessionId": "s1", "command": "sleep", "args": [marker]}}}),
    ];
    for m in msgs {
        writeln!(stdin, "{m}").expect("write");
    }
    stdin.flush().expect("flush");
    if local_procs() {
        assert!(
            common::wait_until(Duration::from_secs(30), || common::sleepers(&marker) == 1),
            "command did not start"
        );
    } else {
        std::thread::sleep(Duration::from_secs(5));
    }
    // SAFETY: our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break Some(st);
        }
        if std::time::Instant::now() > end {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.and_then(|s| s.code()), Some(0), "exit after SIGTERM");
    if local_procs() {
        assert!(
            common::wait_until(Duration::from_secs(10), || common::sleepers(&marker) == 0),
            "command outlived the server"
        );
    }
    let left = common::procs_with(&state.path().display().to_string());
    assert!(left.is_empty(), "sandbox processes left: {left:?}");
}
