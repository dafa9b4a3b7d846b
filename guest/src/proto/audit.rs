//! What one audited exec did inside the guest ([`super::ExecRequest::audit`]):
//! its process tree (fork/exec/exit/uid events) and the files it changed.
//! Built by the agent, carried in [`super::ExitStatus::audit`].
//!
//! Everything is bounded twice: the agent keeps at most [`limits`] of each
//! kind (counting the rest) and fits the whole record under
//! [`limits::MAX_BYTES`] of JSON, so the exec's final frame stays below
//! [`super::MAX_PAYLOAD`]; the host applies the same limits again with
//! [`ExecAudit::bound`], since it must not trust the guest to have.

use super::FileType;
use serde::{Deserialize, Serialize};

pub mod limits {
    /// Process events kept per exec; the rest are counted in `procs_dropped`.
    pub const MAX_PROC_EVENTS: usize = 1000;
    /// Arguments kept of an exec event's argv, and bytes of each.
    pub const MAX_ARGV: usize = 16;
    pub const MAX_ARG_BYTES: usize = 256;
    /// Changed paths kept per exec; the rest are counted in `files_dropped`.
    pub const MAX_FILES: usize = 200;
    /// Bytes of a recorded path (longer ones are cut and marked).
    pub const MAX_PATH_BYTES: usize = 1024;
    /// Files up to this size that are valid UTF-8 get a diff.
    pub const DIFF_MAX_FILE: u64 = 64 * 1024;
    /// Bytes of one unified diff (cut at a line, marked).
    pub const MAX_DIFF_BYTES: usize = 8 * 1024;
    pub const MAX_NOTES: usize = 16;
    pub const MAX_NOTE_BYTES: usize = 256;
    /// The whole record as JSON: what is left of the 1 MiB frame for it.
    pub const MAX_BYTES: usize = 640 * 1024;
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecAudit {
    /// In the order the kernel reported them.
    #[serde(default)]
    pub procs: Vec<ProcEvent>,
    /// Events past [`limits::MAX_PROC_EVENTS`] (or shed to fit the frame).
    #[serde(default)]
    pub procs_dropped: u64,
    /// Process events were collected. False when the kernel has no process
    /// events connector (or it failed): `notes` says why.
    #[serde(default)]
    pub procs_tracked: bool,
    #[serde(default)]
    pub files: Vec<FileChange>,
    /// Changed paths past [`limits::MAX_FILES`] (or shed to fit).
    #[serde(default)]
    pub files_dropped: u64,
    /// File changes were collected (see `notes` when not).
    #[serde(default)]
    pub files_tracked: bool,
    /// What the record misses or could not do, for a human.
    #[serde(default)]
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProcEventKind {
    /// `pid` was forked by `ppid`.
    Fork,
    /// `pid` executed a program (`argv`).
    Exec,
    /// `pid` changed its uid (`uid`, `euid`).
    Uid,
    /// `pid` ended (`exit_code` or `signal`).
    Exit,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcEvent {
    pub kind: ProcEventKind,
    pub pid: i32,
    /// The parent when the event happened (the forking process for `fork`).
    pub ppid: i32,
    /// Milliseconds since the exec started (kernel timestamp).
    pub t_ms: u64,
    /// `exec` only: the new program's arguments, read from
    /// `/proc/PID/cmdline`; absent if the process was already gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Arguments or bytes past [`limits::MAX_ARGV`] / [`limits::MAX_ARG_BYTES`]
    /// were cut.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub argv_truncated: bool,
    /// Real uid (known for every event of a tracked process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Effective uid, when it differs from `uid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub euid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FileChangeKind {
    Created,
    Modified,
    Deleted,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileChange {
    /// Absolute path in the guest.
    pub path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub path_truncated: bool,
    pub change: FileChangeKind,
    /// What the path is now (before, for `deleted`).
    #[serde(rename = "type")]
    pub file_type: FileType,
    /// Size now; absent for `deleted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Hex SHA-256 of the contents now (regular files; absent if deleted
    /// or unreadable, or past the hashing budget: see `notes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Unified diff against the previous contents (small UTF-8 files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<String>,
    /// The diff was cut at [`limits::MAX_DIFF_BYTES`] (or dropped to fit).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub diff_truncated: bool,
    /// A small text file whose previous contents the agent did not have:
    /// no diff.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub diff_unavailable: bool,
}

/// `s` cut to at most `max` bytes at a character boundary; whether it was cut.
pub fn cut(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    true
}

/// A unified diff cut to `max` bytes at a line end; whether it was cut.
pub fn cut_lines(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let end = s[..end].rfind('\n').map_or(0, |i| i + 1);
    s.truncate(end);
    true
}

impl ExecAudit {
    /// Enforces every limit: lists cut (the excess counted as dropped),
    /// strings cut and marked. The host runs it on what a guest sent.
    pub fn bound(&mut self) {
        if self.procs.len() > limits::MAX_PROC_EVENTS {
            let extra = self.procs.len() - limits::MAX_PROC_EVENTS;
            self.procs.truncate(limits::MAX_PROC_EVENTS);
            self.procs_dropped = self.procs_dropped.saturating_add(extra as u64);
        }
        for p in &mut self.procs {
            if let Some(argv) = &mut p.argv {
                if argv.len() > limits::MAX_ARGV {
                    argv.truncate(limits::MAX_ARGV);
                    p.argv_truncated = true;
                }
                for a in argv.iter_mut() {
                    p.argv_truncated |= cut(a, limits::MAX_ARG_BYTES);
                }
            }
        }
        if self.files.len() > limits::MAX_FILES {
            let extra = self.files.len() - limits::MAX_FILES;
            self.files.truncate(limits::MAX_FILES);
            self.files_dropped = self.files_dropped.saturating_add(extra as u64);
        }
        for f in &mut self.files {
            f.path_truncated |= cut(&mut f.path, limits::MAX_PATH_BYTES);
            if let Some(d) = &mut f.diff {
                f.diff_truncated |= cut_lines(d, limits::MAX_DIFF_BYTES);
            }
            if let Some(h) = &f.sha256 {
                if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
                    f.sha256 = None;
                }
            }
        }
        self.notes.truncate(limits::MAX_NOTES);
        for n in &mut self.notes {
            cut(n, limits::MAX_NOTE_BYTES);
        }
    }

    /// Adds a note (bounded), unless it is already there.
    pub fn note(&mut self, n: impl Into<String>) {
        let mut n = n.into();
        cut(&mut n, limits::MAX_NOTE_BYTES);
        if self.notes.len() < limits::MAX_NOTES && !self.notes.contains(&n) {
            self.notes.push(n);
        }
    }

    fn json_len(&self) -> usize {
        serde_json::to_vec(self).map_or(usize::MAX, |v| v.len())
    }

    /// Sheds detail until the JSON is at most `max` bytes: first diffs,
    /// then arguments after argv\[0], then events and paths from the end
    /// (counted as dropped). Each step is noted. The limits of
    /// [`ExecAudit::bound`] are applied first.
    pub fn fit(&mut self, max: usize) {
        self.bound();
        if self.json_len() <= max {
            return;
        }
        for f in &mut self.files {
            if f.diff.take().is_some() {
                f.diff_truncated = true;
            }
        }
        self.note("diffs dropped to fit the record in one frame");
        if self.json_len() <= max {
            return;
        }
        for p in &mut self.procs {
            if let Some(a) = &mut p.argv {
                if a.len() > 1 {
                    a.truncate(1);
                    p.argv_truncated = true;
                }
            }
        }
        self.note("arguments after argv[0] dropped to fit the record in one frame");
        let mut shed = false;
        while self.json_len() > max && !(self.procs.is_empty() && self.files.is_empty()) {
            shed = true;
            // Halve whichever list is longer: a few serialisations at most.
            if self.procs.len() >= self.files.len() {
                let keep = self.procs.len() / 2;
                self.procs_dropped += (self.procs.len() - keep) as u64;
                self.procs.truncate(keep);
            } else {
                let keep = self.files.len() / 2;
                self.files_dropped += (self.files.len() - keep) as u64;
                self.files.truncate(keep);
            }
        }
        if shed {
            self.note("events and paths dropped from the end to fit the record in one frame");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exec_event(argv: Vec<String>) -> ProcEvent {
        ProcEvent {
            kind: ProcEventKind::Exec,
            pid: 2,
            ppid: 1,
            t_ms: 0,
            argv: Some(argv),
            argv_truncated: false,
            uid: Some(0),
            euid: None,
            exit_code: None,
            signal: None,
        }
    }

    fn file(path: &str, diff: Option<String>) -> FileChange {
        FileChange {
            path: path.into(),
            path_truncated: false,
            change: FileChangeKind::Modified,
            file_type: FileType::File,
            size: Some(1),
            sha256: Some("ab".repeat(32)),
            diff,
            diff_truncated: false,
            diff_unavailable: false,
        }
    }

    #[test]
    fn cut_keeps_char_and_line_boundaries() {
        let mut s = "aé".to_string();
        assert!(cut(&mut s, 2));
        assert_eq!(s, "a");
        let mut d = "line1\nline2\nline3\n".to_string();
        assert!(cut_lines(&mut d, 14));
        assert_eq!(d, "line1\nline2\n");
        let mut short = "x\n".to_string();
        assert!(!cut_lines(&mut short, 10));
    }

    #[test]
    fn bound_enforces_limits_and_counts() {
        let mut a = ExecAudit {
            procs: vec![exec_event(vec!["y".repeat(1000); 40]); limits::MAX_PROC_EVENTS + 5],
            procs_dropped: 7,
            files: vec![
                file(&"p".repeat(5000), Some("+x\n".repeat(10_000)));
                limits::MAX_FILES + 1
            ],
            notes: vec!["n".repeat(1000); 40],
            ..ExecAudit::default()
        };
        a.files[0].sha256 = Some("not hex".into());
        a.bound();
        assert_eq!(a.procs.len(), limits::MAX_PROC_EVENTS);
        assert_eq!(a.procs_dropped, 12);
        let argv = a.procs[0].argv.as_ref().unwrap();
        assert_eq!(argv.len(), limits::MAX_ARGV);
        assert!(argv.iter().all(|x| x.len() == limits::MAX_ARG_BYTES));
        assert!(a.procs[0].argv_truncated);
        assert_eq!(a.files.len(), limits::MAX_FILES);
        assert_eq!(a.files_dropped, 1);
        assert_eq!(a.files[1].path.len(), limits::MAX_PATH_BYTES);
        assert!(a.files[1].path_truncated);
        let d = a.files[1].diff.as_ref().unwrap();
        assert!(d.len() <= limits::MAX_DIFF_BYTES && d.ends_with('\n'));
        assert!(a.files[1].diff_truncated);
        assert_eq!(a.files[0].sha256, None);
        assert_eq!(a.notes.len(), limits::MAX_NOTES);
    }

    #[test]
    fn fit_sheds_until_under_the_budget() {
        let mut a = ExecAudit {
            procs: vec![exec_event(vec!["z".repeat(256); 16]); 1000],
            files: vec![file("/etc/x", Some("+y\n".repeat(2000))); 200],
            ..ExecAudit::default()
        };
        a.fit(limits::MAX_BYTES);
        let n = serde_json::to_vec(&a).unwrap().len();
        assert!(n <= limits::MAX_BYTES, "{n} bytes");
        assert_eq!(a.procs.len() as u64 + a.procs_dropped, 1000);
        assert_eq!(a.files.len() as u64 + a.files_dropped, 200);
        assert!(!a.notes.is_empty());
        // Already small: untouched.
        let mut small = ExecAudit {
            procs: vec![exec_event(vec!["ls".into()])],
            ..ExecAudit::default()
        };
        let before = small.clone();
        small.fit(limits::MAX_BYTES);
        assert_eq!(small, before);
    }

    #[test]
    fn old_peers_decode() {
        let st: super::super::ExitStatus =
            serde_json::from_str(r#"{"code":0,"signal":null,"duration_us":5}"#).unwrap();
        assert_eq!(st.audit, None);
        let e: super::super::ExecRequest = serde_json::from_str(r#"{"argv":["true"]}"#).unwrap();
        assert!(!e.audit);
        let v = serde_json::to_value(&e).unwrap();
        assert!(v.get("audit").is_none(), "not sent when off: {v}");
    }
}
