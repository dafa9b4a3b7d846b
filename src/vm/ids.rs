//! A distinct uid/gid for every VM, from a configured range.
//!
//! Two VMMs under one uid could signal, ptrace (were ptrace allowed) and
//! open each other's files; a VMM escape would then reach every session.
//! So each session's VMM (QEMU, or Firecracker through the jailer) runs as
//! its own uid, with the gid of the same number, leased here for the
//! session's life.
//!
//! The first id of the range belongs to snapshot-making VMs: they run only
//! a template's own commands (no untrusted code), so several daemons may
//! share it. Session ids are exclusive across every daemon on the host: a
//! lease holds an open-file-description lock on byte `uid` of one lock
//! file ([`LOCK_FILE`]), which the kernel drops if the daemon dies. Within
//! a daemon a set of ids in use does the same without a syscall. Ids are
//! handed out round-robin, so a just-released id is the last to be reused.

use crate::sync::lock;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where leases of every daemon on the host meet.
pub const LOCK_FILE: &str = "/run/agent-sandbox/vm-ids.lock";

/// Above the ranges systemd hands to containers (nspawn ends at
/// 0x6FFFFFFF) and below its "foreign" range (0x7FFE0000): no login user,
/// dynamic user or subordinate id range is expected here.
pub const DEFAULT_FIRST: u32 = 2_000_000_000;
pub const DEFAULT_COUNT: u32 = 65_536;

/// `first`, `first + 1`, ..., `first + count - 1`: uids (and gids of the same
/// numbers) that belong to VMs and to nothing else on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdRange {
    pub first: u32,
    pub count: u32,
}

impl Default for IdRange {
    fn default() -> Self {
        IdRange {
            first: DEFAULT_FIRST,
            count: DEFAULT_COUNT,
        }
    }
}

impl IdRange {
    /// Ids stay clear of the system's own (below 1000), of nobody (65534)
    /// and of -1 (which `setuid` cannot take); at least one session id.
    pub fn validate(&self) -> Result<(), String> {
        if self.count < 2 {
            return Err(format!(
                "vm_ids.count {}: at least 2 (the snapshot builder's id and one session's)",
                self.count
            ));
        }
        let last = self.first as u64 + self.count as u64 - 1;
        if self.first < 1000 || last >= u32::MAX as u64 {
            return Err(format!(
                "vm_ids {}..={last}: must lie within 1000..=4294967294",
                self.first
            ));
        }
        if (self.first as u64..=last).contains(&65534) {
            return Err(format!(
                "vm_ids {}..={last}: must not include 65534 (nobody)",
                self.first
            ));
        }
        Ok(())
    }

    pub fn last(&self) -> u32 {
        self.first.saturating_add(self.count.saturating_sub(1))
    }

    /// Ids sessions lease (all but the first).
    pub fn sessions(&self) -> u32 {
        self.count.saturating_sub(1)
    }

    /// The snapshot builder's uid and gid.
    pub fn builder(&self) -> (u32, u32) {
        (self.first, self.first)
    }

    /// `FIRST:COUNT`, as `--vm-ids` takes it.
    pub fn parse(s: &str) -> Result<IdRange, String> {
        let (f, c) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: expected FIRST:COUNT"))?;
        let r = IdRange {
            first: f.parse().map_err(|e| format!("{s:?}: FIRST: {e}"))?,
            count: c.parse().map_err(|e| format!("{s:?}: COUNT: {e}"))?,
        };
        r.validate()?;
        Ok(r)
    }
}

struct Inner {
    range: IdRange,
    /// The lock file, shared by every lease of this daemon (one open file
    /// description: its byte locks never conflict with each other, which
    /// `used` takes care of, and conflict with every other daemon's).
    lock: Option<File>,
    /// Unprivileged: every VM runs as the daemon's own ids (the spawner
    /// can start nothing else), so nothing is exclusive.
    shared: Option<(u32, u32)>,
    state: Mutex<State>,
}

struct State {
    used: HashSet<u32>,
    next: u32,
}

