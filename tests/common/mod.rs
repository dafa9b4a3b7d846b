//! Shared test helpers: start the real agent binary on a Unix socket.
#![allow(dead_code)]

use agent_sandbox::agent::AgentClient;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::skip;

/// Path of the `sandbox-agent` binary, built on first use if cargo has
/// not built it yet (it belongs to another package of the workspace).
pub fn agent_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Ok(p) = std::env::var("SANDBOX_AGENT_BIN") {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().expect("test exe path");
        // target/<profile>/deps/<test> -> target/<profile>/sandbox-agent
        let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
        let bin = profile_dir.join("sandbox-agent");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "-q",
            "-p",
            "sandbox-agent",
            "--bin",
            "sandbox-agent",
        ]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("run cargo build for sandbox-agent");
        assert!(st.success(), "building sandbox-agent failed");
        assert!(bin.exists(), "{} missing after build", bin.display());
        bin
    })
    .clone()
}

/// A running agent process with its own socket and workspace; killed and
/// cleaned up on drop.
pub struct TestAgent {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub workspace: PathBuf,
}

impl TestAgent {
    pub fn start() -> TestAgent {
        let dir = tempfile::Builder::new()
            .prefix("sbx-agent-test")
            .tempdir()
            .expect("tempdir");
        let sock = dir.path().join("agent.sock");
        let workspace = dir.path().join("workspace");
        let mut child = Command::new(agent_bin())
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .arg("--workspace")
            .arg(&workspace)
            .env("SANDBOX_AGENT_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn sandbox-agent");
        let out = child.stdout.take().expect("agent stdout");
        let mut line = String::new();
        BufReader::new(out)
            .read_line(&mut line)
            .expect("read READY");
        assert!(
            line.starts_with(agent_sandbox::proto::READY_LINE),
            "agent printed {line:?} instead of READY"
        );
        TestAgent {
            child,
            dir,
            sock,
            workspace,
        }
    }

    pub fn stream(&self) -> UnixStream {
        UnixStream::connect(&self.sock).expect("connect to agent socket")
    }

    pub fn client(&self) -> AgentClient {
        AgentClient::connect(self.stream(), Duration::from_secs(10)).expect("agent hello")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Pids of live (non-zombie) processes whose command line contains `marker`.
pub fn procs_with(marker: &str) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmd).contains(marker) {
            out.push(pid);
        }
    }
    out
}

/// Whether process `pid` is gone (no such process, or a zombie).
pub fn pid_gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

/// Polls `f` until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// A marker unique to this call, for finding processes in /proc.
pub fn marker() -> String {
    format!(
        "{}",
        100_000 + agent_sandbox::agent::random_u64().expect("getrandom") % 800_000
    )
}

/// Live `sleep <marker>` processes (exact command line), not the shells
/// whose command strings merely mention the marker.
pub fn sleepers(marker: &str) -> usize {
    let want = format!("sleep\0{marker}\0");
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return 0;
    };
    rd.flatten()
        .filter(|e| std::fs::read(e.path().join("cmdline")).unwrap_or_default() == want.as_bytes())
        .count()
}
pub mod daemon;
pub mod router;

/// A shell command printing how many `sleep <marker>` processes run where
/// it runs: the guest's process table under a VM backend, the host's under
/// `local-process`. `-f -x` matches the whole command line, so neither the
/// shell running it nor a client naming the marker counts.
pub fn count_sleepers_cmd(marker: &str) -> String {
    format!("pgrep -c -f -x 'sleep {marker}' || true")
}

/// What a (stopped) daemon or MCP server on `state_dir` left behind:
/// processes naming the state dir (VMMs, local sandboxes), runtime dirs,
/// per-VM cgroups, and named namespaces of `net_prefix`. Empty when it
/// cleaned up.
pub fn leftovers(state_dir: &Path, net_prefix: Option<&str>) -> Vec<String> {
    let mut left: Vec<String> = procs_with(&state_dir.display().to_string())
        .into_iter()
        .map(|p| format!("process {p}"))
        .collect();
    let run = state_dir.join("run");
    for e in std::fs::read_dir(&run).into_iter().flatten().flatten() {
        left.push(format!("runtime dir {}", e.path().display()));
    }
    for parent in agent_sandbox::vm::cgroup::daemon_parents(state_dir) {
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(agent_sandbox::sandbox::ID_PREFIX) {
                left.push(format!("cgroup {}", e.path().display()));
            }
        }
    }
    if let Some(p) = net_prefix {
        let head = format!("{p}-");
        for e in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&head) {
                left.push(format!("netns {name}"));
            }
        }
    }
    left
}

