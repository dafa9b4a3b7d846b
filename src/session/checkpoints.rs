//! The checkpoint store (issue #21): saved session states under
//! `<state dir>/checkpoints`, one directory each, holding the backend's
//! snapshot files and our `meta.json`.
//!
//! A checkpoint is written into `.tmp-<id>` and renamed to `<id>` once its
//! files and `meta.json` are complete, so after a crash a directory is
//! either whole or swept at start-up: never torn. Three kinds share it: a
//! client's checkpoint (listed, owned by its key), a paused session's own
//! state (restored by its resume, and what brings it back after a restart)
//! and a fork's (gone once its copies started). Files go when the last
//! user lets go ([`Entry`]'s drop): a deleted checkpoint that sessions are
//! still being restored from stays until they are up.

use crate::net::EgressPolicy;
use crate::sync::lock;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub const META_FILE: &str = "meta.json";
const TMP_PREFIX: &str = ".tmp-";

/// What a checkpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A client's (`POST /v1/sessions/:id/snapshots`): listed, kept until
    /// deleted.
    Checkpoint,
    /// A paused session's state.
    Pause,
    /// What a fork's copies start from: removed once they are up.
    Fork,
}

/// A paused session, as much as it takes to list and resume it after a
/// restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PausedRecord {
    pub created_unix_ms: u64,
    pub idle_timeout_ms: u64,
    pub on_idle: super::OnIdle,
    pub paused_ttl_ms: u64,
    /// What was left of its lifetime when it was paused.
    pub lifetime_left_ms: u64,
    pub paused_at_unix_ms: u64,
}

/// `meta.json`: who owns a checkpoint and what its sessions are.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Meta {
    pub id: String,
    pub owner: String,
    pub kind: Kind,
    pub name: Option<String>,
    /// The session it was taken of.
    pub session_id: String,
    pub template: String,
    pub vcpus: u32,
    pub mem_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub egress: EgressPolicy,
    pub created_unix_ms: u64,
    pub paused_ms: u64,
    pub bytes: u64,
    /// Set for [`Kind::Pause`].
    pub paused: Option<PausedRecord>,
}

impl Meta {
    /// A sandbox of this checkpoint's template, shape, env and egress
    /// policy, named `id`.
    pub fn sandbox_spec(&self, id: String) -> crate::sandbox::SandboxSpec {
        crate::sandbox::SandboxSpec {
            id,
            template: self.template.clone(),
            vcpus: self.vcpus,
            mem_mib: self.mem_mib,
            disk_mib: self.disk_mib,
            env: self.env.clone(),
            egress: self.egress.clone(),
        }
    }
}

/// Drops what a backend keeps of a checkpoint about to be removed.
pub type Forget = Arc<dyn Fn(&Path) + Send + Sync>;

/// One complete checkpoint on disk. Its files are removed when the last
/// holder drops it after [`Entry::discard`].
pub struct Entry {
    dir: PathBuf,
    meta: Meta,
    discard: AtomicBool,
    forget: Forget,
}

impl Entry {
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn meta(&self) -> &Meta {
        &self.meta
    }
    /// Remove the files once nobody holds this any more.
    pub fn discard(&self) {
        self.discard.store(true, Ordering::Release);
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.discard.load(Ordering::Acquire) {
            (self.forget)(&self.dir);
            if let Err(e) = fs::remove_dir_all(&self.dir) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!("checkpoint {}: remove: {e}", self.dir.display());
                }
            }
        }
    }
}

/// A checkpoint being written: the directory to write into.
pub struct Pending {
    pub id: String,
    pub tmp: PathBuf,
}

pub struct Store {
    root: PathBuf,
    forget: Forget,
    /// Clients' checkpoints by id.
    listed: Mutex<HashMap<String, Arc<Entry>>>,
    /// Paused sessions found at start-up, until the manager takes them.
    found_paused: Mutex<Vec<Arc<Entry>>>,
}

