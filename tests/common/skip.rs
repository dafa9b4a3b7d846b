//! The one way a test says it could not check something here.
//!
//! A skip used to be an early `return` whose message libtest captured and
//! hid, so a suite on a broken machine passed having proved nothing. Now:
//!
//! - [`skip!`](crate::skip!) ends the calling test as skipped;
//!   [`not_checked`] notes that one part of a test did not run and lets the
//!   rest go on. Both name the test (libtest names each test's thread
//!   after it) as `<test binary>::<test>`.
//! - Under `CI=true` either one is a test failure, unless that name is in
//!   `tests/skip-allowlist.txt` accepts that kind and reason (reviewed).
//! - Otherwise (and for allowlisted names) the skip is written to the real
//!   stderr, which libtest does not capture, and appended to the skip log:
//!   `$AGENT_SANDBOX_SKIP_LOG`, else `<target dir>/test-skips.txt`.
//!   `.ci/run` points the log at a fresh file and lists it at the end.
//!
//! Every test binary declares this module at its root as `mod skip;`
//! (`#[path = "common/skip.rs"]`), so the helpers in `tests/common/` reach
//! it as `crate::skip` however they are included.
#![allow(dead_code)]

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Ends the calling test as skipped, for the reason given (format args):
/// a failure under `CI=true` unless allowlisted, else reported.
#[macro_export]
macro_rules! skip {
    ($($why:tt)+) => {{
        $crate::skip::skipped(&format!($($why)+));
        return;
    }};
}

/// Whole test skipped, or only a part of it not checked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Skipped,
    NotChecked,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Skipped => "skipped",
            Kind::NotChecked => "not-checked",
        }
    }
}

/// The file listing the skips CI accepts.
pub const ALLOWLIST: &str = "tests/skip-allowlist.txt";

/// What `skip!` runs before returning: panics (fails the test) when the
/// skip is not allowed here.
pub fn skipped(reason: &str) {
    if let Err(e) = record(&current_test(), Kind::Skipped, reason) {
        panic!("{e}");
    }
}

/// A part of the calling test could not be checked here; the test goes
/// on. Panics when that is not allowed (CI, not allowlisted).
pub fn not_checked(reason: &str) {
    if let Err(e) = record(&current_test(), Kind::NotChecked, reason) {
        panic!("{e}");
    }
}

/// Records a skip of `test` (a name inside this binary): `Err` with the
/// message to fail with when CI forbids it. For harness-less test programs,
/// whose cases do not run on named threads.
pub fn record(test: &str, kind: Kind, reason: &str) -> Result<(), String> {
    let name = format!("{}::{test}", binary());
    let reason = reason.replace(['\n', '\t'], " ");
    if ci() {
        match allowed(&name, kind, &reason) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                "{name} {kind} under CI=true: {reason}\n  Fix the environment, or, after review, \
                     add `{name}  {kind}  <text of the reason>` to {ALLOWLIST}, saying why.",
                kind = kind.word()
            ))
            }
            Err(e) => return Err(format!("{name} {}: {reason}; {e}", kind.word())),
        }
    }
    // Once per test, kind and reason: a check in a loop reports once.
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let line = format!("{}\t{name}\t{reason}\n", kind.word());
    let first = SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(line.clone());
    if !first {
        return Ok(());
    }
    // io::stderr() directly, not eprintln!: libtest captures the macros.
    let _ = writeln!(
        std::io::stderr(),
        "\n!!! {} {name}: {reason}",
        kind.word().to_uppercase()
    );
    let log = log_path();
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        // A skip nobody can count is a silent one: fail instead.
        return Err(format!(
            "{name} {}: {reason}; and the skip log {} cannot be written: {e}",
            kind.word(),
            log.display()
        ));
    }
    Ok(())
}

/// `CI=true` (or `1`), as CI services set it.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Whether `tests/skip-allowlist.txt` accepts this skip.
fn allowed(name: &str, kind: Kind, reason: &str) -> Result<bool, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(ALLOWLIST);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    allowed_in(&text, name, kind, reason).map_err(|e| format!("{}:{e}", path.display()))
}

/// Whether an allowlist `text` has a line `name kind text-of-reason`
/// whose text the reason contains (so an allowlisted test still fails
/// when it skips for another reason). `#` starts a comment; a malformed
/// line is an error (`Err("<line>: ...")`).
pub fn allowed_in(text: &str, name: &str, kind: Kind, reason: &str) -> Result<bool, String> {
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let (entry, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim_start();
        let (k, want) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        let want = want.trim();
        if want.is_empty()
            || ![Kind::Skipped, Kind::NotChecked]
                .iter()
                .any(|x| x.word() == k)
        {
            return Err(format!(
                "{}: want `<binary>::<test> <skipped|not-checked> <text of the reason>`",
                i + 1
            ));
        }
        if entry == name && k == kind.word() && reason.contains(want) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The running test's name: libtest names each test's thread after it.
fn current_test() -> String {
    match std::thread::current().name() {
        Some(n) if n != "main" => n.to_string(),
        // Called off a test thread (a helper thread, or a harness-less
        // program): the skip must still be counted, under some name.
        _ => "<unnamed thread>".into(),
    }
}

/// This test binary's name: `target/<profile>/deps/<name>-<hash>`.
fn binary() -> String {
    let exe = std::env::current_exe().unwrap_or_default();
    let stem = exe
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            name.to_string()
        }
        _ => stem,
    }
}

/// cargo's target dir: `$CARGO_TARGET_DIR`, else from this binary's path.
pub fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test exe path");
    // target/<profile>/deps/<test>
    exe.parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

pub fn log_path() -> PathBuf {
    std::env::var_os("AGENT_SANDBOX_SKIP_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("test-skips.txt"))
}