/// The default template of test daemons on VM backends. The real default
/// (`dev`) is a 1 GiB developer image whose restores cost more under TCG:
/// tests that do not need its tools stay on the small `base`. A test of
/// the default itself passes `--default-template default`.
pub const VM_TEST_DEFAULT_TEMPLATE: &str = "base";

/// `--default-template` [`VM_TEST_DEFAULT_TEMPLATE`] for a daemon or MCP
/// host on `backend`, unless its arguments (`args`, then
/// `AGENT_SANDBOX_TEST_ARGS`) name one.
pub fn default_template_args(backend: &str, args: &[&str]) -> Vec<String> {
    let named = |a: &str| a == "--default-template" || a.starts_with("--default-template=");
    let env_args = std::env::var("AGENT_SANDBOX_TEST_ARGS").unwrap_or_default();
    if backend == "local-process"
        || args.iter().any(|a| named(a))
        || env_args.split_whitespace().any(named)
    {
        return Vec::new();
    }
    vec!["--default-template".into(), VM_TEST_DEFAULT_TEMPLATE.into()]
}

/// Backend the daemon and MCP tests run on: `AGENT_SANDBOX_TEST_BACKEND`,
/// else `qemu` once `agent-sandbox image build` (the quick start's first
/// command) has recorded guest images, else `local-process`: reported as
/// the VM part not checked (a failure under CI).
pub fn test_backend() -> String {
    if let Ok(b) = std::env::var("AGENT_SANDBOX_TEST_BACKEND") {
        return b;
    }
    let cache = std::env::var_os("AGENT_SANDBOX_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/agent-sandbox"));
    if cache.join("current.json").exists() {
        return "qemu".into();
    }
    skip::not_checked(
        "no guest images recorded: sandboxes run as local processes, not VMs \
         (run `agent-sandbox image build` to test through VMs)",
    );
    "local-process".into()
}

/// Remove the per-VM cgroups a test daemon on `state_dir` left (a daemon
/// killed outright cannot remove them; its next start would) and their
/// per-daemon parent.
/// Deletes every named network namespace `{prefix}-*` (what a killed
/// daemon with that `--net-prefix` left).
pub fn remove_netns_prefixed(prefix: &str) {
    let head = format!("{prefix}-");
    for e in std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&head) {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &name])
                .status();
        }
    }
}

pub fn remove_daemon_cgroups(state_dir: &Path) {
    use agent_sandbox::vm::cgroup;
    // v2 first: its cgroup.kill empties the v1 dirs of the same VMMs.
    let parents: Vec<_> = cgroup::daemon_parents(state_dir)
        .into_iter()
        .filter(|p| p.exists())
        .collect();
    cgroup::sweep(&parents, agent_sandbox::sandbox::ID_PREFIX);
    for p in &parents {
        let _ = std::fs::remove_dir(p);
    }
}

/// A minimal pure-Python wheel, zipped on the host by python3.
pub fn make_wheel(dir: &std::path::Path) -> std::path::PathBuf {
    let whl = dir.join("tinypkg-0.1-py3-none-any.whl");
    let script = r#"
import sys, zipfile, hashlib, base64
files = {
    "tinypkg/__init__.py": "ANSWER = 42\n",
    "tinypkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
    "tinypkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{name},sha256={digest},{len(text.encode())}")
record.append("tinypkg-0.1.dist-info/RECORD,,")
files["tinypkg-0.1.dist-info/RECORD"] = "\n".join(record) + "\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
"#;
    let st = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&whl)
        .status()
        .expect("run host python3");
    assert!(st.success(), "building the wheel failed");
    whl
}

/// Runs `cmd` (killed after `limit`), failing the test with its output
/// unless it exits 0; answers its stdout. For tools the tests drive (the
/// SDKs' own suites, package managers).
pub fn run_checked(mut cmd: std::process::Command, what: &str, limit: Duration) -> String {
    use std::io::Read;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{what}: spawn: {e}"));
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let end = Instant::now() + limit;
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
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    match status {
        Some(st) if st.success() => out,
        Some(st) => panic!("{what} failed ({st}):\n--- stdout\n{out}\n--- stderr\n{err}"),
        None => {
            panic!("{what} did not end within {limit:?}:\n--- stdout\n{out}\n--- stderr\n{err}")
        }
    }
}

/// A headless-capable Chromium on this host (images/install-deps.sh
/// installs Debian's), for the browser tests.
pub fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}
