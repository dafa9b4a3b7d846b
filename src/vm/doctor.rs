//! `agent-sandbox doctor`: what this host has and lacks for running
//! sandboxes, each missing piece with the command that fixes it.
//! [`run`] returns structured data (for JSON output or an API); its
//! `Display` is the printable form.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Serialize;

use super::qemu::{kvm_device_usable, probe_kvm};
use super::templates::{Registry, SnapshotState};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, but not as well as it could (e.g. TCG instead of KVM).
    Warn,
    Missing,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
    /// The command (or step) that fixes it, when not ok.
    pub fix: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// Nothing is missing (warnings allowed).
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.status != Status::Missing)
    }

    pub fn get(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for c in &self.checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "warn",
                Status::Missing => "MISS",
            };
            writeln!(f, "[{tag}] {:<w$}  {}", c.name, c.detail)?;
            if let Some(fix) = &c.fix {
                writeln!(f, "       {:<w$}  fix: {fix}", "")?;
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub qemu: PathBuf,
    pub firecracker: PathBuf,
    pub jailer: PathBuf,
    /// Boot this kernel under KVM to see whether KVM really works (a few
    /// seconds at most); without it only `/dev/kvm` is checked.
    pub kvm_probe_kernel: Option<PathBuf>,
    pub kvm_probe_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            qemu: "qemu-system-x86_64".into(),
            firecracker: "firecracker".into(),
            jailer: "jailer".into(),
            kvm_probe_kernel: None,
            kvm_probe_timeout: Duration::from_secs(5),
        }
    }
}

fn check(name: &str, status: Status, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check {
        name: name.into(),
        status,
        detail: detail.into(),
        fix: if status == Status::Ok {
            None
        } else {
            fix.map(str::to_string)
        },
    }
}

