//! The skip mechanism itself (`tests/common/skip.rs`): under CI a skip
//! fails the test, naming it; outside CI it is shown and logged; the
//! allowlist accepts only the test, kind and reason it names.

#[path = "common/skip.rs"]
mod skip;

use skip::{allowed_in, Kind};
use std::process::Command;

/// Skips when run as the probe (`SKIP_PROBE=1`), else does nothing: the
/// tests below run this binary again with only this test.
#[test]
fn probe() {
    if std::env::var_os("SKIP_PROBE").is_some() {
        skip!("probe reason {}", 42);
    }
}

fn run_probe(ci: &str, log: &std::path::Path) -> std::process::Output {
    Command::new(std::env::current_exe().expect("test exe"))
        .args(["--exact", "probe", "--test-threads=1"])
        .env("SKIP_PROBE", "1")
        .env("CI", ci)
        .env("AGENT_SANDBOX_SKIP_LOG", log)
        .output()
        .expect("run the probe")
}

#[test]
fn a_skip_fails_under_ci_naming_the_test() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("skips.txt");
    let o = run_probe("true", &log);
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !o.status.success(),
        "the probe passed under CI=true:\n{out}"
    );
    assert!(
        out.contains("skips::probe skipped under CI=true: probe reason 42"),
        "{out}"
    );
    assert!(!log.exists(), "a failing skip is not logged as a skip");
}

#[test]
fn a_skip_outside_ci_is_shown_and_logged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("skips.txt");
    let o = run_probe("", &log);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    // Not captured by libtest although the test passed.
    assert!(
        err.contains("!!! SKIPPED skips::probe: probe reason 42"),
        "{err}"
    );
    let logged = std::fs::read_to_string(&log).expect("skip log");
    assert_eq!(logged, "skipped\tskips::probe\tprobe reason 42\n");
}

#[test]
fn the_allowlist_names_test_kind_and_reason() {
    let text = "# comment\n\nbin::t  skipped  needs KVM  # why\nbin::u not-checked no v2\n";
    let ok = |name, kind, reason| allowed_in(text, name, kind, reason).expect("parses");
    assert!(ok("bin::t", Kind::Skipped, "this needs KVM here"));
    assert!(!ok("bin::t", Kind::Skipped, "needs root"), "another reason");
    assert!(!ok("bin::t", Kind::NotChecked, "needs KVM"), "another kind");
    assert!(!ok("bin::tt", Kind::Skipped, "needs KVM"), "another test");
    assert!(ok("bin::u", Kind::NotChecked, "x: no v2 here"));
    for bad in ["bin::t skipped\n", "bin::t maybe because\n", "bin::t\n"] {
        assert!(
            allowed_in(bad, "bin::t", Kind::Skipped, "x").is_err(),
            "{bad:?}"
        );
    }
    // The repository's own list is well formed.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(skip::ALLOWLIST);
    let real = std::fs::read_to_string(&path).expect("the allowlist");
    allowed_in(&real, "x::y", Kind::Skipped, "z")
        .unwrap_or_else(|e| panic!("{}:{e}", path.display()));
}
