//! Capabilities: which ones each process keeps, and why.
//!
//! Every capability is tied to a [`Need`]; a process keeps the union of the
//! capabilities of its needs and drops every other one from all five sets
//! (bounding, permitted, effective, inheritable, ambient). Adding a backend
//! or feature means adding a `Need` with its reasons, so the set a process
//! runs with is always explained in one place.
//!
//! Capabilities are per thread in Linux: [`drop_to`] must run on the main
//! thread before any other thread starts, so every thread inherits the
//! reduced sets.

use caps::{CapSet, Capability, CapsHashSet};
use std::io;

use super::HardenError;

/// One kept capability and the reason it is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keep {
    pub cap: Capability,
    pub why: &'static str,
}

/// Something a process has to do that needs privileges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Need {
    /// Per-session networking (`src/net`): links, addresses, routes and
    /// nf_tables over netlink, TAP devices, namespaces under /run/netns.
    Network,
    /// Preparing files a VMM running under another uid uses (jail chroots,
    /// QEMU run dirs) and removing them after it exits.
    VmmFiles,
    /// Signalling and reaping VMMs that run under other uids.
    SignalVmms,
    /// Running Firecracker's jailer: it starts as root, builds the chroot,
    /// cgroup and namespaces, then drops to the VM's uid itself.
    Jailer,
    /// Starting a process (QEMU) directly under an unprivileged uid/gid,
    /// optionally inside a session's network namespace.
    LaunchAsOtherUid,
    /// Listening on a TCP port below 1024.
    BindLowPort,
}

impl Need {
    pub fn keeps(self) -> &'static [Keep] {
        use Capability::*;
        match self {
            Need::Network => &[
                Keep {
                    cap: CAP_NET_ADMIN,
                    why: "rtnetlink (veth, TAP, addresses, routes), nf_tables rules, TUNSETIFF/TUNSETOWNER",
                },
                Keep {
                    cap: CAP_SYS_ADMIN,
                    why: "unshare(CLONE_NEWNET) and setns() into session namespaces, bind-mounting and unmounting them under /run/netns",
                },
            ],
            Need::VmmFiles => &[
                Keep {
                    cap: CAP_CHOWN,
                    why: "hand jail files, run dirs and snapshot files to the VM's uid/gid",
                },
                Keep {
                    cap: CAP_FOWNER,
                    why: "chmod/utime files already owned by the VM's uid",
                },
                Keep {
                    cap: CAP_DAC_OVERRIDE,
                    why: "connect to VMM sockets and remove jail dirs owned by the VM's uid (mode 0700/0600)",
                },
            ],
            Need::SignalVmms => &[Keep {
                cap: CAP_KILL,
                why: "pidfd_send_signal/kill to VMMs running under other uids",
            }],
            Need::Jailer => &[
                Keep {
                    cap: CAP_SYS_ADMIN,
                    why: "jailer: mount namespace, bind mounts, pivot_root, setns into the session netns, new pid namespace",
                },
                Keep {
                    cap: CAP_SYS_CHROOT,
                    why: "jailer: chroot/pivot_root into the jail",
                },
                Keep {
                    cap: CAP_MKNOD,
                    why: "jailer: mknod /dev/kvm, /dev/net/tun, /dev/userfaultfd inside the jail",
                },
                Keep {
                    cap: CAP_SETUID,
                    why: "jailer: setuid to the VM's uid before exec of Firecracker",
                },
                Keep {
                    cap: CAP_SETGID,
                    why: "jailer: setgid/setgroups to the VM's gid",
                },
                Keep {
                    cap: CAP_CHOWN,
                    why: "jailer: chown the chroot and device nodes to the VM's uid",
                },
                Keep {
                    cap: CAP_FOWNER,
                    why: "jailer: chmod of files it created for the VM's uid",
                },
                Keep {
                    cap: CAP_DAC_OVERRIDE,
                    why: "jailer: write cgroup files and copy the exec file regardless of modes",
                },
                Keep {
                    cap: CAP_SYS_RESOURCE,
                    why: "jailer: --resource-limit may raise no-file/fsize above the current hard limit",
                },
                Keep {
                    cap: CAP_NET_ADMIN,
                    why: "jailer: setns() into a network namespace owned by the daemon",
                },
            ],
            Need::LaunchAsOtherUid => &[
                Keep {
                    cap: CAP_SETUID,
                    why: "spawner: setuid to the VMM's unprivileged uid",
                },
                Keep {
                    cap: CAP_SETGID,
                    why: "spawner: setgid/setgroups to the VMM's gid",
                },
                Keep {
                    cap: CAP_SYS_ADMIN,
                    why: "spawner: setns() into a session netns, move a child into a cgroup it does not own, a jailed QEMU's new namespaces, mounts and pivot_root",
                },
                Keep {
                    cap: CAP_DAC_OVERRIDE,
                    why: "spawner: write cgroup.procs of a per-session cgroup",
                },
            ],
            Need::BindLowPort => &[Keep {
                cap: CAP_NET_BIND_SERVICE,
                why: "listen on a port below 1024 (an API port < 1024; each session's DNS \
                      forwarder on port 53 inside the session namespace)",
            }],
        }
    }
}

