//! The TypeScript SDK (`sdk/typescript`, issue #24) against a real daemon
//! and real VMs: `npm ci`, `npm run build`, `npm pack`; the tarball
//! installed into an empty project whose quick start
//! (`examples/quickstart.mjs`) runs; the SDK's own `node --test` suite
//! (with a second, rate-limited daemon for the 429 test and a third
//! without networking or a preview listener for the refusals of secrets
//! and ports); the offline
//! examples; `npm run docs` (typedoc). Skipped (a failure under CI) without
//! node/npm or a VM backend.

mod common;
#[path = "common/netns.rs"]
mod netns;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::Daemon;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn sdk_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk/typescript")
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

use common::run_checked as run;

/// `npm <args>` in `dir`, offline-friendly (the npm cache first).
fn npm(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("npm");
    c.current_dir(dir)
        .args(["--no-audit", "--no-fund", "--prefer-offline"])
        .args(args);
    c
}

const MIN: Duration = Duration::from_secs(60);

#[test]
fn typescript_sdk_builds_packs_installs_and_passes_its_suite_against_a_daemon() {
    if !have("node") || !have("npm") {
        skip!("node and npm are needed for the TypeScript SDK (install Node >= 18)");
    }
    if !common::daemon::vm_backend() {
        skip!("needs a VM backend (AGENT_SANDBOX_TEST_BACKEND=qemu)");
    }
    let sdk = sdk_dir();
    run(npm(&sdk, &["ci"]), "npm ci", 5 * MIN);
    run(npm(&sdk, &["run", "build"]), "npm run build", 3 * MIN);
    let tmp = tempfile::Builder::new()
        .prefix("sdk-ts")
        .tempdir()
        .expect("tempdir");
    let mut pack = npm(&sdk, &["pack", "--pack-destination"]);
    pack.arg(tmp.path());
    let packed = run(pack, "npm pack", 2 * MIN);
    let tgz = tmp.path().join(
        packed
            .lines()
            .last()
            .expect("npm pack names the tarball")
            .trim(),
    );
    assert!(tgz.exists(), "npm pack printed {packed:?}");

    // An empty project with the tarball installed: the quick start as a user runs it.
    let app = tmp.path().join("app");
    std::fs::create_dir(&app).expect("mkdir app");
    run(npm(&app, &["init", "-y"]), "npm init -y", MIN);
    let mut install = npm(&app, &["install"]);
    install.arg(&tgz);
    run(install, "npm install <tarball>", 2 * MIN);
    std::fs::copy(
        sdk.join("examples/quickstart.mjs"),
        app.join("quickstart.mjs"),
    )
    .expect("copy quickstart");

    // Sessions with networking, through a test uplink namespace (no packet
    // leaves the machine): policy changes apply (AGENT_SANDBOX_TEST_NETWORK),
    // and a preview listener on loopback serves guest ports to the suite
    // (AGENT_SANDBOX_TEST_PREVIEW).
    let topo = netns::Topology::new("sdkts");
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
    let env = |c: &mut Command| {
        c.env("AGENT_SANDBOX_URL", &d.base)
            .env("AGENT_SANDBOX_TEST_NETWORK", "on")
            .env("AGENT_SANDBOX_TEST_PREVIEW", "on")
            .env("AGENT_SANDBOX_API_KEY", &d.key);
    };
    let mut qs = Command::new("node");
    qs.current_dir(&app).arg("quickstart.mjs");
    env(&mut qs);
    let out = run(qs, "quick start (installed from npm pack)", 2 * MIN);
    assert_eq!(
        out.trim(),
        "hello from Linux exit 0",
        "quick start printed {out:?}"
    );

    // The suite; the rate-limit test talks to a daemon of its own.
    let limited = Daemon::start_local(&["--rate-limit", "1", "--rate-burst", "2"]);
    // VMs without networking or a preview listener: the refusals of secrets and ports.
    let offnet = Daemon::start(&[]);
    let mut files: Vec<String> = std::fs::read_dir(sdk.join("test"))
        .expect("sdk/typescript/test")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".test.mjs"))
        .map(|n| format!("test/{n}"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "test files: {files:?}");
    let mut suite = Command::new("node");
    suite
        .current_dir(&sdk)
        .args(["--test", "--test-reporter=tap", "--test-concurrency=1"])
        .args(&files)
        .env("AGENT_SANDBOX_RATE_URL", &limited.base)
        .env("AGENT_SANDBOX_RATE_KEY", &limited.key)
        .env("AGENT_SANDBOX_OFFNET_URL", &offnet.base)
        .env("AGENT_SANDBOX_OFFNET_KEY", &offnet.key);
    env(&mut suite);
    let tap = run(suite, "node --test (sdk/typescript/test)", 20 * MIN);
    for want in ["# fail 0", "# skipped 0", "# cancelled 0"] {
        assert!(
            tap.contains(want),
            "the suite's summary lacks {want:?}:\n{tap}"
        );
    }
    let passed = tap
        .lines()
        .find_map(|l| l.strip_prefix("# pass "))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    assert!(passed >= 30, "only {passed} tests passed:\n{tap}");
    eprintln!("node --test: {passed} passed");
    drop(limited);
    drop(offnet);

    // The examples, in their modes that work without a network.
    for ex in [
        &["data-script.mjs"][..],
        &["pip-install.mjs", "--offline"],
        &["dev-server.mjs"],
        &["fork-compare.mjs"],
    ] {
        let mut c = Command::new("node");
        c.current_dir(sdk.join("examples")).args(ex);
        env(&mut c);
        run(c, &format!("example {}", ex.join(" ")), 5 * MIN);
    }

    // The overhead bench runs (its numbers go to the test's output).
    let mut bench = Command::new("node");
    bench.current_dir(&sdk).args(["benches/overhead.mjs", "20"]);
    env(&mut bench);
    let numbers = run(bench, "benches/overhead.mjs", 3 * MIN);
    assert!(numbers.contains("p50 SDK"), "bench printed {numbers:?}");
    eprintln!("{}", numbers.trim());

    // The docs script treats typedoc's warnings as errors.
    let docs = tmp.path().join("docs");
    let mut typedoc = npm(&sdk, &["run", "docs"]);
    typedoc.env("DOCS_OUT", &docs);
    run(typedoc, "npm run docs", 3 * MIN);
    assert!(
        docs.join("index.html").exists(),
        "typedoc wrote no index.html"
    );
    let left = d.http().get("/v1/sessions").json();
    assert_eq!(
        left["sessions"],
        serde_json::json!([]),
        "sessions left behind: {left}"
    );
}