fn find(bin: &Path) -> Option<PathBuf> {
    if bin.components().count() > 1 {
        return bin.is_file().then(|| bin.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// First non-empty line of `bin --version`.
fn version(bin: &Path) -> Option<String> {
    let out = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

/// Whether the jailer can start this Firecracker: it must be static
/// (`jailer::check_static_exec`).
/// `None` without the binary (the `firecracker` check says so).
fn firecracker_static(bin: &Path) -> Option<Check> {
    let p = find(bin)?;
    Some(match super::jailer::check_static_exec(&p) {
        Ok(()) => check(
            "firecracker-static",
            Status::Ok,
            format!(
                "{}: statically linked (runs in the jailer's chroot)",
                p.display()
            ),
            None,
        ),
        Err(e) => check(
            "firecracker-static",
            Status::Warn,
            e.to_string(),
            Some("use a static firecracker build (the releases are)"),
        ),
    })
}

fn tool(name: &str, bin: &Path, fix: &str, missing: Status) -> Check {
    match find(bin) {
        Some(p) => match version(&p) {
            Some(v) => check(name, Status::Ok, format!("{} ({v})", p.display()), None),
            None => check(
                name,
                missing,
                format!("{} does not answer --version", p.display()),
                Some(fix),
            ),
        },
        None => check(
            name,
            missing,
            format!("{} not found", bin.display()),
            Some(fix),
        ),
    }
}

const KVM_FIX: &str =
    "enable virtualization (VT-x/AMD-V) in the firmware and `modprobe kvm_intel` \
                       or `modprobe kvm_amd`; in a cloud VM, pick an instance type with nested \
                       virtualization. Without KVM only the QEMU backend (TCG, slow) works";

/// The `kvm` check's verdict on the device alone, `None` when it answers.
fn kvm_device() -> Option<Check> {
    if !Path::new("/dev/kvm").exists() {
        return Some(check(
            "kvm",
            Status::Missing,
            "/dev/kvm does not exist",
            Some(KVM_FIX),
        ));
    }
    if !kvm_device_usable() {
        return Some(check(
            "kvm",
            Status::Missing,
            "/dev/kvm exists but cannot be opened or answers no KVM API version",
            Some("check its permissions (run as root or join the kvm group)"),
        ));
    }
    None
}

/// The doctor's KVM verdict without its guest boot (which runs QEMU: not
/// from a hardened daemon thread), for the error of a guest that did not
/// come up: the device's state, and how to get the full probe.
pub fn kvm_quick_verdict() -> String {
    match kvm_device() {
        Some(c) => format!("{} ({})", c.detail, c.fix.unwrap_or_default()),
        None => "/dev/kvm answers, but that does not prove it runs guests (nested or \
                 paravirtual KVM may run none): `agent-sandbox doctor` boots a guest kernel \
                 under it"
            .into(),
    }
}

/// The doctor's `kvm` check alone, with its guest boot (runs QEMU: for
/// the admin commands, not a hardened daemon).
pub fn kvm_check(opts: &Options) -> Check {
    kvm(opts)
}

fn kvm(opts: &Options) -> Check {
    if let Some(c) = kvm_device() {
        return c;
    }
    let Some(kernel) = &opts.kvm_probe_kernel else {
        return check(
            "kvm",
            Status::Warn,
            "/dev/kvm answers; not probed with a guest boot (no kernel built yet)",
            Some("agent-sandbox image build, then run doctor again"),
        );
    };
    match probe_kvm(&opts.qemu, kernel, opts.kvm_probe_timeout) {
        Ok(()) => check("kvm", Status::Ok, "a guest kernel boots under KVM", None),
        Err(why) => check(
            "kvm",
            Status::Missing,
            format!("/dev/kvm answers but a guest does not boot under it: {why}"),
            Some(KVM_FIX),
        ),
    }
}

/// Where each controller of the VMMs' limits lives: cgroup v2 (offered at
/// its root) or a v1 mount. `serve` refuses to start VMMs when one is
/// missing (unless `--allow-unlimited-vmms`).
fn cgroups() -> Check {
    use super::cgroup::{hierarchies, v2_controllers, Hierarchy};
    const FIX: &str = "mount the cpu, memory and pids controllers: either cgroup v2 \
        (boot with systemd.unified_cgroup_hierarchy=1, the default on Debian 11+; inside a \
        container, give it a delegated cgroup v2 subtree) or cgroup v1 \
        (mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory, likewise cpu and pids); \
        `serve` refuses to start VMMs without them unless --allow-unlimited-vmms";
    let hs = hierarchies();
    let where_is = |c: &str| -> Option<String> {
        hs.iter().find_map(|h: &Hierarchy| match &h.v1 {
            None => v2_controllers(&h.mount)
                .iter()
                .any(|x| x == c)
                .then(|| format!("{c}: v2 {}", h.mount.display())),
            Some(v) => v
                .contains(&c)
                .then(|| format!("{c}: v1 {}", h.mount.display())),
        })
    };
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for c in ["cpu", "memory", "pids", "io"] {
        match where_is(c) {
            Some(w) => found.push(w),
            // io is needed only with vm_io_max.
            None if c == "io" => found.push("io: none (vm_io_max cannot apply)".into()),
            None => missing.push(c),
        }
    }
    if missing.is_empty() {
        // What the jailer is told to use (the same plan `serve` makes).
        let (v, _) = super::cgroup::jailer_plan(&hs, &["cpu", "memory", "pids"]);
        found.push(format!("the jailer gets --cgroup-version {v}"));
        check("cgroups", Status::Ok, found.join("; "), None)
    } else {
        check(
            "cgroups",
            Status::Missing,
            format!(
                "no cgroup hierarchy (v2 or v1) offers {}: VMMs would run without those \
                 limits ({})",
                missing.join(", "),
                if found.is_empty() {
                    "nothing else found".to_string()
                } else {
                    found.join("; ")
                }
            ),
            Some(FIX),
        )
    }
}

fn ip_forward() -> Check {
    let v = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap_or_default();
    if v.trim() == "1" {
        check("ip_forward", Status::Ok, "net.ipv4.ip_forward = 1", None)
    } else {
        check(
            "ip_forward",
            Status::Missing,
            format!("net.ipv4.ip_forward = {}", v.trim()),
            Some("sysctl -w net.ipv4.ip_forward=1 (and persist it in /etc/sysctl.d/)"),
        )
    }
}

fn tun() -> Check {
    if Path::new("/dev/net/tun").exists() {
        check("tun", Status::Ok, "/dev/net/tun", None)
    } else {
        check(
            "tun",
            Status::Missing,
            "/dev/net/tun does not exist",
            Some("modprobe tun"),
        )
    }
}

fn firewall() -> Vec<Check> {
    let nft = tool(
        "nftables",
        Path::new("nft"),
        "apt-get install nftables",
        Status::Missing,
    );
    let ipt = tool(
        "iptables",
        Path::new("iptables"),
        "apt-get install iptables",
        Status::Warn,
    );
    vec![nft, ipt]
}

fn images(reg: &Registry) -> Vec<Check> {
    let mut out = Vec::new();
    match reg.kernel() {
        Ok(k) => out.push(check(
            "image: kernel",
            Status::Ok,
            k.display().to_string(),
            None,
        )),
        Err(e) => out.push(check(
            "image: kernel",
            Status::Missing,
            e.to_string(),
            Some("agent-sandbox image build"),
        )),
    }
    let list = match reg.list() {
        Ok(l) => l,
        Err(e) => {
            out.push(check(
                "templates",
                Status::Missing,
                e.to_string(),
                Some("point the daemon's templates dir at images/templates"),
            ));
            return out;
        }
    };
    let backend = reg.backend().name();
    for t in list {
        let name = format!("template {}", t.name);
        let Some(rootfs) = &t.rootfs else {
            out.push(check(
                &name,
                Status::Missing,
                "no rootfs built",
                Some(&format!("agent-sandbox image build --template {}", t.name)),
            ));
            continue;
        };
        let fix = format!("agent-sandbox snapshot create --template {}", t.name);
        out.push(match &t.snapshot {
            SnapshotState::Fresh => check(
                &name,
                Status::Ok,
                format!("{}; {backend} snapshot fresh", rootfs.display()),
                None,
            ),
            SnapshotState::Stale(why) => check(
                &name,
                Status::Warn,
                format!("{backend} snapshot stale ({why}); rebuilt on first use"),
                Some(&fix),
            ),
            SnapshotState::Missing => check(
                &name,
                Status::Warn,
                format!("no {backend} snapshot yet; made on first use"),
                Some(&fix),
            ),
        });
    }
    out
}

/// Check this host. With a registry, images and snapshots are checked too.
pub fn run(opts: &Options, registry: Option<&Registry>) -> Report {
    let mut opts = opts.clone();
    if opts.kvm_probe_kernel.is_none() {
        opts.kvm_probe_kernel = registry.and_then(|r| r.kernel().ok());
    }
    let mut checks = vec![
        kvm(&opts),
        tool(
            "firecracker",
            &opts.firecracker,
            "install firecracker from https://github.com/firecracker-microvm/firecracker/releases \
             to /usr/local/bin (needs KVM)",
            Status::Warn,
        ),
        tool(
            "jailer",
            &opts.jailer,
            "install jailer from the same firecracker release to /usr/local/bin",
            Status::Warn,
        ),
        tool(
            "qemu",
            &opts.qemu,
            "apt-get install qemu-system-x86",
            Status::Missing,
        ),
        cgroups(),
    ];
    checks.extend(firecracker_static(&opts.firecracker));
    checks.extend(firewall());
    checks.push(ip_forward());
    checks.push(tun());
    if let Some(r) = registry {
        checks.extend(images(r));
    }
    // With neither VMM, nothing runs: say so once, plainly.
    let fc = checks
        .iter()
        .any(|c| c.name == "firecracker" && c.status == Status::Ok);
    let qemu = checks
        .iter()
        .any(|c| c.name == "qemu" && c.status == Status::Ok);
    if !fc && !qemu {
        checks.push(check(
            "vmm",
            Status::Missing,
            "neither firecracker nor qemu is usable",
            Some("apt-get install qemu-system-x86"),
        ));
    }
    Report { checks }
}