/// The daemon after the spawner is forked off: networking, VMM files and
/// signals. Starting processes is the spawner's job, so no SETUID/SETGID,
/// SYS_CHROOT, MKNOD or SYS_RESOURCE.
pub const DAEMON: &[Need] = &[Need::Network, Need::VmmFiles, Need::SignalVmms];

/// The spawner: what the jailer needs (it inherits the spawner's bounding
/// set, and under no_new_privs an exec cannot gain more than the spawner's
/// permitted set) plus starting QEMU as another uid and signalling VMMs.
pub const SPAWNER: &[Need] = &[Need::Jailer, Need::LaunchAsOtherUid, Need::SignalVmms];

/// Capabilities (deduplicated) and all reasons for each.
pub fn plan(needs: &[Need]) -> Vec<(Capability, Vec<&'static str>)> {
    let mut out: Vec<(Capability, Vec<&'static str>)> = Vec::new();
    for n in needs {
        for k in n.keeps() {
            match out.iter_mut().find(|(c, _)| *c == k.cap) {
                Some((_, why)) => why.push(k.why),
                None => out.push((k.cap, vec![k.why])),
            }
        }
    }
    out.sort_by_key(|(c, _)| c.index());
    out
}

/// Bit mask (as in `/proc/<pid>/status`) of a capability list.
pub fn mask(caps: &[Capability]) -> u64 {
    caps.iter().fold(0u64, |m, c| m | c.bitmask())
}

/// What [`drop_to`] did.
#[derive(Debug, Clone)]
pub struct Dropped {
    /// Kept in permitted/effective/bounding.
    pub kept: Vec<Capability>,
    /// Wanted but not held by the process to begin with (running unprivileged).
    pub missing: Vec<Capability>,
}

fn cap_last_cap() -> u8 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u8>().ok())
        .unwrap_or(63)
}

/// Reduce the calling thread to the capabilities of `needs`: bounding,
/// permitted and effective hold exactly those (minus any the process never
/// had), inheritable and ambient are emptied.
pub fn drop_to(needs: &[Need]) -> Result<Dropped, HardenError> {
    let want: Vec<Capability> = plan(needs).into_iter().map(|(c, _)| c).collect();
    let err = |what: &str, e: caps::errors::CapsError| HardenError::Caps {
        what: what.to_string(),
        msg: e.to_string(),
    };
    let permitted = caps::read(None, CapSet::Permitted).map_err(|e| err("read permitted", e))?;
    let kept: Vec<Capability> = want
        .iter()
        .copied()
        .filter(|c| permitted.contains(c))
        .collect();
    let missing: Vec<Capability> = want
        .iter()
        .copied()
        .filter(|c| !permitted.contains(c))
        .collect();
    let keep_mask = mask(&kept);

    // Bounding first: dropping from it needs CAP_SETPCAP in the effective
    // set, which goes away below. Done with prctl over every capability the
    // kernel knows, including ones newer than the caps crate. An
    // unprivileged process (no CAP_SETPCAP) cannot and need not: it holds
    // nothing, and no_new_privs keeps an exec from gaining anything.
    let can_bound = caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)
        .map_err(|e| err("read effective", e))?;
    if !can_bound {
        log::info!("capabilities: unprivileged (no CAP_SETPCAP); bounding set left as is");
    }
    for nr in (0..=cap_last_cap()).filter(|_| can_bound) {
        if keep_mask & (1u64 << nr) != 0 {
            continue;
        }
        // SAFETY: prctl with integer arguments.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(nr), 0, 0, 0) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            // EINVAL: the kernel does not know this capability.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(HardenError::Caps {
                    what: format!("prctl(PR_CAPBSET_DROP, {nr})"),
                    msg: e.to_string(),
                });
            }
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|e| err("clear ambient", e))?;
    caps::clear(None, CapSet::Inheritable).map_err(|e| err("clear inheritable", e))?;
    let set: CapsHashSet = kept.iter().copied().collect();
    // Effective must stay a subset of permitted at every step.
    caps::set(None, CapSet::Effective, &set).map_err(|e| err("set effective", e))?;
    caps::set(None, CapSet::Permitted, &set).map_err(|e| err("set permitted", e))?;
    Ok(Dropped { kept, missing })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cap_has_a_reason_and_daemon_is_smaller_than_spawner() {
        for n in DAEMON.iter().chain(SPAWNER) {
            for k in n.keeps() {
                assert!(!k.why.is_empty(), "{n:?} {:?}", k.cap);
            }
        }
        let d: Vec<_> = plan(DAEMON).into_iter().map(|(c, _)| c).collect();
        assert!(!d.contains(&Capability::CAP_SETUID));
        assert!(!d.contains(&Capability::CAP_SYS_MODULE));
        assert!(!d.contains(&Capability::CAP_SYS_PTRACE));
        let s: Vec<_> = plan(SPAWNER).into_iter().map(|(c, _)| c).collect();
        assert!(s.contains(&Capability::CAP_SETUID));
        assert!(!s.contains(&Capability::CAP_SYS_MODULE));
    }

    #[test]
    fn mask_matches_proc_bits() {
        assert_eq!(mask(&[Capability::CAP_CHOWN]), 1);
        assert_eq!(mask(&[Capability::CAP_NET_ADMIN]), 1 << 12);
        assert_eq!(mask(&[Capability::CAP_SYS_ADMIN]), 1 << 21);
    }
}
