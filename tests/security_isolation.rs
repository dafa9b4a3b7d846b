//! From inside a real guest (QEMU/TCG, through the real daemon): the host's
//! files, processes, devices and kernel are not visible. (What the guest
//! cannot reach over the network is `tests/net_guest.rs`.)

mod common;
#[path = "common/skip.rs"]
mod skip;

use common::daemon::{stdout_of, Daemon};
use std::os::unix::process::CommandExt;

/// A process group, killed whole when dropped (also when a test fails).
struct Group(std::process::Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: signalling the process group this test made.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

#[test]
fn a_guest_sees_neither_host_files_nor_host_processes() {
    if common::test_backend() == "local-process" {
        skip!("the local-process backend has no isolation to test");
    }
    // Something unmistakable on the host: a file, and a process whose
    // command line carries a marker.
    let marker = format!("asbx-host-marker-{}", std::process::id());
    let file = std::env::temp_dir().join(&marker);
    std::fs::write(&file, "host secret").unwrap();
    // (`; true` keeps the shell, and with it the marker, alive.)
    // Its own process group, killed whole below: killing only the shell
    // left `sleep` running for 5 minutes with the test's stdout, which
    // held up whoever reads that (CI's `tee`).
    let sleeper = std::process::Command::new("sh")
        .args(["-c", "sleep 300; true"])
        .arg(&marker)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn sleep");
    let sleeper = Group(sleeper);
    // Control: on the host, the marker is in the sleeper's command line.
    // (Right after spawn the child may not have exec'd yet.)
    let cmdline = format!("/proc/{}/cmdline", sleeper.0.id());
    assert!(common::wait_until(
        std::time::Duration::from_secs(5),
        || String::from_utf8_lossy(&std::fs::read(&cmdline).unwrap_or_default()).contains(&marker)
    ));
    let d = Daemon::start(&[]);
    let h = d.http();
    // The marker is split in the script so that no process in the guest
    // (this shell, grep, ...) carries it by accident.
    let (m1, m2) = marker.split_at(9);
    let script = format!(
        "m1={m1}; m2={m2}; \
         test -e /tmp/$m1$m2 && echo FILE-VISIBLE; \
         test -e {dir}/$m1$m2 && echo FILE-VISIBLE; \
         for f in /proc/[0-9]*/cmdline; do \
           case \"$(tr '\\0' ' ' < $f 2>/dev/null)\" in *$m1$m2*) echo PROC-VISIBLE $f;; esac; \
         done; \
         echo PID1=$(tr '\\0' ' ' < /proc/1/cmdline); \
         echo PROCS=$(ls -d /proc/[0-9]* | wc -l); \
         echo KERNEL=$(uname -r); \
         ls /dev/kvm /dev/sda /dev/nvme0n1 2>/dev/null | sed 's/^/DEV /'; \
         echo HOSTNAME=$(hostname)",
        dir = std::env::temp_dir().display()
    );
    let v = h.exec("iso", &script);
    let out = stdout_of(&v);
    drop(sleeper);
    let _ = std::fs::remove_file(&file);
    assert!(!out.contains("FILE-VISIBLE"), "{out}");
    assert!(!out.contains("PROC-VISIBLE"), "{out}");
    // PID 1 is our agent, and the guest runs only a handful of processes.
    assert!(out.contains("PID1=/sbin/sandbox-agent"), "{out}");
    let procs: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("PROCS="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(usize::MAX);
    assert!(procs < 50, "{procs} processes visible in the guest:\n{out}");
    // Its own kernel, not the host's, and no host device nodes but its
    // own read-only disk.
    let host_kernel = String::from_utf8(
        std::process::Command::new("uname")
            .arg("-r")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let guest_kernel = out
        .lines()
        .find_map(|l| l.strip_prefix("KERNEL="))
        .unwrap_or("");
    assert_ne!(guest_kernel.trim(), host_kernel.trim(), "{out}");
    assert!(!out.contains("DEV /dev/kvm"), "{out}");
    assert!(
        !out.contains("/dev/sda") && !out.contains("/dev/nvme0n1"),
        "{out}"
    );
}
