//! Helpers for the `security_*` test programs (harness = false: each is a
//! plain `main` so the process under test starts single-threaded, exactly
//! like the daemon; cases that restrict a process run in a re-executed
//! child of the test binary).
#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::process::{Command, Output};

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Run this test binary again as `--case NAME` and collect its output.
pub fn run_case(name: &str) -> Output {
    let exe = std::env::current_exe().expect("current exe");
    Command::new(exe)
        .args(["--case", name])
        .env("RUST_LOG", "debug")
        .output()
        .expect("run test child")
}

/// The case named on the command line, if this is a child run.
pub fn case_arg() -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let i = args.iter().position(|a| a == "--case")?;
    args.get(i + 1).cloned()
}

/// The case [`Runner::check`] is running, for [`skip_case`].
static CASE: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Ends the running case as skipped (`tests/common/skip.rs`):
/// `return skip_case(why)` from its closure. `Err` (the case fails) under
/// CI unless allowlisted.
pub fn skip_case(why: &str) -> Result<(), String> {
    let case = CASE.lock().unwrap_or_else(|p| p.into_inner()).clone();
    crate::skip::record(&case, crate::skip::Kind::Skipped, why)?;
    println!("    SKIPPED: {why}");
    Ok(())
}

/// Collects results of a harness-less test program.
#[derive(Default)]
pub struct Runner {
    failed: Vec<String>,
    passed: usize,
    filter: Option<String>,
}

impl Runner {
    pub fn new() -> Runner {
        // `cargo test --test X -- NAME` filters by substring, like libtest.
        let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
        Runner {
            filter,
            ..Runner::default()
        }
    }

    pub fn check(&mut self, name: &str, f: impl FnOnce() -> Result<(), String>) {
        if self.filter.as_deref().is_some_and(|p| !name.contains(p)) {
            return;
        }
        *CASE.lock().unwrap_or_else(|p| p.into_inner()) = name.to_string();
        let r = f();
        CASE.lock().unwrap_or_else(|p| p.into_inner()).clear();
        match r {
            Ok(()) => {
                println!("test {name} ... ok");
                self.passed += 1;
            }
            Err(e) => {
                println!("test {name} ... FAILED\n    {}", e.replace('\n', "\n    "));
                self.failed.push(name.to_string());
            }
        }
    }

    /// Records `name` as skipped for `why` (`tests/common/skip.rs`): a
    /// failed case under CI unless allowlisted, else counted as passed, as
    /// libtest counts a test that returns early.
    pub fn skip(&mut self, name: &str, why: &str) {
        if self.filter.as_deref().is_some_and(|p| !name.contains(p)) {
            return;
        }
        match crate::skip::record(name, crate::skip::Kind::Skipped, why) {
            Ok(()) => {
                println!("test {name} ... ok (SKIPPED: {why})");
                self.passed += 1;
            }
            Err(e) => {
                println!("test {name} ... FAILED\n    {}", e.replace('\n', "\n    "));
                self.failed.push(name.to_string());
            }
        }
    }

    /// The cases from here on cannot run (`why`): recorded as one skip,
    /// `remaining_cases`, whatever the filter, and the program ends.
    pub fn skip_rest(mut self, why: &str) -> ! {
        self.filter = None;
        self.skip("remaining_cases", why);
        self.finish()
    }

    pub fn finish(self) -> ! {
        println!(
            "\ntest result: {}. {} passed; {} failed",
            if self.failed.is_empty() {
                "ok"
            } else {
                "FAILED"
            },
            self.passed,
            self.failed.len()
        );
        std::process::exit(if self.failed.is_empty() { 0 } else { 101 })
    }
}

pub fn describe(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A network namespace under /run/netns made for one test, removed on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("asbx-test-{tag}-{}", std::process::id());
        let st = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("run ip netns add");
        assert!(st.success(), "ip netns add {name} failed");
        Netns { name }
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    /// Inode of the namespace, as `readlink /proc/<pid>/ns/net` shows it.
    pub fn inode(&self) -> u64 {
        std::fs::metadata(self.path()).expect("stat netns").ino()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// This process's permitted capability mask: a dropped-to set can only be
/// the wanted set within it (a container may withhold some, e.g.
/// CAP_SYS_RESOURCE).
pub fn own_permitted() -> u64 {
    let st = std::fs::read_to_string("/proc/self/status").expect("read status");
    st.lines()
        .find_map(|l| l.strip_prefix("CapPrm:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .expect("CapPrm line")
}