/// The daemon's pool of VM ids.
#[derive(Clone)]
pub struct VmIds {
    inner: Arc<Inner>,
}

/// One VM's uid and gid; released (for reuse) when dropped.
pub struct IdLease {
    pub uid: u32,
    pub gid: u32,
    owner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for IdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdLease({}:{})", self.uid, self.gid)
    }
}

fn lock_byte(f: &File, uid: u32, kind: libc::c_int) -> std::io::Result<()> {
    // SAFETY: an all-zero flock is valid; the fields that matter are set.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = uid as libc::off_t;
    fl.l_len = 1;
    // SAFETY: fcntl on an fd we own with a valid flock; l_pid 0 as OFD
    // locks require.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &fl) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl VmIds {
    /// Exclusive ids from `range`, locked in `lock_path` (created, with its
    /// directory) against other daemons. Called before the daemon drops
    /// its privileges: later leases need no open.
    pub fn new(range: IdRange, lock_path: &Path) -> Result<VmIds, String> {
        range.validate()?;
        if let Some(dir) = lock_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        }
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(lock_path)
            .map_err(|e| format!("open VM id lock file {}: {e}", lock_path.display()))?;
        Ok(Self::build(range, Some(f), None))
    }

    /// [`VmIds::new`] on [`LOCK_FILE`].
    pub fn host(range: IdRange) -> Result<VmIds, String> {
        Self::new(range, &PathBuf::from(LOCK_FILE))
    }

    /// Every lease is `uid:gid` (an unprivileged daemon's own ids).
    pub fn shared(uid: u32, gid: u32) -> VmIds {
        Self::build(IdRange::default(), None, Some((uid, gid)))
    }

    fn build(range: IdRange, lock: Option<File>, shared: Option<(u32, u32)>) -> VmIds {
        VmIds {
            inner: Arc::new(Inner {
                range,
                lock,
                shared,
                state: Mutex::new(State {
                    used: HashSet::new(),
                    next: 0,
                }),
            }),
        }
    }

    pub fn range(&self) -> IdRange {
        self.inner.range
    }

    /// The snapshot builder's ids (the daemon's own when shared).
    pub fn builder(&self) -> (u32, u32) {
        self.inner.shared.unwrap_or(self.inner.range.builder())
    }

    /// Ids of sessions of this daemon right now.
    pub fn in_use(&self) -> usize {
        self.state().used.len()
    }

    /// Session ids of the range this daemon is not using (other daemons
    /// may hold some of them); `None` when every lease shares one id.
    pub fn unused(&self) -> Option<usize> {
        match self.inner.shared {
            Some(_) => None,
            None => Some((self.inner.range.sessions() as usize).saturating_sub(self.in_use())),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.inner.state)
    }

    /// A free session id, or an error saying the range is used up.
    pub fn acquire(&self) -> Result<IdLease, String> {
        if let Some((uid, gid)) = self.inner.shared {
            return Ok(IdLease {
                uid,
                gid,
                owner: None,
            });
        }
        let r = self.inner.range;
        let n = r.sessions();
        let mut st = self.state();
        let mut held_elsewhere = 0u32;
        for i in 0..n {
            let slot = (st.next + i) % n;
            let uid = r.first + 1 + slot;
            if st.used.contains(&uid) {
                continue;
            }
            if let Some(f) = &self.inner.lock {
                match lock_byte(f, uid, libc::F_WRLCK) {
                    Ok(()) => {}
                    Err(e)
                        if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) =>
                    {
                        held_elsewhere += 1;
                        continue;
                    }
                    Err(e) => return Err(format!("lock VM id {uid} (fcntl F_OFD_SETLK): {e}")),
                }
            }
            st.used.insert(uid);
            st.next = (slot + 1) % n;
            return Ok(IdLease {
                uid,
                gid: uid,
                owner: Some(self.inner.clone()),
            });
        }
        Err(format!(
            "no free VM uid in {}..={}: {} in use by this daemon, {held_elsewhere} by others \
             (raise vm_ids.count)",
            r.first + 1,
            r.last(),
            st.used.len()
        ))
    }
}