/// Bytes the files under `dir` take on disk (allocated blocks).
pub fn disk_bytes(dir: &Path) -> u64 {
    let Ok(rd) = fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// A checkpoint id: `snap-` and 12 hex digits (`snap-<host>-...` on a
/// host with an id: `router::tagged`).
pub fn new_id() -> io::Result<String> {
    let r = crate::agent::random_u64()?;
    Ok(crate::router::tagged(
        crate::router::SNAPSHOT,
        &format!("{:012x}", r & 0xffff_ffff_ffff),
    ))
}

/// Whether `id` has the shape [`new_id`] makes (on any host).
pub fn valid_id(id: &str) -> bool {
    crate::router::is_made_id(id, crate::router::SNAPSHOT, 12)
}

impl Store {
    /// The store under `root`: what a crash left half-written is removed,
    /// fork leftovers too; complete checkpoints are loaded.
    pub fn open(root: PathBuf, forget: Forget) -> io::Result<Store> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", root.display())))?;
        let store = Store {
            root,
            forget,
            listed: Mutex::new(HashMap::new()),
            found_paused: Mutex::new(Vec::new()),
        };
        let rd = fs::read_dir(&store.root)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", store.root.display())))?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            // Written by the rename that completes a checkpoint: one whose
            // meta.json is there but unreadable (another daemon version, a
            // disk fault) is not ours to delete; it is left and named.
            let published = valid_id(&name) && path.join(META_FILE).is_file();
            let meta = if name.starts_with(TMP_PREFIX) || !valid_id(&name) {
                Err("incomplete".to_string())
            } else {
                read_meta(&path).and_then(|m| {
                    if m.id == name {
                        Ok(m)
                    } else {
                        Err(format!("meta.json names {}", m.id))
                    }
                })
            };
            match meta {
                Ok(m) if m.kind == Kind::Fork => {
                    log::info!("checkpoints: removing fork leftover {}", path.display());
                    let _ = fs::remove_dir_all(&path);
                }
                Ok(m) => {
                    let kind = m.kind;
                    let entry = Arc::new(Entry {
                        dir: path,
                        meta: m,
                        discard: AtomicBool::new(false),
                        forget: store.forget.clone(),
                    });
                    if kind == Kind::Pause {
                        lock(&store.found_paused).push(entry);
                    } else {
                        lock(&store.listed).insert(name, entry);
                    }
                }
                Err(why) if published => {
                    log::error!(
                        "checkpoints: {} cannot be used ({why}); left as it is",
                        path.display()
                    );
                }
                Err(why) => {
                    log::warn!(
                        "checkpoints: removing {} ({why}: left by a crash)",
                        path.display()
                    );
                    let _ = fs::remove_dir_all(&path);
                }
            }
        }
        Ok(store)
    }

    /// A store whose every checkpoint fails (its directory could not be
    /// made): the errors name `root`.
    pub fn unusable(root: PathBuf) -> Store {
        Store {
            root,
            forget: Arc::new(|_| {}),
            listed: Mutex::new(HashMap::new()),
            found_paused: Mutex::new(Vec::new()),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A new, empty directory to write a checkpoint into.
    pub fn begin(&self) -> io::Result<Pending> {
        let id = new_id()?;
        let tmp = self.root.join(format!("{TMP_PREFIX}{id}"));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", tmp.display())))?;
        Ok(Pending { id, tmp })
    }

    /// Removes a checkpoint that was not finished.
    pub fn abort(&self, p: Pending) {
        (self.forget)(&p.tmp);
        let _ = fs::remove_dir_all(&p.tmp);
    }

    /// Makes the written checkpoint complete: `meta.json`, then the rename
    /// that publishes it. A client's checkpoint is listed; a fork's is
    /// discarded as soon as its last holder lets go.
    pub fn commit(&self, p: Pending, mut meta: Meta) -> io::Result<Arc<Entry>> {
        meta.id = p.id.clone();
        meta.bytes = disk_bytes(&p.tmp);
        let done = self.root.join(&p.id);
        let r = write_meta(&p.tmp, &meta).and_then(|_| {
            fs::rename(&p.tmp, &done).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("rename {} to {}: {e}", p.tmp.display(), done.display()),
                )
            })
        });
        if let Err(e) = r {
            self.abort(p);
            return Err(e);
        }
        sync_dir(&self.root);
        let kind = meta.kind;
        let entry = Arc::new(Entry {
            dir: done,
            meta,
            discard: AtomicBool::new(kind == Kind::Fork),
            forget: self.forget.clone(),
        });
        if kind == Kind::Checkpoint {
            lock(&self.listed).insert(p.id, entry.clone());
        }
        Ok(entry)
    }

    /// The paused sessions found at start-up (once).
    pub fn take_paused(&self) -> Vec<Arc<Entry>> {
        std::mem::take(&mut *lock(&self.found_paused))
    }

    /// `owner`'s checkpoints (every owner's for `None`), oldest first.
    pub fn list(&self, owner: Option<&str>) -> Vec<Arc<Entry>> {
        let mut v: Vec<Arc<Entry>> = lock(&self.listed)
            .values()
            .filter(|e| owner.is_none_or(|o| e.meta.owner == o))
            .cloned()
            .collect();
        v.sort_by(|a, b| {
            (a.meta.created_unix_ms, &a.meta.id).cmp(&(b.meta.created_unix_ms, &b.meta.id))
        });
        v
    }

    /// `owner`'s checkpoint `id`.
    pub fn get(&self, owner: &str, id: &str) -> Option<Arc<Entry>> {
        lock(&self.listed)
            .get(id)
            .filter(|e| e.meta.owner == owner)
            .cloned()
    }

    /// Unlists `owner`'s checkpoint `id`; its files go when sessions being
    /// restored from it are up.
    pub fn remove(&self, owner: &str, id: &str) -> bool {
        let mut map = lock(&self.listed);
        match map.get(id) {
            Some(e) if e.meta.owner == owner => {
                e.discard();
                map.remove(id);
                true
            }
            _ => false,
        }
    }

    /// Bytes `owner`'s listed checkpoints take.
    pub fn bytes_of(&self, owner: &str) -> u64 {
        lock(&self.listed)
            .values()
            .filter(|e| e.meta.owner == owner)
            .map(|e| e.meta.bytes)
            .sum()
    }
}

