//! Audited execs ([`crate::proto::ExecRequest::audit`]): the process tree
//! ([`procev`]) and the file changes ([`fscan`]) of one exec, returned in
//! its exit status. Nothing here runs for an exec without the flag.

pub mod fscan;
pub mod procev;

use crate::proto::audit::limits;
use crate::proto::{ExecAudit, FileChangeKind};
use crate::sync::lock;
use fscan::{Change, Kind, Prev, Root, Snapshot, TextCache};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

/// The overlay root's upper dir and lower layer (the image), kept open by
/// init before the old root's mount goes: neither is reachable by path
/// afterwards, and no guest process can reach them at all.
static OVERLAY: OnceLock<(OwnedFd, OwnedFd)> = OnceLock::new();

/// Small text files of earlier audited scans, for diffs.
static CACHE: Mutex<Option<TextCache>> = Mutex::new(None);

/// Called by init once the overlay root is in place.
pub fn set_overlay(upper: OwnedFd, lower: OwnedFd) {
    let _ = OVERLAY.set((upper, lower));
}

fn open_dir(p: &str) -> Option<OwnedFd> {
    std::fs::File::open(p).ok().map(OwnedFd::from)
}

fn dev_of(p: &str) -> Option<u64> {
    std::fs::symlink_metadata(p)
        .ok()
        .map(|m| std::os::unix::fs::MetadataExt::dev(&m))
}

/// The trees an exec can write to: the overlay's upper dir (as "/") and the
/// other writable mounts, or without an overlay (the agent as a plain
/// process) the workspace alone.
fn roots(workspace: &Path, notes: &mut Vec<String>) -> Vec<Root> {
    let mut out = Vec::new();
    match OVERLAY.get() {
        Some((upper, lower)) => {
            if let (Ok(u), Ok(l)) = (upper.try_clone(), lower.try_clone()) {
                out.push(Root {
                    guest: "/".into(),
                    dir: u,
                    lower: Some(l),
                });
            }
            let root_dev = dev_of("/");
            for m in ["/tmp", "/dev/shm"] {
                // Only separate mounts: otherwise the upper dir has it.
                if dev_of(m) != root_dev {
                    if let Some(dir) = open_dir(m) {
                        out.push(Root {
                            guest: m.into(),
                            dir,
                            lower: None,
                        });
                    }
                }
            }
        }
        None => {
            let ws = workspace.to_string_lossy().into_owned();
            if let Some(dir) = open_dir(&ws) {
                out.push(Root {
                    guest: ws.trim_end_matches('/').to_string(),
                    dir,
                    lower: None,
                });
            }
            notes.push(
                "no overlay root (the agent is not the VM's init): only the workspace is scanned"
                    .into(),
            );
        }
    }
    out
}

/// One audited exec, from before its spawn to its end.
pub struct Session {
    procs: Option<(&'static procev::Watch, u64)>,
    roots: Vec<Root>,
    before: Snapshot,
    notes: Vec<String>,
}

/// Starts auditing an exec that is about to be spawned: subscribes to
/// process events and takes the "before" scan.
pub fn begin(workspace: &Path) -> Session {
    let mut notes = Vec::new();
    let procs = match procev::watch() {
        Ok(w) => match w.begin() {
            Ok(id) => Some((&**w, id)),
            Err(e) => {
                notes.push(format!(
                    "process events: subscribe failed ({e}): no process tree"
                ));
                None
            }
        },
        Err(why) => {
            notes.push(why.to_string());
            None
        }
    };
    let roots = roots(workspace, &mut notes);
    let before = fscan::scan(&roots);
    Session {
        procs,
        roots,
        before,
        notes,
    }
}

impl Session {
    /// The exec's process is running as `pid`.
    pub fn spawned(&self, pid: i32) {
        if let Some((w, id)) = self.procs {
            w.root(id, pid);
        }
    }

