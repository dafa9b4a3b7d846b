//! Test harness for the MCP tests: third-party client installs (cached
//! outside the repo), a daemon on 127.0.0.1, and script runners.
//!
//! Clients: the Python package `mcp` (+ `jsonschema`) in a venv and the npm
//! package `@modelcontextprotocol/sdk`, installed once into
//! `$AGENT_SANDBOX_TEST_DEPS` (default `/var/cache/agent-sandbox/test-deps`,
//! else `target/test-deps`). When the registry cannot be reached, or npm is
//! not installed, the tests skip (`tests/common/skip.rs`: a failure under
//! CI); any other install failure fails.
//!
//! Backend: `local-process` (the real guest agent as a host process) unless
//! `AGENT_SANDBOX_TEST_BACKEND` names another (`qemu`), with extra serve /
//! mcp flags from `AGENT_SANDBOX_TEST_ARGS`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PY_MCP: &str = "2.3.0";
pub const NODE_SDK: &str = "1.32.2";

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn schema_dir() -> PathBuf {
    if let Ok(d) = std::env::var("MCP_SCHEMA_DIR") {
        return PathBuf::from(d);
    }
    // shared/reference sits beside the repository checkout.
    for cand in [
        repo().join("../shared/reference/mcp"),
        repo().join("../../shared/reference/mcp"),
        PathBuf::from("/work/shared/reference/mcp"),
    ] {
        if cand.join("schema-2026-07-28.json").exists() {
            return cand;
        }
    }
    panic!("MCP schemas not found: set MCP_SCHEMA_DIR to shared/reference/mcp");
}

fn deps_root() -> PathBuf {
    if let Ok(d) = std::env::var("AGENT_SANDBOX_TEST_DEPS") {
        return PathBuf::from(d);
    }
    let sys = PathBuf::from("/var/cache/agent-sandbox/test-deps");
    if std::fs::create_dir_all(&sys).is_ok() {
        return sys;
    }
    repo().join("target/test-deps")
}

