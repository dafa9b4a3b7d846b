//! QEMU's command line: the machine, its devices, the fds it is handed
//! and the kernel command line; and the machine tag a snapshot records.

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::path::Path;

use super::{Accel, AGENT_SOCK, QMP_SOCK};
use crate::vm::launch::{ProcLimits, DEFAULT_NOFILE};
use crate::vm::{cgroup, snapshot, Result, VmConfig, VmError};

/// Kernel command line before `cmdline_extra`.
// reboot=t: microvm has no i8042, so the keyboard-controller reboot
// Firecracker uses (reboot=k) would hang; a triple fault makes QEMU
// (-no-reboot) exit at once.
// pci=off: microvm has no PCI bus; probing for one costs a TCG boot ~50 ms.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=t panic=1 root=/dev/vda ro \
     rootfstype=erofs init=/sbin/sandbox-agent pci=off quiet";

/// Added under TCG only (under KVM the kernel has kvmclock and a TSC, and
/// neither cost exists):
/// - `noapictimer`: the kernel spends ~230 ms of a TCG boot (far more
///   under host load: it waits on jiffies) calibrating and then verifying
///   the local APIC timer, and the verification fails under TCG, leaving
///   the PIT as the tick. This goes straight to that end state.
/// - `lpj=`: with no TSC it can calibrate, the kernel times a delay loop
///   (~80 ms); a preset loops-per-jiffy (a value that loop measured here at
///   HZ=250; it varies 4x with host load anyway) skips it. It only scales
///   udelay(), which virtio devices do not rely on.
pub const TCG_CMDLINE: &str = "noapictimer lpj=163072";

/// Guest RAM as QEMU opens it: the memfd at [`MEM_FD`] (a booted VM's
/// own [`GuestRam`], or a restore's [`SnapshotMemory`]).
pub(super) const MEM_PATH: &str = "/proc/self/fd/5";

/// Id of the guest RAM's memory backend, and so of its RAM block in a
/// migration stream.
pub(super) const MEM_BACKEND_ID: &str = "mem";

/// Where QEMU finds the fds it is handed: the TAP (`-netdev tap,fd=`), the
/// snapshot state (`migrate-incoming fd:`) and the snapshot RAM.
pub(super) const TAP_FD: RawFd = 3;
pub(super) const STATE_FD: RawFd = 4;
/// The snapshot RAM memfd of a restore ([`MEM_PATH`]).
pub(super) const MEM_FD: RawFd = 5;

pub(super) fn version_string(qemu: &str, accel: Accel) -> String {
    format!(
        "{qemu}; accel={}; {}",
        accel.as_str(),
        snapshot::machine_tag(&[cpu_model(accel), &fixed_cmdline(accel), NET_DEVICE])
    )
}

pub(super) fn cpu_model(accel: Accel) -> &'static str {
    match accel {
        Accel::Kvm => "host",
        _ => "max",
    }
}

pub(super) struct ArgvSpec {
    pub(super) accel: Accel,
    pub(super) tap_fd: Option<RawFd>,
    pub(super) incoming: bool,
}

/// QEMU's file-size and open-file limits (as the jailer gives Firecracker):
/// QEMU writes no RAM file (its RAM is a memfd the daemon sized) and the
/// device state of a snapshot is small (RAM stays out of it); the bound
/// is the guest's RAM size plus slack. `nofile`: the operator's open-file
/// limit, else [`DEFAULT_NOFILE`].
pub fn qemu_limits(mem_mib: u32, nofile: Option<u64>) -> ProcLimits {
    ProcLimits {
        fsize: Some((u64::from(mem_mib) << 20) + (64 << 20)),
        nofile: Some(nofile.unwrap_or(DEFAULT_NOFILE)),
    }
}