impl IdLease {
    /// Keep the id out of use for the daemon's life: its VMM may still run
    /// (a teardown that failed), and another VM must never share its uid.
    pub fn leak(mut self) {
        if self.owner.take().is_some() {
            log::warn!(
                "VM uid {} stays reserved: its VMM may not be gone",
                self.uid
            );
        }
    }
}

impl Drop for IdLease {
    fn drop(&mut self) {
        let Some(inner) = self.owner.take() else {
            return;
        };
        if let Some(f) = &inner.lock {
            if let Err(e) = lock_byte(f, self.uid, libc::F_UNLCK) {
                log::warn!("unlock VM id {}: {e}", self.uid);
            }
        }
        lock(&inner.state).used.remove(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lockfile(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("asbx-ids-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d.join("sub/vm-ids.lock")
    }

    #[test]
    fn ranges_are_validated() {
        assert!(IdRange::default().validate().is_ok());
        assert_eq!(
            IdRange::parse("100000:10").unwrap(),
            IdRange {
                first: 100000,
                count: 10
            }
        );
        for bad in [
            "0:10",
            "999:10",
            "100000:1",
            "65000:1000",
            "4294967000:400",
            "x:1",
            "5",
        ] {
            assert!(IdRange::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn leases_are_distinct_round_robin_and_exclusive_across_daemons() {
        let path = lockfile("excl");
        let range = IdRange {
            first: 300_000,
            count: 4,
        };
        let a = VmIds::new(range, &path).unwrap();
        // A second daemon on the same lock file: its own open file
        // description, so the kernel arbitrates between the two.
        let b = VmIds::new(range, &path).unwrap();
        assert_eq!(a.builder(), (300_000, 300_000));
        let l1 = a.acquire().unwrap();
        let l2 = a.acquire().unwrap();
        assert_eq!((l1.uid, l1.gid), (300_001, 300_001));
        assert_eq!(l2.uid, 300_002);
        let l3 = b.acquire().unwrap();
        assert_eq!(l3.uid, 300_003, "the other daemon skips ids held here");
        let err = b.acquire().unwrap_err();
        assert!(err.contains("no free VM uid"), "{err}");
        assert!(a.acquire().is_err());
        drop(l1);
        assert_eq!(a.in_use(), 1);
        // Released: free for the other daemon too.
        let l4 = b.acquire().unwrap();
        assert_eq!(l4.uid, 300_001);
        drop((l2, l3, l4));
        // Round robin: after 300_002 this daemon tries 300_003 first.
        let l5 = a.acquire().unwrap();
        assert_eq!(l5.uid, 300_003);
        // A leaked id stays taken.
        l5.leak();
        let got: Vec<u32> = (0..2).map(|_| a.acquire().unwrap().uid).collect();
        assert!(!got.contains(&300_003), "{got:?}");
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn a_dead_daemons_ids_come_free() {
        let path = lockfile("dead");
        let range = IdRange {
            first: 310_000,
            count: 2,
        };
        let me = VmIds::new(range, &path).unwrap();
        // Another daemon's lease: a lock on its own open of the file.
        let other = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        lock_byte(&other, 310_001, libc::F_WRLCK).unwrap();
        assert!(me.acquire().is_err());
        // It dies without unlocking: the kernel drops the lock with the file.
        drop(other);
        assert_eq!(me.acquire().unwrap().uid, 310_001);
        let _ = std::fs::remove_dir_all(path.parent().unwrap().parent().unwrap());
    }

    #[test]
    fn shared_ids_are_not_exclusive() {
        let s = VmIds::shared(1234, 5678);
        let a = s.acquire().unwrap();
        let b = s.acquire().unwrap();
        assert_eq!((a.uid, a.gid, b.uid), (1234, 5678, 1234));
        assert_eq!(s.builder(), (1234, 5678));
    }
}