    /// The exec has ended: its record.
    pub fn finish(mut self) -> ExecAudit {
        let mut a = ExecAudit::default();
        if let Some((w, id)) = self.procs.take() {
            let (events, dropped, notes) = w.end(id);
            a.procs = events;
            a.procs_dropped = dropped;
            a.procs_tracked = true;
            self.notes.extend(notes);
        }
        self.files(&mut a);
        for n in std::mem::take(&mut self.notes) {
            a.note(n);
        }
        a.fit(limits::MAX_BYTES);
        a
    }

    fn files(&mut self, a: &mut ExecAudit) {
        if self.roots.is_empty() {
            self.notes
                .push("no writable root could be opened: no file changes".into());
            return;
        }
        a.files_tracked = true;
        let after = fscan::scan(&self.roots);
        if self.before.truncated || after.truncated {
            self.notes.push(format!(
                "scan stopped at {} entries: changes past it are missed",
                fscan::MAX_SCAN_ENTRIES
            ));
        }
        let mut cache_slot = lock(&CACHE);
        let cache = cache_slot.get_or_insert_with(TextCache::default);
        let mut hash_left = fscan::HASH_BUDGET;
        let empty = Default::default();
        for (i, root) in self.roots.iter().enumerate() {
            let b = self.before.roots.get(i).unwrap_or(&empty);
            let Some(af) = after.roots.get(i) else {
                continue;
            };
            let lower_fd = root.lower.as_ref().map(|l| l.as_raw_fd());
            let lower = |rel: &str| lower_fd.and_then(|fd| fscan::lower_meta(fd, rel));
            let mut changes = fscan::classify(b, af, &lower);
            if let Some(fd) = lower_fd {
                changes.extend(hidden_image_entries(fd, b, af, &changes));
                changes.sort_by(|x, y| x.rel.cmp(&y.rel));
                changes.dedup_by(|x, y| x.rel == y.rel);
            }
            let mut r = fscan::Render {
                root,
                cache,
                hash_left: &mut hash_left,
                notes: &mut self.notes,
            };
            for c in &changes {
                if a.files.len() >= limits::MAX_FILES {
                    a.files_dropped += 1;
                    continue;
                }
                if let Some(fc) = r.change(c) {
                    a.files.push(fc);
                }
            }
        }
    }
}

/// Image entries a deleted image directory (a whiteout now) or a
/// recreated one (opaque now) takes with it: the upper dir shows only
/// the directory itself.
fn hidden_image_entries(
    lower: std::os::fd::RawFd,
    before: &std::collections::BTreeMap<String, fscan::Meta>,
    after: &std::collections::BTreeMap<String, fscan::Meta>,
    changes: &[Change],
) -> Vec<Change> {
    let mut out = Vec::new();
    let mut dirs: Vec<&str> = changes
        .iter()
        .filter(|c| c.change == FileChangeKind::Deleted && c.kind == Kind::Dir)
        .filter(|c| matches!(c.prev, Prev::Lower(_)))
        .map(|c| c.rel.as_str())
        .collect();
    for (rel, m) in after {
        if m.kind == Kind::Dir && m.opaque && !before.get(rel).is_some_and(|b| b.opaque) {
            dirs.push(rel);
        }
    }
    let cap = limits::MAX_FILES * 2;
    for d in dirs {
        for (p, m) in fscan::lower_subtree(lower, d, cap) {
            // Still present (an upper entry shadows it): not deleted here.
            if after.get(&p).is_some_and(|x| x.kind != Kind::Whiteout) || before.contains_key(&p) {
                continue;
            }
            out.push(Change {
                rel: p,
                change: FileChangeKind::Deleted,
                kind: m.kind,
                now: None,
                prev: Prev::Lower(m),
            });
        }
    }
    out
}

impl Drop for Session {
    /// An exec that failed to start still ends its subscription.
    fn drop(&mut self) {
        if let Some((w, id)) = self.procs.take() {
            let _ = w.end(id);
        }
    }
}