/// QEMU option values are comma-separated: a literal comma is doubled.
pub(super) fn opt_path(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// The guest NIC. No guest announce: after a restore QEMU would ask the
/// guest to send gratuitous ARPs (and notify every netlink listener) for a
/// link whose peer is a fresh TAP that has no stale entry to correct; QEMU
/// announces from the host side instead. Part of the machine tag: a
/// snapshot's device features must match the restoring command line.
pub(super) const NET_DEVICE: &str = "virtio-net-device,guest_announce=off";

/// The kernel command line before `cmdline_extra`.
pub(super) fn fixed_cmdline(accel: Accel) -> String {
    let mut c = DEFAULT_CMDLINE.to_string();
    if accel != Accel::Kvm {
        c.push(' ');
        c.push_str(TCG_CMDLINE);
    }
    c
}

pub fn cmdline(cfg: &VmConfig, accel: Accel) -> String {
    let mut c = fixed_cmdline(accel);
    let extra = cfg.cmdline_extra.trim();
    if !extra.is_empty() {
        c.push(' ');
        c.push_str(extra);
    }
    c
}

pub(super) fn build_argv(cfg: &VmConfig, spec: &ArgvSpec) -> Vec<OsString> {
    let run = &cfg.run_dir;
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("agent-sandbox-{}", cfg.id),
        // Devices on the kernel command line need acpi=off (see MEASURED.md).
        "-M".into(),
        format!("microvm,acpi=off,memory-backend={MEM_BACKEND_ID}"),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-nographic".into(),
        "-no-reboot".into(),
    ];
    match spec.accel {
        Accel::Kvm => a.extend(["-accel".into(), "kvm".into()]),
        _ => a.extend([
            "-accel".into(),
            format!("tcg,tb-size={}", cgroup::TCG_TB_MIB),
        ]),
    }
    a.extend(["-cpu".into(), cpu_model(spec.accel).into()]);
    a.extend([
        "-smp".into(),
        cfg.vcpus.to_string(),
        "-m".into(),
        format!("{}M", cfg.mem_mib),
        "-object".into(),
        format!(
            "memory-backend-file,id={MEM_BACKEND_ID},size={}M,mem-path={},share={}",
            cfg.mem_mib,
            MEM_PATH,
            // A restore maps the snapshot RAM privately (module docs).
            if spec.incoming { "off" } else { "on" }
        ),
        "-chardev".into(),
        "stdio,id=con,signal=off".into(),
        "-serial".into(),
        "chardev:con".into(),
        "-drive".into(),
        format!(
            "id=root,file={},format=raw,if=none,readonly=on",
            opt_path(&cfg.rootfs)
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!(
            "socket,id=agent,path={},server=on,wait=off",
            opt_path(&run.join(AGENT_SOCK))
        ),
        "-device".into(),
        "virtserialport,chardev=agent,name=agent".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", opt_path(&run.join(QMP_SOCK))),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
    ]);
    // A restore needs no kernel: the running one is in the snapshot RAM.
    // Without it QEMU skips reading and staging the ~20 MiB vmlinux
    // (~10 ms of a TCG restore here).
    if !spec.incoming {
        a.extend([
            "-kernel".into(),
            cfg.kernel.display().to_string(),
            "-append".into(),
            cmdline(cfg, spec.accel),
        ]);
    }
    if let (Some(fd), Some(net)) = (spec.tap_fd, &cfg.net) {
        a.extend([
            "-netdev".into(),
            // QEMU takes the virtio-net header from the fd's IFF_VNET_HDR
            // (it refuses `vnet_hdr=` together with `fd=`).
            format!("tap,id=n0,fd={fd}"),
            "-device".into(),
            format!("{NET_DEVICE},netdev=n0,mac={}", net.guest_mac),
        ]);
    }
    if spec.incoming {
        // The state fd is handed over by number in `migrate-incoming`, after
        // x-ignore-shared is switched on (QEMU 7.2 has no property for it).
        a.extend(["-incoming".into(), "defer".into()]);
    }
    a.into_iter().map(OsString::from).collect()
}

pub(super) fn validate_mac(mac: &str) -> Result<()> {
    let parts: Vec<&str> = mac.split(':').collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(())
    } else {
        Err(VmError::Other(format!(
            "guest MAC {mac:?} is not six colon-separated hex bytes"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::NetAttachment;

    fn cfg() -> VmConfig {
        VmConfig {
            id: "t1".into(),
            kernel: "/k/vmlinux".into(),
            rootfs: "/r/base,evil.erofs".into(),
            vcpus: 2,
            mem_mib: 256,
            cmdline_extra: "sandbox.ip=10.0.0.2/30".into(),
            net: Some(NetAttachment {
                netns: "/run/netns/x".into(),
                tap: "tap0".into(),
                guest_mac: "02:00:00:00:00:01".into(),
            }),
            uid: 1000,
            gid: 1000,
            run_dir: "/run/asbx/t1".into(),
        }
    }

    fn argv(spec: &ArgvSpec) -> Vec<String> {
        build_argv(&cfg(), spec)
            .into_iter()
            .map(|s| s.into_string().unwrap_or_default())
            .collect()
    }

    fn after<'a>(a: &'a [String], flag: &str) -> Vec<&'a str> {
        a.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn argv_has_the_isolation_and_device_flags() {
        let a = argv(&ArgvSpec {
            accel: Accel::Tcg,
            tap_fd: Some(7),
            incoming: true,
        });
        assert_eq!(after(&a, "-M"), ["microvm,acpi=off,memory-backend=mem"]);
        assert_eq!(
            after(&a, "-sandbox"),
            ["on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
        );
        for f in ["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"] {
            assert!(a.iter().any(|x| x == f), "{f} missing");
        }
        assert_eq!(
            after(&a, "-accel"),
            [format!("tcg,tb-size={}", cgroup::TCG_TB_MIB)]
        );
        assert_eq!(after(&a, "-cpu"), ["max"]);
        assert_eq!(after(&a, "-smp"), ["2"]);
        // A comma in a path must not start a new QEMU option.
        assert!(after(&a, "-drive")[0].contains("file=/r/base,,evil.erofs,"));
        assert!(after(&a, "-drive")[0].contains("readonly=on"));
        // A restore runs the kernel in the snapshot RAM.
        assert!(after(&a, "-kernel").is_empty());
        assert!(after(&a, "-append").is_empty());
        assert_eq!(after(&a, "-netdev"), ["tap,id=n0,fd=7"]);
        assert!(after(&a, "-device")
            .contains(&"virtio-net-device,guest_announce=off,netdev=n0,mac=02:00:00:00:00:01"));
        assert!(after(&a, "-device").contains(&"virtserialport,chardev=agent,name=agent"));
        assert_eq!(after(&a, "-incoming"), ["defer"]);
        // A restore maps the snapshot RAM privately, from the memfd.
        assert!(after(&a, "-object")[0].contains("share=off"));
        assert!(after(&a, "-object")[0].contains("mem-path=/proc/self/fd/5,"));

        let a = argv(&ArgvSpec {
            accel: Accel::Tcg,
            tap_fd: Some(7),
            incoming: false,
        });
        assert_eq!(after(&a, "-kernel"), ["/k/vmlinux"]);
        let append = after(&a, "-append")[0];
        assert!(append.starts_with(DEFAULT_CMDLINE), "{append}");
        assert!(append.contains(TCG_CMDLINE), "{append}");
        assert!(append.ends_with("sandbox.ip=10.0.0.2/30"), "{append}");
        // A booted VM's RAM is its memfd, shared with the daemon.
        assert!(after(&a, "-object")[0].contains("share=on"));
        assert!(after(&a, "-object")[0].contains("mem-path=/proc/self/fd/5,"));

        let a = argv(&ArgvSpec {
            accel: Accel::Kvm,
            tap_fd: None,
            incoming: false,
        });
        assert_eq!(after(&a, "-accel"), ["kvm"]);
        assert_eq!(after(&a, "-cpu"), ["host"]);
        assert!(!after(&a, "-append")[0].contains("lpj="));
        assert!(after(&a, "-netdev").is_empty());
        assert!(after(&a, "-incoming").is_empty());
        assert!(after(&a, "-object")[0].contains("share=on"));
    }

    #[test]
    fn version_names_accel_and_machine() {
        let tcg = version_string("QEMU emulator version 7.2.22", Accel::Tcg);
        let kvm = version_string("QEMU emulator version 7.2.22", Accel::Kvm);
        assert!(tcg.starts_with("QEMU emulator version 7.2.22; accel=tcg; machine="));
        assert!(kvm.starts_with("QEMU emulator version 7.2.22; accel=kvm; machine="));
        // Another CPU model or fixed command line is another machine.
        let tag = |s: &str| s.rsplit_once("machine=").map(|(_, t)| t.to_string());
        assert_ne!(tag(&tcg), tag(&kvm));
        assert_eq!(
            tag(&tcg),
            tag(&snapshot::machine_tag(&[
                "max",
                &fixed_cmdline(Accel::Tcg),
                NET_DEVICE
            ]))
        );
    }

    #[test]
    fn macs_are_checked() {
        assert!(validate_mac("02:00:00:00:00:01").is_ok());
        for bad in [
            "02:00:00:00:00",
            "02:00:00:00:00:01,x=y",
            "zz:00:00:00:00:01",
            "",
        ] {
            assert!(validate_mac(bad).is_err(), "{bad}");
        }
    }
}
