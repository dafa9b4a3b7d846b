//! The Python SDK (`sdk/python`, issue #24) against a real daemon and real
//! VMs: the wheel built (`pip wheel --no-deps`), installed with pytest and
//! pdoc into a fresh venv, the quick start run from it, the SDK's pytest
//! suite (examples included; a second, rate-limited daemon with one
//! session slot for the 429/503 tests; a third without networking or a
//! preview listener for the refusals of secrets and ports), the overhead
//! bench, the pdoc API
//! reference. Skipped (a failure under CI) without python3, venv and pip,
//! or without a VM backend.

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const MIN: Duration = Duration::from_secs(60);

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk/python")
}

/// Whether `python3 <args>` runs and exits 0.
fn python_has(args: &[&str]) -> bool {
    Command::new("python3")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd` (killed after `limit`) with the installed wheel, never the
/// source tree, and no bytecode written: [`common::run_checked`].
fn run(mut cmd: Command, what: &str, limit: Duration) -> String {
    cmd.env_remove("PYTHONPATH")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    common::run_checked(cmd, what, limit)
}

/// The only `.whl` in `dir`.
fn wheel_in(dir: &Path) -> PathBuf {
    let wheels: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("wheel dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    assert_eq!(wheels.len(), 1, "wheels built: {wheels:?}");
    wheels[0].clone()
}

#[test]
fn python_sdk_wheel_installs_in_a_fresh_venv_and_passes_its_suite_against_a_daemon() {
    if !python_has(&["--version"]) {
        skip!("python3 is needed for the Python SDK (install Python >= 3.9)");
    }
    if !python_has(&["-m", "venv", "--help"]) || !python_has(&["-m", "pip", "--version"]) {
        skip!("python3's venv and pip modules are needed (Debian: python3-venv python3-pip)");
    }
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let sdk = sdk_dir();
    let tmp = tempfile::Builder::new()
        .prefix("sdk-py")
        .tempdir()
        .expect("tempdir");

    // The wheel, as a user builds it (hatchling comes from PyPI, or pip's cache).
    let dist = tmp.path().join("dist");
    let mut wheel = Command::new("python3");
    wheel
        .args(["-m", "pip", "wheel", "--no-deps", "--quiet", "-w"])
        .arg(&dist)
        .arg(&sdk);
    run(wheel, "pip wheel sdk/python", 5 * MIN);
    let whl = wheel_in(&dist);

    // A fresh venv with the wheel (and httpx, its one dependency), pytest, pdoc.
    let venv = tmp.path().join("venv");
    let mut mk = Command::new("python3");
    mk.args(["-m", "venv"]).arg(&venv);
    run(mk, "python3 -m venv", 2 * MIN);
    let py = venv.join("bin/python");
    let mut install = Command::new(&py);
    install
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg(&whl)
        .args(["pytest", "pdoc"]);
    run(install, "pip install <wheel> pytest pdoc", 5 * MIN);
    let mut which = Command::new(&py);
    which
        .current_dir(tmp.path())
        .args(["-c", "import agent_sandbox; print(agent_sandbox.__file__)"]);
    let from = run(which, "import agent_sandbox", MIN);
    assert!(
        from.trim().starts_with(&venv.display().to_string()),
        "agent_sandbox imported from {from:?}, not the venv"
    );

    // Sessions with networking, through a test uplink namespace (no packet
    // leaves the machine): policy changes apply (AGENT_SANDBOX_TEST_NETWORK),
    // and a preview listener on loopback serves guest ports to the suite
    // (AGENT_SANDBOX_TEST_PREVIEW).
    let topo = netns::Topology::new("sdkpy");
    let host = topo.host_path().display().to_string();
    let d = Daemon::start(&[
        "--network",
        "on",
        "--uplink",
        "up0",
        "--net-host-netns",
        &host,
        "--dns-upstream",
        "198.51.100.53:53",
        "--preview-listen",
        "127.0.0.1:0",
    ]);
    // VMs without networking or a preview listener: the refusals of secrets
    // and ports (checked before any VM starts, but for one session).
    let offnet = Daemon::start(&[]);
    // The 429 and at-capacity tests: a daemon of their own (local sandboxes).
    let limited = Daemon::start_local(&[
        "--rate-limit",
        "2",
        "--rate-burst",
        "2",
        "--max-sessions",
        "1",
    ]);
    let env = |c: &mut Command| {
        c.env("AGENT_SANDBOX_URL", &d.base)
            .env("AGENT_SANDBOX_TEST_NETWORK", "on")
            .env("AGENT_SANDBOX_TEST_PREVIEW", "on")
            .env("AGENT_SANDBOX_API_KEY", &d.key)
            .env("AGENT_SANDBOX_LIMITED_URL", &limited.base)
            .env("AGENT_SANDBOX_LIMITED_KEY", &limited.key)
            .env("AGENT_SANDBOX_OFFNET_URL", &offnet.base)
            .env("AGENT_SANDBOX_OFFNET_KEY", &offnet.key)
            .env("AGENT_SANDBOX_SDK_STRICT", "1");
    };

    // The quick start, run from outside the source tree.
    std::fs::copy(
        sdk.join("examples/quickstart.py"),
        tmp.path().join("quickstart.py"),
    )
    .expect("copy quickstart");
    let mut qs = Command::new(&py);
    qs.current_dir(tmp.path()).arg("quickstart.py");
    env(&mut qs);
    let out = run(qs, "quick start (from the installed wheel)", 2 * MIN);
    for want in ["hello from Linux", "ship it", "Exited(", "exit code 3"] {
        assert!(out.contains(want), "quick start printed {out:?}");
    }

    // The suite (and through it the offline examples); -rs names any skip.
    let mut suite = Command::new(&py);
    suite.current_dir(&sdk).args([
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-q",
        "tests",
    ]);
    env(&mut suite);
    let report = run(suite, "pytest sdk/python/tests", 25 * MIN);
    let last = report.lines().rev().find(|l| !l.trim().is_empty());
    let last = last.unwrap_or_default();
    assert!(
        last.contains(" passed") && !last.contains("skipped") && !last.contains("failed"),
        "pytest's summary: {last:?}\n{report}"
    );
    let passed: u32 = last
        .split_whitespace()
        .zip(last.split_whitespace().skip(1))
        .find_map(|(n, w)| w.starts_with("passed").then(|| n.parse().ok())?)
        .unwrap_or(0);
    assert!(passed >= 50, "only {passed} tests passed:\n{report}");
    eprintln!("pytest: {last}");

    // The overhead bench still runs (few runs here: CI's numbers are noise).
    let mut bench = Command::new(&py);
    bench
        .current_dir(&sdk)
        .args(["benches/overhead.py", "--runs", "10"]);
    env(&mut bench);
    let b = run(bench, "benches/overhead.py", 3 * MIN);
    assert!(b.contains("overhead: p50"), "bench printed {b:?}");

    // The API reference from the docstrings.
    let docs = tmp.path().join("docs");
    let mut pdoc = Command::new(&py);
    pdoc.current_dir(tmp.path())
        .args(["-m", "pdoc", "-o"])
        .arg(&docs)
        .arg("agent_sandbox");
    run(pdoc, "pdoc agent_sandbox", 2 * MIN);
    let index = std::fs::read_to_string(docs.join("agent_sandbox.html")).unwrap_or_default();
    for want in [
        "Sandbox",
        "AsyncSandbox",
        "CommandResult",
        "SessionNotFound",
        "Secret",
        "PortInfo",
    ] {
        assert!(index.contains(want), "pdoc's page lacks {want:?}");
    }

    // Every test cleaned up after itself.
    let h = d.http();
    let left = h.get("/v1/sessions").json();
    assert_eq!(
        left["sessions"],
        serde_json::json!([]),
        "sessions left behind: {left}"
    );
    let snaps = h.get("/v1/snapshots").json();
    assert_eq!(
        snaps["snapshots"],
        serde_json::json!([]),
        "snapshots left behind: {snaps}"
    );
}