fn read_meta(dir: &Path) -> Result<Meta, String> {
    let p = dir.join(META_FILE);
    let raw = fs::read(&p).map_err(|e| format!("read {}: {e}", p.display()))?;
    serde_json::from_slice(&raw).map_err(|e| format!("parse {}: {e}", p.display()))
}

fn write_meta(dir: &Path, meta: &Meta) -> io::Result<()> {
    let tmp = dir.join(format!(".{META_FILE}.tmp"));
    let body = serde_json::to_vec_pretty(meta).map_err(io::Error::other)?;
    let ctx = |what: &str, p: &Path, e: io::Error| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()))
    };
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| ctx("create", &tmp, e))?;
    f.write_all(&body).map_err(|e| ctx("write", &tmp, e))?;
    f.sync_all().map_err(|e| ctx("fsync", &tmp, e))?;
    let dst = dir.join(META_FILE);
    fs::rename(&tmp, &dst).map_err(|e| ctx("rename", &tmp, e))
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(owner: &str, kind: Kind) -> Meta {
        Meta {
            id: String::new(),
            owner: owner.into(),
            kind,
            name: Some("n".into()),
            session_id: "s1".into(),
            template: "base".into(),
            vcpus: 1,
            mem_mib: 256,
            disk_mib: 1024,
            env: BTreeMap::new(),
            egress: EgressPolicy::default(),
            created_unix_ms: 1,
            paused_ms: 2,
            bytes: 0,
            paused: None,
        }
    }

    fn store(root: &Path) -> Store {
        Store::open(root.to_path_buf(), Arc::new(|_| {})).expect("open")
    }

    #[test]
    fn a_checkpoint_is_complete_or_absent_across_restarts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("checkpoints");
        let s = store(&root);
        let p = s.begin().expect("begin");
        fs::write(p.tmp.join("memory"), vec![1u8; 8192]).expect("write");
        let e = s.commit(p, meta("k1", Kind::Checkpoint)).expect("commit");
        assert!(valid_id(&e.meta().id), "{}", e.meta().id);
        assert!(e.meta().bytes >= 8192);
        // A torn one (a crash before the rename) and a fork leftover.
        let torn = s.begin().expect("begin");
        fs::write(torn.tmp.join("memory"), b"half").expect("write");
        let fork = s.commit(s.begin().expect("begin"), meta("k1", Kind::Fork));
        let fork_dir = fork.as_ref().expect("fork").dir().to_path_buf();
        std::mem::forget(fork); // as if the daemon died holding it
        let paused = s.commit(s.begin().expect("begin"), meta("k2", Kind::Pause));
        drop(paused);
        // A complete one this daemon cannot read: kept, not listed.
        let alien = root.join("snap-00000000abcd");
        fs::create_dir_all(&alien).expect("mkdir");
        fs::write(alien.join(META_FILE), b"{\"format\": 99}").expect("write");
        drop(s);
        let s = store(&root);
        assert!(
            alien.join(META_FILE).exists(),
            "an unreadable checkpoint was deleted"
        );
        assert!(!torn.tmp.exists(), "torn checkpoint swept");
        assert!(!fork_dir.exists(), "fork leftover swept");
        let listed = s.list(None);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].meta().id, e.meta().id);
        assert_eq!(s.take_paused().len(), 1);
        assert!(s.take_paused().is_empty());
        assert!(s.get("k2", &e.meta().id).is_none(), "another key's");
        assert!(s.bytes_of("k1") >= 8192);
    }

    #[test]
    fn files_go_with_the_last_holder_of_a_deleted_checkpoint() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = store(dir.path());
        let e = s
            .commit(s.begin().expect("begin"), meta("k1", Kind::Checkpoint))
            .expect("commit");
        let path = e.dir().to_path_buf();
        let id = e.meta().id.clone();
        assert!(!s.remove("k2", &id), "not the owner");
        assert!(s.remove("k1", &id));
        assert!(s.list(None).is_empty());
        assert!(path.exists(), "still held by a restore");
        drop(e);
        assert!(!path.exists());
        let f = s
            .commit(s.begin().expect("begin"), meta("k1", Kind::Fork))
            .expect("commit");
        let fpath = f.dir().to_path_buf();
        assert!(s.list(None).is_empty(), "forks are not listed");
        drop(f);
        assert!(!fpath.exists());
    }

    #[test]
    fn ids_are_checked() {
        assert!(valid_id("snap-0123456789ab"));
        for bad in [
            "snap-0123456789aB",
            "snap-0123",
            "x",
            "snap-0123456789abc",
            "../etc",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
