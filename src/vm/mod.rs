//! VM backends. Everything above this module talks to a [`Backend`] and the
//! [`Vm`]s it returns, never to Firecracker or QEMU directly.
//!
//! Draft interface: the Firecracker and QEMU backends refine it as they land.

pub mod build;
pub mod cgroup;
pub mod console;
pub mod doctor;
pub mod firecracker;
pub mod http;
pub mod ids;
pub mod jailer;
pub mod kind;
pub mod launch;
pub mod qemu;
pub mod qmp;
pub mod shape;
pub mod snapshot;
pub mod templates;

pub use kind::{BackendKind, UnknownBackend};

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{backend}: {what}: {source}")]
    Io {
        backend: &'static str,
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The VMM answered, but not with what we asked for.
    #[error("{backend}: {msg}")]
    Api { backend: &'static str, msg: String },
    #[error("{backend}: timed out after {ms} ms waiting for {what}")]
    Timeout {
        backend: &'static str,
        what: String,
        ms: u64,
    },
    /// A file the VM needs is missing or unusable; `fix` says how to repair it.
    #[error("{path}: {problem} (fix: {fix})")]
    BadFile {
        path: PathBuf,
        problem: String,
        fix: String,
    },
    /// The snapshot was made from other inputs (kernel, rootfs, VMM
    /// version, VM shape) than a restore would use now: rebuild it.
    #[error("snapshot {dir} is stale: {reason} (fix: rebuild it)")]
    StaleSnapshot { dir: PathBuf, reason: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, VmError>;

/// Where the VM's network device goes: a TAP inside a network namespace.
#[derive(Debug, Clone)]
pub struct NetAttachment {
    /// Path of the namespace handle, e.g. `/run/netns/asbx-<id>`.
    pub netns: PathBuf,
    /// TAP name inside that namespace (the same in every namespace).
    pub tap: String,
    pub guest_mac: String,
}

/// What to boot.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Unique, validated `[a-z0-9-]` id; names jails, sockets and cgroups.
    pub id: String,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub vcpus: u32,
    pub mem_mib: u32,
    /// Appended to the backend's own kernel command line.
    pub cmdline_extra: String,
    pub net: Option<NetAttachment>,
    /// Unprivileged uid/gid the VMM runs as.
    pub uid: u32,
    pub gid: u32,
    /// Per-VM runtime directory (sockets, logs); removed on destroy.
    pub run_dir: PathBuf,
}

/// What a [`Vm::checkpoint`] took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// How long the guest was stopped for it.
    pub paused: std::time::Duration,
    /// Bytes the checkpoint's files take on disk (allocated, not apparent).
    pub bytes: u64,
}

pub trait Backend: Send + Sync {
    /// `firecracker` or `qemu`.
    fn name(&self) -> &'static str;
    /// Version string of the VMM, recorded in snapshot manifests.
    fn vmm_version(&self) -> Result<String>;
    /// The version string snapshots of VMs booting `kernel` record. Same
    /// as `vmm_version` unless the backend needs a kernel to settle it (QEMU
    /// with `accel=auto` probes KVM by booting one).
    fn vmm_version_for(&self, kernel: &std::path::Path) -> Result<String> {
        let _ = kernel;
        self.vmm_version()
    }
    /// Cold boot.
    fn boot(&self, cfg: &VmConfig) -> Result<Box<dyn Vm>>;
    /// Start a fresh VMM from the snapshot in `snapshot_dir`. Fails with
    /// [`VmError::StaleSnapshot`] when the manifest does not match `cfg` and
    /// this host (the caller rebuilds), [`VmError::BadFile`] when files are
    /// missing or unreadable.
    fn restore(&self, cfg: &VmConfig, snapshot_dir: &std::path::Path) -> Result<Box<dyn Vm>> {
        self.prepare_restore(cfg, snapshot_dir)?.finish()
    }
    /// The first half of [`Backend::restore`], which a caller may run ahead
    /// of demand: checks the snapshot, starts the VMM process with its
    /// devices and the snapshot's files, and connects its control channel.
    /// No guest runs until [`PreparedRestore::finish`]. Starting the process
    /// is most of a restore's own cost (QEMU: ~30 ms of dynamic linking and
    /// device set-up; the state load itself takes a few ms).
    fn prepare_restore(
        &self,
        cfg: &VmConfig,
        snapshot_dir: &std::path::Path,
    ) -> Result<Box<dyn PreparedRestore>>;
    /// Whether the snapshot in `dir` restores as `cfg` on this host (the
    /// check [`Backend::prepare_restore`] starts with), without starting
    /// anything: [`VmError::StaleSnapshot`] names what differs.
    fn check_snapshot(&self, cfg: &VmConfig, dir: &std::path::Path) -> Result<()> {
        let version = self.vmm_version_for(&cfg.kernel)?;
        snapshot::check_fresh(dir, &snapshot::Inputs::of(self.name(), &version, cfg))
    }
    /// The snapshot in `dir` is about to be removed: drop what the backend
    /// keeps of it (QEMU: its cached sealed RAM). VMs restored from it keep
    /// running on what they hold.
    fn forget_snapshot(&self, dir: &std::path::Path) {
        let _ = dir;
    }
    /// Remove what VMs of this backend left in its own directories when a
    /// daemon died (processes, jails, cgroups): one daemon owns a state
    /// dir, so all of its VMs are orphaned at start. Only VMs whose id
    /// starts with one of `prefixes` (the ids the daemon makes) are
    /// touched: a jail dir may be shared with VMs that are not ours.
    /// Returns how many VMs. QEMU's VMMs are found by their run dirs
    /// instead (the factory's sweep).
    fn sweep_orphans(&self, prefixes: &[&str]) -> usize {
        let _ = prefixes;
        0
    }
}

/// A VMM started for a restore that has not loaded its guest yet
/// ([`Backend::prepare_restore`]). It holds the snapshot's files open, so it
/// restores the snapshot it was prepared from even if that is rebuilt
/// meanwhile. Dropping it removes everything, like [`Vm::destroy`].
pub trait PreparedRestore: Send {
    fn id(&self) -> &str;
    /// Host pid of the VMM process, while it runs.
    fn pid(&self) -> Option<i32>;
    /// Whether the VMM still runs (one that died is of no use).
    fn alive(&self) -> bool;
    /// Load the snapshot and run the guest. On error everything the VMM
    /// created is removed, as for a failed [`Backend::restore`].
    fn finish(self: Box<Self>) -> Result<Box<dyn Vm>>;
    /// Kill the VMM and remove everything it created. Idempotent.
    fn destroy(&mut self) -> Result<()>;
}

pub trait Vm: Send {
    fn id(&self) -> &str;
    /// Host pid of the VMM process, while it runs.
    fn pid(&self) -> Option<i32>;
    /// A byte stream to the guest agent (before the protocol hello).
    fn connect_agent(&mut self, deadline: Instant) -> Result<UnixStream>;
    /// The VMM translates guest code as it first runs (QEMU's TCG), so a
    /// restored guest's first exec of anything is slow; the restore hello
    /// then asks the agent to warm the exec path up while the session is
    /// idle ([`crate::proto::RestoreFixup::warm_up`]).
    fn translates_guest_code(&self) -> bool {
        false
    }
    /// Why the VM may have gone, asked when its agent connection closes
    /// ([`crate::agent::AgentClient::set_close_note`]).
    fn close_note(&self) -> Option<crate::agent::CloseNote> {
        None
    }
    /// Pause and save the VM into `dir` (files named by the backend) and
    /// write `dir/manifest.json` (see [`snapshot::Manifest`]) last. The VM is
    /// left paused; destroy it afterwards.
    fn snapshot(&mut self, dir: &std::path::Path) -> Result<()>;
    /// Save the running VM's whole state into `dir` in the backend's
    /// snapshot format (what [`Backend::restore`] takes, `manifest.json`
    /// written last, so a checkpoint is complete or absent), then let the
    /// guest run on: a checkpoint of a live session (issue #21). Works for
    /// booted and restored VMs alike; on error the VM keeps running and
    /// `dir` holds nothing of it. Where [`Vm::checkpoint_resets_agent`],
    /// the agent stream open before it is dead afterwards, whether it
    /// succeeded or not.
    fn checkpoint(&mut self, dir: &std::path::Path) -> Result<CheckpointStats> {
        let _ = dir;
        Err(VmError::Other(format!(
            "VM {}: this backend cannot checkpoint a running VM",
            self.id()
        )))
    }
    /// A [`Vm::checkpoint`] (tried, whatever its outcome) cuts the agent
    /// connection (Firecracker: the snapshot resets the vsock transport;
    /// the old stream may read EOF or nothing at all, never an answer): the
    /// caller drops its `AgentClient` and opens a new one with
    /// [`connect_agent`] (`restored: false`, the guest's clock and entropy
    /// are its own) before the next call.
    fn checkpoint_resets_agent(&self) -> bool {
        false
    }
    /// Kill the VMM, reap it and remove everything it created. Idempotent.
    fn destroy(&mut self) -> Result<()>;
}

pub use crate::agent::Started;

impl Started {
    /// How a VM that was (or was not) just restored is greeted.
    pub fn of(restored: bool, vm: &dyn Vm) -> Started {
        if restored {
            Started::Restored {
                warm_up: vm.translates_guest_code(),
            }
        } else {
            Started::Fresh
        }
    }
}

/// Connect to a VM's agent and say hello. After a restore (`restored`), the
/// hello carries the wall clock and fresh entropy
/// ([`crate::proto::Hello::restored`]): the saved guest resumes with the
/// clock and RNG state of the moment it was saved.
pub fn connect_agent(
    vm: &mut dyn Vm,
    restored: bool,
    timeout: std::time::Duration,
) -> Result<crate::agent::AgentClient> {
    let deadline = Instant::now() + timeout;
    let id = vm.id().to_string();
    let start = Started::of(restored, &*vm);
    let stream = vm.connect_agent(deadline)?;
    let left = deadline.saturating_duration_since(Instant::now());
    crate::agent::AgentClient::connect_with(
        stream,
        left.max(std::time::Duration::from_millis(1)),
        start,
    )
    .map_err(|e| VmError::Other(format!("VM {id}: agent hello: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake {
        translates: bool,
    }

    impl Vm for Fake {
        fn id(&self) -> &str {
            "fake"
        }
        fn pid(&self) -> Option<i32> {
            None
        }
        fn connect_agent(&mut self, _: Instant) -> Result<UnixStream> {
            Err(VmError::Other("fake".into()))
        }
        fn translates_guest_code(&self) -> bool {
            self.translates
        }
        fn snapshot(&mut self, _: &std::path::Path) -> Result<()> {
            Ok(())
        }
        fn destroy(&mut self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn only_a_restored_vm_that_translates_code_is_asked_to_warm_up() {
        let tcg = Fake { translates: true };
        let kvm = Fake { translates: false };
        assert_eq!(Started::of(true, &tcg), Started::Restored { warm_up: true });
        assert_eq!(
            Started::of(true, &kvm),
            Started::Restored { warm_up: false }
        );
        assert_eq!(Started::of(false, &tcg), Started::Fresh);
    }
}