/// Serialises installs across the test threads of one binary and across
/// test binaries (a lock file).
fn with_lock<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let root = deps_root();
    let _ = std::fs::create_dir_all(&root);
    let lock = root.join(format!("{name}.lock"));
    let end = Instant::now() + Duration::from_secs(600);
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&lock)
        {
            Ok(_) => break,
            Err(_) if Instant::now() < end => {
                // A lock older than 10 minutes belongs to a dead run.
                let stale = std::fs::metadata(&lock)
                    .and_then(|m| m.modified())
                    .map(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(600))
                    .unwrap_or(false);
                if stale {
                    let _ = std::fs::remove_file(&lock);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("install lock {}: {e}", lock.display()),
        }
    }
    struct Unlock(PathBuf);
    impl Drop for Unlock {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _u = Unlock(lock);
    f()
}

fn unreachable(out: &str) -> bool {
    let o = out.to_ascii_lowercase();
    [
        "temporary failure in name resolution",
        "name or service not known",
        "connection refused",
        "network is unreachable",
        "eai_again",
        "enotfound",
        "econnrefused",
        "etimedout",
        "connectionerror",
        "max retries exceeded",
    ]
    .iter()
    .any(|p| o.contains(p))
}

/// `Err` (a skip) when the registry is unreachable; panics on any other
/// failure (pip's "no matching distribution" is a pin this Python cannot
/// install, not a network problem).
fn run_install(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    if out.status.success() {
        return Ok(());
    }
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if unreachable(&text) {
        return Err(format!("REGISTRY UNREACHABLE during {what}:\n{text}"));
    }
    panic!("{what} failed:\n{text}");
}

/// The venv's python with `mcp` and `jsonschema`, or `None` when PyPI is
/// unreachable: the calling test is recorded as skipped and must return.
pub fn python() -> Option<PathBuf> {
    let dir = deps_root().join(format!("py-mcp-{PY_MCP}"));
    let py = dir.join("bin/python");
    let done = dir.join(".installed");
    if done.exists() {
        return Some(py);
    }
    let r: Result<(), String> = with_lock("py", || {
        if done.exists() {
            return Ok(());
        }
        run_install(
            Command::new("python3").arg("-m").arg("venv").arg(&dir),
            "python3 -m venv",
        )?;
        run_install(
            Command::new(dir.join("bin/pip")).args([
                "install",
                "-q",
                "--disable-pip-version-check",
                &format!("mcp=={PY_MCP}"),
                "jsonschema",
            ]),
            "pip install mcp jsonschema",
        )?;
        std::fs::write(&done, b"").unwrap_or_else(|e| panic!("write {}: {e}", done.display()));
        Ok(())
    });
    match r {
        Ok(()) => Some(py),
        Err(e) => {
            crate::skip::skipped(&e);
            None
        }
    }
}

/// A directory with `node_modules/@modelcontextprotocol/sdk`, or `None`
/// when node or npm is missing or npm's registry is unreachable: the
/// calling test is recorded as skipped and must return.
pub fn node_dir() -> Option<PathBuf> {
    npm_dir(
        &format!("node-sdk-{NODE_SDK}"),
        &format!("@modelcontextprotocol/sdk@{NODE_SDK}"),
    )
}

/// The TypeScript compiler the seed-client test builds its script with.
pub const TYPESCRIPT: &str = "5.9.3";

/// `tsc` (as a script for node) of [`TYPESCRIPT`], or `None` as for
/// [`node_dir`].
pub fn tsc() -> Option<PathBuf> {
    let dir = npm_dir(
        &format!("typescript-{TYPESCRIPT}"),
        &format!("typescript@{TYPESCRIPT}"),
    )?;
    Some(dir.join("node_modules/typescript/bin/tsc"))
}

/// `deps_root()/<name>` with npm package `spec` installed in it (once), or
/// `None` (a skip) when node or npm is missing or the registry unreachable.
fn npm_dir(name: &str, spec: &str) -> Option<PathBuf> {
    let dir = deps_root().join(name);
    let done = dir.join(".installed");
    for tool in ["node", "npm"] {
        let found = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            crate::skip::skipped(&format!(
                "{tool} is not installed (images/install-deps.sh installs nodejs and npm)"
            ));
            return None;
        }
    }
    if done.exists() {
        return Some(dir);
    }
    let r: Result<(), String> = with_lock("node", || {
        if done.exists() {
            return Ok(());
        }
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        if !dir.join("package.json").exists() {
            std::fs::write(
                dir.join("package.json"),
                b"{\"name\":\"test-deps\",\"private\":true}\n",
            )
            .unwrap_or_else(|e| panic!("write package.json in {}: {e}", dir.display()));
        }
        run_install(
            Command::new("npm")
                .current_dir(&dir)
                .args(["install", "--no-audit", "--no-fund", "--silent"])
                .arg(spec),
            &format!("npm install {spec}"),
        )?;
        std::fs::write(&done, b"").unwrap_or_else(|e| panic!("write {}: {e}", done.display()));
        Ok(())
    });
    match r {
        Ok(()) => Some(dir),
        Err(e) => {
            crate::skip::skipped(&e);
            None
        }
    }
}

pub fn backend() -> String {
    super::common::test_backend()
}

/// Sandboxes run as host processes, so tests can look for them in /proc.
pub fn local_procs() -> bool {
    backend() == "local-process"
}

fn backend_args(state: &Path) -> Vec<String> {
    let mut v = vec![
        "--state-dir".into(),
        state.display().to_string(),
        "--backend".into(),
        backend(),
    ];
    if local_procs() {
        v.push("--agent-bin".into());
        v.push(super::common::agent_bin().display().to_string());
    }
    v.extend(super::common::default_template_args(&backend(), &[]));
    if let Ok(a) = std::env::var("AGENT_SANDBOX_TEST_ARGS") {
        v.extend(a.split_whitespace().map(str::to_string));
    }
    v
}

pub fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_agent-sandbox"))
}

/// `agent-sandbox mcp ...` as a command line for a client to launch.
pub fn stdio_cmd(state: &Path) -> Vec<String> {
    let mut v = vec![exe().display().to_string(), "mcp".into()];
    v.extend(backend_args(state));
    v
}

