//! A process's state as `/proc` shows it, for tests that start and kill
//! VMMs. Included by path (`#[path = "common/process.rs"] mod process;`) in
//! binaries that need no more of `common`.
#![allow(dead_code)]

/// Gone, or a zombie nobody will reap (not ours): either way not running.
pub fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}
