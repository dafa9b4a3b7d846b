//! VMMs started ahead of demand ("standby"). For a template that restores
//! from a snapshot, the factory keeps a VMM per recently used shape
//! started: uid leased, network set up, process running with its devices
//! and the snapshot's files, control channel connected, no guest loaded
//! ([`crate::vm::Backend::prepare_restore`]). A session that finds one
//! only loads the snapshot and greets the agent: it skips the VMM's
//! process start (QEMU: ~30 ms of dynamic linking and device set-up, most
//! of a restore's own cost; a jailer and Firecracker start on a KVM host)
//! and its network set-up. A standby runs no guest: it costs its VMM
//! process's memory and no CPU.
//!
//! It is made on a thread of its own after each restore of its shape (and
//! once at start for the default template: `SandboxFactory::prime`), so it
//! never sits on a session's request path. It is used only
//! by a session of exactly its shape (template, images, snapshot files,
//! vCPUs, memory, egress policy); one whose snapshot was rebuilt since, or
//! whose VMM died, is removed instead.

use super::seams::{NetLease, ResolvedTemplate};
use crate::net::EgressPolicy;
use crate::sync::lock;
use crate::vm::ids::IdLease;
use crate::vm::PreparedRestore;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a session must match to use a standby.
#[derive(Debug, Clone, PartialEq)]
pub struct Key {
    template: String,
    tpl: ResolvedTemplate,
    /// The snapshot manifest's identity (device, inode, mtime, size): a
    /// rebuilt snapshot writes a new manifest, and a standby holds the old
    /// snapshot's files.
    stamp: Option<(u64, u64, i64, i64, u64)>,
    egress: EgressPolicy,
}

impl Key {
    pub fn new(template: &str, tpl: &ResolvedTemplate, dir: &Path, egress: &EgressPolicy) -> Key {
        let stamp = std::fs::metadata(dir.join(crate::vm::snapshot::MANIFEST_FILE))
            .ok()
            .map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size()));
        Key {
            template: template.to_string(),
            tpl: tpl.clone(),
            stamp,
            egress: egress.clone(),
        }
    }

    pub fn egress(&self) -> &EgressPolicy {
        &self.egress
    }

    /// `self` replaces `old`: same template and policy, other images,
    /// snapshot or machine shape.
    fn supersedes(&self, old: &Key) -> bool {
        self.template == old.template && self.egress == old.egress && self != old
    }
}

/// What a VM needs before its VMM starts: an id, a uid/gid, a network.
pub struct Provision {
    pub id: String,
    pub lease: IdLease,
    pub net: Option<Box<dyn NetLease>>,
    pub net_took: Option<Duration>,
}

impl Provision {
    /// Give the network back; the uid too unless the VMM may still run
    /// (`vmm_gone == false`), in which case it must not go to another VM.
    pub fn release(mut self, vmm_gone: bool) {
        if let Some(n) = self.net.as_mut() {
            if let Err(e) = n.teardown() {
                log::warn!("sandbox {}: network teardown: {e}", self.id);
            }
        }
        if !vmm_gone {
            self.lease.leak();
        }
    }
}

/// A standby VMM.
pub struct Ready {
    pub key: Key,
    pub prov: Provision,
    pub prepared: Box<dyn PreparedRestore>,
    pub since: Instant,
}

impl Ready {
    /// Stop the VMM and give back what it held.
    pub fn discard(mut self) {
        let gone = match self.prepared.destroy() {
            Ok(()) => true,
            Err(e) => {
                log::warn!("standby VMM {}: teardown: {e}", self.prov.id);
                false
            }
        };
        self.prov.release(gone);
    }
}

/// Standbys taken out to make room: discarded when this is dropped.
struct Evicted(Vec<Ready>);

impl Drop for Evicted {
    fn drop(&mut self) {
        self.0.drain(..).for_each(Ready::discard);
    }
}

#[derive(Default)]
struct State {
    ready: Vec<Ready>,
    /// Shapes being prepared right now.
    preparing: Vec<Key>,
    closed: bool,
}