/// A daemon on an ephemeral loopback port; killed (with every process
/// naming its state dir) on drop.
pub struct Daemon {
    pub child: Option<Child>,
    pub base: String,
    pub key: String,
    pub dir: tempfile::TempDir,
    /// Its `--net-prefix`: the namespaces it makes are named by it.
    pub net_prefix: String,
}

impl Daemon {
    pub fn start() -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("sbx-mcp-test")
            .tempdir()
            .expect("tempdir");
        let log = std::fs::File::create(dir.path().join("daemon.log")).expect("log file");
        let net_prefix = super::common::daemon::unique_prefix();
        let mut child = Command::new(exe())
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(backend_args(dir.path()))
            // No network for test VMs (only tests with their own uplink
            // namespace turn it on), and a prefix of its own.
            .args(["--network", "off", "--net-prefix", &net_prefix])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn agent-sandbox serve");
        let (key, base) = super::common::daemon::read_banner(&mut child);
        let d = Daemon {
            child: Some(child),
            base,
            key,
            dir,
            net_prefix,
        };
        assert!(
            !d.base.is_empty() && !d.key.is_empty(),
            "daemon did not start:\n{}",
            d.log()
        );
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Sandbox processes (their argv names our state dir).
    pub fn sandbox_procs(&self) -> Vec<i32> {
        let me = self.child.as_ref().map_or(0, |c| c.id() as i32);
        let daemon_exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_agent-sandbox")).ok();
        super::common::procs_with(&self.dir.path().display().to_string())
            .into_iter()
            .filter(|&p| p != me)
            // The daemon's spawner is a fork of the daemon, not a sandbox.
            .filter(|&p| std::fs::read_link(format!("/proc/{p}/exe")).ok() != daemon_exe)
            .collect()
    }

    /// [`Daemon::sandbox_procs`] without standby VMMs (no guest in them;
    /// `common::daemon::of_sessions`).
    pub fn session_procs(&self) -> Vec<i32> {
        super::common::daemon::of_sessions(self.sandbox_procs(), &self.log())
    }

    /// SIGTERM, and the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        // SAFETY: our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        c.wait().ok()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in super::common::procs_with(&self.dir.path().display().to_string()) {
            // SAFETY: processes carrying our private temp dir in argv.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        super::common::remove_daemon_cgroups(self.dir.path());
        // A killed daemon leaves its isolated namespaces mounted.
        super::common::remove_netns_prefixed(&self.net_prefix);
    }
}

/// Runs a client script to completion (bounded), failing the test with
/// its output unless it exits 0 and printed an `OK` line.
pub fn run_script(mut cmd: Command, what: &str, timeout: Duration) -> String {
    if local_procs() {
        cmd.env("MCP_TEST_LOCAL_PROCS", "1");
    }
    // How a script counts `sleep <marker>` inside a sandbox (one definition
    // for every language): it replaces MARKER and runs it with `execute`.
    cmd.env(
        "MCP_TEST_COUNT_SLEEPERS",
        super::common::count_sleepers_cmd("MARKER"),
    );
    cmd.env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{what}: spawn: {e}"));
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    // Readers report through a channel: a leaked grandchild (a sandbox
    // left running) keeps the pipes open, and must fail the test, not hang it.
    let (tx, rx) = std::sync::mpsc::channel();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut so, &mut s);
        let _ = tx.send((1, s));
    });
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut se, &mut s);
        let _ = tx2.send((2, s));
    });
    let end = Instant::now() + timeout;
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break Some(st);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    for _ in 0..2 {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((1, s)) => out = s,
            Ok((_, s)) => err = s,
            Err(_) => panic!(
                "{what}: a process it started still holds its output after it exited \
                 (a sandbox left running?)\n--- stdout so far\n{out}"
            ),
        }
    }
    let ok = status.is_some_and(|s| s.success()) && out.lines().any(|l| l.starts_with("OK "));
    assert!(
        ok,
        "{what} failed ({status:?})\n--- stdout\n{out}\n--- stderr\n{err}"
    );
    eprintln!("{what}: {}", out.lines().last().unwrap_or(""));
    out
}
