//! The official MCP clients, unmodified, against our server: the Python SDK
//! (`mcp`) over stdio (in-process host, and forwarding to a daemon) and
//! Streamable HTTP, in the handshake and the stateless protocol versions;
//! the TypeScript SDK (`@modelcontextprotocol/sdk`) over HTTP and stdio.
//! Each script lists tools, creates a session, executes (with progress),
//! writes and reads files, cancels a long execute (and checks the process
//! is gone), and destroys the session.

mod common;
#[path = "mcp/harness.rs"]
mod harness;
#[path = "common/skip.rs"]
mod skip;

use harness::*;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

fn py_script() -> String {
    repo()
        .join("tests/mcp/official_client.py")
        .display()
        .to_string()
}

#[test]
fn python_sdk_stdio_in_process() {
    let Some(py) = python() else { return };
    for mode in ["legacy", "auto", "2026-07-28"] {
        let state = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new(&py);
        cmd.arg(py_script())
            .args(["stdio", mode, "--"])
            .args(stdio_cmd(state.path()));
        run_script(cmd, &format!("python mcp stdio {mode}"), LIMIT);
        // The in-process host ended with its client: nothing is left.
        let left = common::procs_with(&state.path().display().to_string());
        assert!(left.is_empty(), "sandbox processes left behind: {left:?}");
    }
}

#[test]
fn python_sdk_streamable_http() {
    let Some(py) = python() else { return };
    let mut d = Daemon::start();
    for mode in ["legacy", "auto", "2026-07-28"] {
        let mut cmd = Command::new(&py);
        cmd.arg(py_script())
            .args(["http", mode, &format!("{}/mcp", d.base), &d.key]);
        run_script(cmd, &format!("python mcp http {mode}"), LIMIT);
    }
    assert_eq!(d.terminate().and_then(|s| s.code()), Some(0), "{}", d.log());
    assert!(d.sandbox_procs().is_empty(), "sandboxes left after SIGTERM");
}

#[test]
fn python_sdk_stdio_forwarding_to_daemon() {
    let Some(py) = python() else { return };
    let d = Daemon::start();
    for mode in ["legacy", "2026-07-28"] {
        let mut cmd = Command::new(&py);
        cmd.arg(py_script())
            .args(["stdio", mode, "--"])
            .arg(exe())
            .args(["mcp", "--url", &d.base])
            .env("AGENT_SANDBOX_API_KEY", &d.key);
        run_script(cmd, &format!("python mcp stdio --url {mode}"), LIMIT);
        // The forwarding process ended with its client; so did every
        // sandbox it created, in either protocol era.
        assert!(
            common::wait_until(Duration::from_secs(15), || d.session_procs().is_empty()),
            "{mode}: sandboxes left on the daemon: {:?}",
            d.session_procs()
        );
    }
    // The key can also come from a file.
    let kf = d.dir.path().join("key");
    std::fs::write(&kf, format!("{}\n", d.key)).expect("key file");
    let mut cmd = Command::new(&py);
    cmd.arg(py_script())
        .args(["stdio", "legacy", "--"])
        .arg(exe())
        .args(["mcp", "--url", &d.base, "--key-file"])
        .arg(&kf)
        .env_remove("AGENT_SANDBOX_API_KEY");
    run_script(cmd, "python mcp stdio --url --key-file", LIMIT);
}

#[test]
fn typescript_sdk_http_and_stdio() {
    let Some(dir) = node_dir() else { return };
    // Node resolves packages from the script's directory.
    let script = dir.join("official_client.mjs");
    std::fs::copy(repo().join("tests/mcp/official_client.mjs"), &script).expect("copy script");
    let d = Daemon::start();
    let mut cmd = Command::new("node");
    cmd.arg(&script)
        .args(["http", &format!("{}/mcp", d.base), &d.key]);
    run_script(cmd, "typescript sdk http", LIMIT);
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("node");
    cmd.arg(&script)
        .args(["stdio", "--"])
        .args(stdio_cmd(state.path()));
    run_script(cmd, "typescript sdk stdio", LIMIT);
}