pub struct Standby {
    /// Most standby VMMs kept (ready or being made) at once.
    cap: usize,
    state: Mutex<State>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Standby {
    pub fn new(cap: usize) -> Arc<Standby> {
        Arc::new(Standby {
            cap,
            state: Mutex::default(),
            threads: Mutex::default(),
        })
    }

    /// A live standby of exactly `key`'s shape, if one is ready. Dead ones
    /// met on the way are removed.
    pub fn take(&self, key: &Key) -> Option<Ready> {
        let mut dead = Vec::new();
        let found = {
            let mut st = lock(&self.state);
            let mut found = None;
            while let Some(i) = st.ready.iter().position(|r| r.key == *key) {
                let r = st.ready.swap_remove(i);
                if r.prepared.alive() {
                    found = Some(r);
                    break;
                }
                dead.push(r);
            }
            found
        };
        for r in dead {
            log::warn!("standby VMM {}: died while waiting; removed", r.prov.id);
            r.discard();
        }
        found
    }

    /// Whether standbys are made at all (`standby_vmms` > 0).
    pub fn enabled(&self) -> bool {
        self.cap > 0
    }

    /// Run `f` on a thread of its own that [`Standby::close`] waits for;
    /// not after close. Whether it was started (if not, `f` is dropped).
    pub fn spawn<F>(&self, name: &str, f: F) -> bool
    where
        F: FnOnce() + Send + 'static,
    {
        if lock(&self.state).closed {
            return false;
        }
        match crate::harden::thread::spawn(
            crate::harden::ThreadKind::Session,
            std::thread::Builder::new().name(name.into()),
            f,
        ) {
            Ok(h) => {
                let mut threads = lock(&self.threads);
                threads.retain(|t| !t.is_finished());
                threads.push(h);
                true
            }
            Err(e) => {
                log::warn!("standby VMMs: thread {name}: {e}");
                false
            }
        }
    }

    /// How many standbys are ready (for tests and logs).
    pub fn ready(&self) -> usize {
        lock(&self.state).ready.len()
    }

    /// Have a standby of `key`'s shape made by `make` on a thread of its
    /// own, unless one is ready or being made. At the cap, the oldest
    /// standby of another shape makes room; with none, nothing is made.
    pub fn refill<F>(self: &Arc<Self>, key: Key, make: F)
    where
        F: FnOnce() -> super::Result<Ready> + Send + 'static,
    {
        if self.cap == 0 {
            return;
        }
        // Discarded off the caller's path, by the thread below, or here
        // when no thread is started (the guard's Drop either way).
        let mut evicted = Evicted(Vec::new());
        {
            let mut st = lock(&self.state);
            if st.closed || st.preparing.contains(&key) || st.ready.iter().any(|r| r.key == key) {
                return;
            }
            // Superseded: the same template and policy, but its images,
            // snapshot or shape changed. No session will ask for it again.
            while let Some(i) = st.ready.iter().position(|r| key.supersedes(&r.key)) {
                evicted.0.push(st.ready.swap_remove(i));
            }
            if st.ready.len() + st.preparing.len() >= self.cap {
                let oldest = st
                    .ready
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, r)| r.since)
                    .map(|(i, _)| i);
                match oldest {
                    Some(i) => evicted.0.push(st.ready.swap_remove(i)),
                    None => return,
                }
            }
            st.preparing.push(key.clone());
        }
        let me = self.clone();
        let k = key.clone();
        let started = self.spawn("vmm-standby", move || {
            drop(evicted);
            let made = make();
            let mut st = lock(&me.state);
            st.preparing.retain(|p| *p != k);
            match made {
                Ok(r) if !st.closed => {
                    log::info!(
                        "standby VMM {} ready for template {}",
                        r.prov.id,
                        k.template
                    );
                    st.ready.push(r);
                }
                Ok(r) => {
                    drop(st);
                    r.discard();
                }
                Err(e) => {
                    drop(st);
                    log::warn!("standby VMM for template {}: {e}", k.template);
                }
            }
        });
        if !started {
            lock(&self.state).preparing.retain(|p| *p != key);
        }
    }

    /// Remove every ready standby (their uids and networks are needed).
    pub fn clear(&self) {
        let ready: Vec<_> = lock(&self.state).ready.drain(..).collect();
        for r in ready {
            r.discard();
        }
    }

    /// Stop making standbys, wait for those being made, remove them all.
    pub fn close(&self) {
        lock(&self.state).closed = true;
        // A thread that checked `closed` just before may still add one.
        loop {
            let threads: Vec<_> = lock(&self.threads).drain(..).collect();
            if threads.is_empty() {
                break;
            }
            for t in threads {
                let _ = t.join();
            }
        }
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::ids::VmIds;
    use crate::vm::{Result as VmResult, Vm, VmError};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    #[derive(Default)]
    struct Probe {
        dead: AtomicBool,
        destroyed: AtomicUsize,
        made: AtomicUsize,
    }

    struct Fake(Arc<Probe>);

    impl PreparedRestore for Fake {
        fn id(&self) -> &str {
            "fake"
        }
        fn pid(&self) -> Option<i32> {
            None
        }
        fn alive(&self) -> bool {
            !self.0.dead.load(Ordering::SeqCst)
        }
        fn finish(self: Box<Self>) -> VmResult<Box<dyn Vm>> {
            Err(VmError::Other("fake".into()))
        }
        fn destroy(&mut self) -> VmResult<()> {
            self.0.destroyed.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    fn key(dir: &Path, template: &str) -> Key {
        let tpl = ResolvedTemplate {
            kernel: "/k".into(),
            rootfs: "/r".into(),
            snapshot_dir: Some(dir.to_path_buf()),
            cmdline_extra: String::new(),
            vcpus: 1,
            mem_mib: 512,
        };
        Key::new(template, &tpl, dir, &EgressPolicy::default())
    }

    fn maker(
        k: Key,
        p: Arc<Probe>,
    ) -> impl FnOnce() -> super::super::Result<Ready> + Send + 'static {
        move || {
            p.made.fetch_add(1, Ordering::SeqCst);
            Ok(Ready {
                key: k,
                prov: Provision {
                    id: "asbx-test".into(),
                    lease: VmIds::shared(1, 1)
                        .acquire()
                        .map_err(super::super::SandboxError::Other)?,
                    net: None,
                    net_took: None,
                },
                prepared: Box::new(Fake(p)),
                since: Instant::now(),
            })
        }
    }

    fn settle(s: &Standby) {
        let threads: Vec<_> = lock(&s.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }

    /// Ask for a standby of `k` made by `p`'s fake, and wait for it.
    fn fill(s: &Arc<Standby>, k: &Key, p: &Arc<Probe>) {
        s.refill(k.clone(), maker(k.clone(), p.clone()));
        settle(s);
    }

    /// Write the snapshot manifest in `dir` anew, as a rebuild does (temp
    /// file + rename).
    fn rebuild(dir: &Path) {
        let tmp = dir.join("m.tmp");
        std::fs::write(&tmp, "{}").expect("manifest");
        std::fs::rename(&tmp, dir.join(crate::vm::snapshot::MANIFEST_FILE)).expect("rename");
    }

    #[test]
    fn one_standby_per_shape_taken_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, p) = (Standby::new(2), Arc::new(Probe::default()));
        let k = key(dir.path(), "base");
        fill(&s, &k, &p);
        fill(&s, &k, &p);
        assert_eq!(
            p.made.load(Ordering::SeqCst),
            1,
            "a second one of a ready shape"
        );
        assert!(s.take(&key(dir.path(), "python")).is_none());
        assert!(s.take(&k).is_some());
        assert!(s.take(&k).is_none());
        s.close();
    }

    #[test]
    fn at_the_cap_the_oldest_other_shape_makes_room() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, a, b) = (
            Standby::new(1),
            Arc::new(Probe::default()),
            Arc::new(Probe::default()),
        );
        let (ka, kb) = (key(dir.path(), "base"), key(dir.path(), "python"));
        fill(&s, &ka, &a);
        fill(&s, &kb, &b);
        assert_eq!(a.destroyed.load(Ordering::SeqCst), 1);
        assert_eq!(s.ready(), 1);
        assert!(s.take(&ka).is_none());
        assert!(s.take(&kb).is_some());
        // No room is made from nothing: with the cap 0, nothing is made.
        let off = Standby::new(0);
        fill(&off, &ka, &a);
        assert_eq!(a.made.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_rebuilt_snapshot_replaces_its_templates_standby_below_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        rebuild(dir.path());
        let (s, old, new) = (
            Standby::new(2),
            Arc::new(Probe::default()),
            Arc::new(Probe::default()),
        );
        let k_old = key(dir.path(), "base");
        fill(&s, &k_old, &old);
        rebuild(dir.path());
        let k_new = key(dir.path(), "base");
        fill(&s, &k_new, &new);
        assert_eq!(
            old.destroyed.load(Ordering::SeqCst),
            1,
            "the stale one stays"
        );
        assert_eq!(s.ready(), 1);
        assert!(s.take(&k_new).is_some());
    }

    #[test]
    fn a_dead_standby_is_removed_not_handed_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, p) = (Standby::new(2), Arc::new(Probe::default()));
        let k = key(dir.path(), "base");
        fill(&s, &k, &p);
        p.dead.store(true, Ordering::SeqCst);
        assert!(s.take(&k).is_none());
        assert_eq!(p.destroyed.load(Ordering::SeqCst), 1);
        assert_eq!(s.ready(), 0);
    }

    #[test]
    fn a_rebuilt_snapshot_is_another_shape() {
        let dir = tempfile::tempdir().expect("tempdir");
        rebuild(dir.path());
        let old = key(dir.path(), "base");
        rebuild(dir.path());
        assert_ne!(old, key(dir.path(), "base"));
    }

    #[test]
    fn close_removes_standbys_and_those_still_being_made() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, p) = (Standby::new(2), Arc::new(Probe::default()));
        let k = key(dir.path(), "base");
        fill(&s, &k, &p);
        let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
        let (q, k2) = (Arc::new(Probe::default()), key(dir.path(), "python"));
        let slow = maker(k2.clone(), q.clone());
        s.refill(k2, move || {
            let _ = gate_rx.recv();
            slow()
        });
        let closer = {
            let s = s.clone();
            std::thread::spawn(move || s.close())
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(gate_tx);
        closer.join().expect("close");
        assert_eq!(p.destroyed.load(Ordering::SeqCst), 1);
        assert_eq!(q.made.load(Ordering::SeqCst), 1);
        assert_eq!(
            q.destroyed.load(Ordering::SeqCst),
            1,
            "made after close, kept"
        );
        assert_eq!(s.ready(), 0);
        fill(&s, &k, &p);
        assert_eq!(p.made.load(Ordering::SeqCst), 1, "made after close");
    }
}
