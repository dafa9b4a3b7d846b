//! PID 1 duties: mounts, the writable overlay root, hostname, network from
//! the kernel command line, post-restore fix-ups and power-off.
//!
//! Kernel command line keys (all optional):
//! `sandbox.ip=ADDR/PREFIX sandbox.gw=ADDR sandbox.dns=ADDR[,ADDR]
//!  sandbox.hostname=NAME sandbox.overlay_size=SIZE sandbox.tmp_size=SIZE
//!  sandbox.workspace=PATH sandbox.listen=unix:..|vsock:PORT|serial:NAME
//!  sandbox.pids_max=N|max sandbox.mem_reserve=BYTES sandbox.nofile=N`
//! (SIZE in tmpfs syntax: `512m`, `50%`; BYTES like `64m`, `1g`).
//!
//! `/workspace` is a directory of the overlay root, so `overlay_size` caps
//! it and the root's writable layer together (the template's `disk_mib`).

use super::sys::{cstring, ctx, cvt};
use crate::proto::{ErrorBody, ErrorCode};
use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;

pub struct Cmdline(pub HashMap<String, String>);

impl Cmdline {
    pub fn parse(s: &str) -> Cmdline {
        let mut m = HashMap::new();
        for tok in s.split_whitespace() {
            if let Some(rest) = tok.strip_prefix("sandbox.") {
                let (k, v) = rest.split_once('=').unwrap_or((rest, ""));
                m.insert(k.to_string(), v.to_string());
            }
        }
        Cmdline(m)
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str).filter(|v| !v.is_empty())
    }
}

fn mount(
    src: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    let c = |s: &str| cstring(s, "mount argument");
    let (src, tgt, fs, data) = (c(src)?, c(target)?, c(fstype)?, c(data)?);
    // SAFETY: all pointers are valid NUL-terminated strings.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fs.as_ptr(),
            flags,
            data.as_ptr() as *const libc::c_void,
        )
    };
    cvt(r)
        .map(|_| ())
        .map_err(|e| ctx(e, &format!("mount {fstype} on {target}")))
}

/// mount() that treats "already mounted" as success (the kernel may have
/// mounted devtmpfs itself).
fn mount_once(src: &str, target: &str, fstype: &str, flags: libc::c_ulong, data: &str) {
    let _ = std::fs::create_dir_all(target);
    if let Err(e) = mount(src, target, fstype, flags, data) {
        if e.raw_os_error() != Some(libc::EBUSY) {
            log::warn!("{e}");
        }
    }
}

fn move_mount(from: &str, to: &str) -> io::Result<()> {
    mount(from, to, "", libc::MS_MOVE, "")
}

const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;

/// Everything init does before serving. Failures are logged and the agent
/// still starts: a sandbox with a read-only root is more useful to debug
/// than a kernel panic.
pub fn setup() -> Cmdline {
    mount_once("proc", "/proc", "proc", NOSUID_NODEV | libc::MS_NOEXEC, "");
    mount_once("sysfs", "/sys", "sysfs", NOSUID_NODEV | libc::MS_NOEXEC, "");
    mount_once("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755");
    let cmd = Cmdline::parse(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default());
    if let Err(e) = overlay_root(cmd.get("overlay_size").unwrap_or("50%")) {
        log::error!("root stays read-only: {e}");
    }
    mount_once("tmpfs", "/run", "tmpfs", NOSUID_NODEV, "mode=0755,size=64m");
    mount_once(
        "devpts",
        "/dev/pts",
        "devpts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        "mode=0620,ptmxmode=0666,gid=5",
    );
    mount_once("tmpfs", "/dev/shm", "tmpfs", NOSUID_NODEV, "mode=1777");
    let tmp = format!("mode=1777,size={}", cmd.get("tmp_size").unwrap_or("25%"));
    mount_once("tmpfs", "/tmp", "tmpfs", NOSUID_NODEV, &tmp);
    mount_once(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        NOSUID_NODEV | libc::MS_NOEXEC,
        "",
    );
    confine_users(&cmd);
    let ws = cmd.get("workspace").unwrap_or("/workspace");
    if let Err(e) = std::fs::create_dir_all(ws) {
        log::warn!("workspace {ws}: {e}");
    }
    let host = cmd.get("hostname").unwrap_or("sandbox");
    // SAFETY: pointer and length describe a valid buffer.
    if unsafe { libc::sethostname(host.as_ptr() as *const libc::c_char, host.len()) } < 0 {
        log::warn!("sethostname: {}", io::Error::last_os_error());
    }
    let _ = std::fs::write(
        "/etc/hosts",
        format!("127.0.0.1 localhost\n::1 localhost\n127.0.1.1 {host}\n"),
    );
    if let Err(e) = net::link_up("lo") {
        log::warn!("{e}");
    }
    if let Some(ip) = cmd.get("ip") {
        if let Err(e) = net::configure("eth0", ip, cmd.get("gw")) {
            log::error!("network: {e}");
        }
    }
    match open_urandom() {
        Ok(f) => {
            let _ = URANDOM.set(f);
        }
        Err(e) => log::warn!("{e}"),
    }
    if let Some(dns) = cmd.get("dns") {
        let body: String = dns
            .split(',')
            .map(|d| format!("nameserver {d}\n"))
            .collect();
        let _ = std::fs::write("/etc/resolv.conf", body);
    }
    cmd
}

/// Where user processes run: a cgroup below the root, whose limits leave
/// the agent (in the root cgroup, unlimited) room to keep answering.
pub const USER_CGROUP: &str = "/sys/fs/cgroup/sandbox";
pub const DEFAULT_PIDS_MAX: u64 = 4096;
/// Memory kept out of the users' reach for the agent, the kernel and the
/// page cache of the root image.
pub const DEFAULT_MEM_RESERVE: u64 = 48 << 20;
pub const DEFAULT_NOFILE: u64 = 65536;

/// `64m`, `1g`, `4096k`, plain bytes.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()?.to_ascii_lowercase() {
        'k' => (&s[..s.len() - 1], 1u64 << 10),
        'm' => (&s[..s.len() - 1], 1 << 20),
        'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

fn mem_total() -> io::Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").map_err(|e| ctx(e, "/proc/meminfo"))?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no MemTotal in /proc/meminfo"))
}

fn write_file(path: &str, value: &str) -> io::Result<()> {
    std::fs::write(path, value).map_err(|e| ctx(e, &format!("write {value:?} to {path}")))
}

/// The limits user processes live under, from the command line (defaults
/// otherwise). Pure, for tests.
pub struct Confinement {
    pub pids_max: Option<u64>,
    pub mem_max: u64,
    pub nofile: u64,
}

pub fn confinement(cmd: &Cmdline, mem_total: u64) -> Confinement {
    let pids_max = match cmd.get("pids_max") {
        Some("max") => None,
        Some(v) => Some(v.parse().unwrap_or_else(|_| {
            log::warn!("sandbox.pids_max={v:?} is not a number; using {DEFAULT_PIDS_MAX}");
            DEFAULT_PIDS_MAX
        })),
        None => Some(DEFAULT_PIDS_MAX),
    };
    let reserve = cmd
        .get("mem_reserve")
        .and_then(parse_bytes)
        .unwrap_or(DEFAULT_MEM_RESERVE);
    // Never hand users less than half the machine, whatever the reserve.
    let mem_max = mem_total.saturating_sub(reserve).max(mem_total / 2);
    let nofile = cmd
        .get("nofile")
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_NOFILE);
    Confinement {
        pids_max,
        mem_max,
        nofile,
    }
}

/// Puts user processes under limits the agent itself is outside of: the
/// agent stays in the unlimited root cgroup, so a fork bomb or a memory hog
/// stops at the sandbox cgroup's pids.max / memory.max while the agent
/// keeps answering. It is never the OOM victim either, without an
/// oom_score_adj of -1000: the kernel's OOM killer skips the global init
/// (every thread of PID 1), and leaving the agent at the default 0 means
/// its children start killable with no per-exec write to undo it (a
/// procfs open and write in every child, ~800 translated blocks of a
/// restored guest's first exec under TCG).
/// On failure user processes run unconfined (logged): a sandbox without
/// limits is still a sandbox, the VM is the boundary.
fn confine_users(cmd: &Cmdline) {
    // Room for many concurrent execs (each holds a few pipes).
    let own = libc::rlimit {
        rlim_cur: DEFAULT_NOFILE,
        rlim_max: DEFAULT_NOFILE,
    };
    // SAFETY: valid rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &own) } < 0 {
        log::warn!("setrlimit NOFILE: {}", io::Error::last_os_error());
    }
    match user_cgroup(cmd) {
        Ok(l) => {
            super::spawn::set_user_limits(l);
            super::spawn::prepare_exec_cgroup();
        }
        Err(e) => log::error!("user processes run without limits: {e}"),
    }
}

fn user_cgroup(cmd: &Cmdline) -> io::Result<super::spawn::UserLimits> {
    use std::os::unix::fs::OpenOptionsExt;
    let c = confinement(cmd, mem_total()?);
    // Controllers must be enabled in the parent before the child has
    // limit files; the root cgroup is exempt from "no internal processes",
    // so the agent may stay there.
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids +memory")?;
    // With the cpu controller the whole sandbox cgroup competes as one
    // entity (cpu.weight 100, like one nice-0 task) with each agent thread:
    // thousands of runnable user processes cannot starve the agent. Best
    // effort: without it the limits above still hold.
    if let Err(e) = write_file("/sys/fs/cgroup/cgroup.subtree_control", "+cpu") {
        log::warn!("{e}");
    }
    match std::fs::create_dir(USER_CGROUP) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(ctx(e, &format!("mkdir {USER_CGROUP}"))),
    }
    // kernel.threads-max (from RAM: ~3900 at 512 MiB) counts every task,
    // the agent's threads included: keep it above pids.max, or users at
    // their limit would leave the agent unable to start a thread.
    if let Some(n) = c.pids_max {
        let want = n + 1024;
        let cur = std::fs::read_to_string("/proc/sys/kernel/threads-max")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if cur < want {
            if let Err(e) = write_file("/proc/sys/kernel/threads-max", &want.to_string()) {
                log::warn!("{e}");
            }
        }
    }
    let pids = c.pids_max.map_or("max".to_string(), |n| n.to_string());
    write_file(&format!("{USER_CGROUP}/pids.max"), &pids)?;
    write_file(&format!("{USER_CGROUP}/memory.max"), &c.mem_max.to_string())?;
    // No swap device exists; if one is added it must not extend the limit.
    let _ = std::fs::write(format!("{USER_CGROUP}/memory.swap.max"), "0");
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(USER_CGROUP)
        .map_err(|e| ctx(e, &format!("open {USER_CGROUP}")))?;
    // Each exec gets a child cgroup here (its own CPU share and OOM group,
    // see spawn::ExecCgroup); without these controllers, all execs share
    // the sandbox cgroup.
    let per_exec = match write_file(
        &format!("{USER_CGROUP}/cgroup.subtree_control"),
        "+memory +cpu +pids",
    ) {
        Ok(()) => Some(std::path::PathBuf::from(USER_CGROUP)),
        Err(e) => {
            log::warn!("{e}; execs share one cgroup");
            None
        }
    };
    log::info!(
        "user processes: cgroup {USER_CGROUP}, pids.max {pids}, memory.max {} MiB, nofile {}",
        c.mem_max >> 20,
        c.nofile
    );
    Ok(super::spawn::UserLimits {
        cgroup: dir.into(),
        per_exec,
        // One exec may use 15/16 of the processes, so a bomb leaves the
        // next command room to run (and to kill it).
        exec_pids_max: c.pids_max.map(|n| n - n / 16),
        // And 15/16 of the memory (~27 MiB left over at 512 MiB), in whole
        // pages as the kernel keeps it.
        exec_mem_max: Some((c.mem_max - c.mem_max / 16) & !4095),
        nofile: (c.nofile.min(1024), c.nofile),
        nproc: c.pids_max.unwrap_or(libc::RLIM_INFINITY),
    })
}

/// Turns the read-only root into an overlay whose upper layer is a
/// size-capped tmpfs, then pivots into it. Writes vanish with the VM.
fn overlay_root(size: &str) -> io::Result<()> {
    // pivot_root refuses shared mounts.
    mount("", "/", "", libc::MS_REC | libc::MS_PRIVATE, "")?;
    mount(
        "tmpfs",
        "/run",
        "tmpfs",
        NOSUID_NODEV,
        &format!("mode=0755,size={size}"),
    )?;
    for d in ["/run/ov/upper", "/run/ov/work", "/run/ov/root"] {
        std::fs::create_dir_all(d).map_err(|e| ctx(e, d))?;
    }
    mount(
        "overlay",
        "/run/ov/root",
        "overlay",
        0,
        "lowerdir=/,upperdir=/run/ov/upper,workdir=/run/ov/work",
    )?;
    for m in ["/dev", "/proc", "/sys"] {
        move_mount(m, &format!("/run/ov/root{m}"))?;
    }
    std::env::set_current_dir("/run/ov/root").map_err(|e| ctx(e, "chdir new root"))?;
    let (new, old) = (cstring(".", "")?, cstring("mnt", "")?);
    // SAFETY: valid paths; pivot_root has no memory preconditions.
    cvt(unsafe { libc::syscall(libc::SYS_pivot_root, new.as_ptr(), old.as_ptr()) } as i32)
        .map_err(|e| ctx(e, "pivot_root"))?;
    let root = cstring(".", "")?;
    // SAFETY: valid path.
    cvt(unsafe { libc::chroot(root.as_ptr()) }).map_err(|e| ctx(e, "chroot"))?;
    std::env::set_current_dir("/").map_err(|e| ctx(e, "chdir /"))?;
    // Audited execs compare scans of the upper dir and read the image's
    // files: neither is reachable by path once the old root's entry goes.
    match (
        std::fs::File::open("/mnt/run/ov/upper"),
        std::fs::File::open("/mnt"),
    ) {
        (Ok(upper), Ok(lower)) => super::audit::set_overlay(upper.into(), lower.into()),
        (Err(e), _) | (_, Err(e)) => log::warn!("overlay layers for audits: {e}"),
    }
    // The old root stays alive as the overlay's lower layer; only its
    // mount-tree entry goes.
    let mnt = cstring("/mnt", "")?;
    // SAFETY: valid path.
    cvt(unsafe { libc::umount2(mnt.as_ptr(), libc::MNT_DETACH) })
        .map_err(|e| ctx(e, "umount old root"))?;
    Ok(())
}

/// Post-restore fix-ups: wall clock, RNG, neighbour caches.
pub fn restored(unix_time_ns: u64, entropy_hex: &str) -> Result<(), ErrorBody> {
    let entropy = hex_decode(entropy_hex)
        .ok_or_else(|| ErrorBody::new(ErrorCode::Invalid, "entropy_hex is not hex"))?;
    if entropy.len() > 4096 {
        return Err(ErrorBody::new(
            ErrorCode::Invalid,
            "more than 4096 bytes of entropy",
        ));
    }
    let ts = libc::timespec {
        tv_sec: (unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
        return Err(ErrorBody::from_io(
            &io::Error::last_os_error(),
            "clock_settime",
        ));
    }
    if !entropy.is_empty() {
        add_entropy(&entropy).map_err(|e| ErrorBody::from_io(&e, "reseed RNG"))?;
    }
    if let Err(e) = net::flush_arp() {
        return Err(ErrorBody::from_io(&e, "flush neighbours"));
    }
    Ok(())
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

// _IOW('R', 0x03, int[2]) and _IO('R', 0x07) from <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// /dev/urandom, opened by init: a snapshot holds it open, so a restore's
/// reseed needs no path walk (~400 newly translated blocks under TCG).
static URANDOM: std::sync::OnceLock<std::fs::File> = std::sync::OnceLock::new();

fn open_urandom() -> io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| ctx(e, "/dev/urandom"))
}

/// Mixes host-provided bytes into the kernel pool and credits them, then
/// forces a CRNG reseed so two VMs restored from one snapshot diverge now,
/// not at the next scheduled reseed.
fn add_entropy(bytes: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let opened;
    let f = match URANDOM.get() {
        Some(f) => f,
        None => {
            opened = open_urandom()?;
            &opened
        }
    };
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len() + 4);
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    info.resize(info.len().next_multiple_of(4), 0);
    // SAFETY: info holds a complete rand_pool_info of the declared size.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) })
        .map_err(|e| ctx(e, "RNDADDENTROPY"))?;
    // SAFETY: no argument.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) })
        .map_err(|e| ctx(e, "RNDRESEEDCRNG"))?;
    Ok(())
}

pub fn power_down(poweroff: bool) -> ! {
    // SAFETY: plain syscalls; init owns the machine.
    unsafe {
        libc::kill(-1, libc::SIGTERM);
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    // SAFETY: as above.
    unsafe {
        libc::kill(-1, libc::SIGKILL);
        libc::sync();
        libc::reboot(if poweroff {
            libc::RB_POWER_OFF
        } else {
            libc::RB_AUTOBOOT
        });
    }
    std::process::exit(0)
}

/// Interface setup with classic ioctls: four calls, no netlink code needed
/// in the guest.
pub mod net {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn sock() -> io::Result<OwnedFd> {
        // SAFETY: plain socket creation.
        let fd =
            cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })
                .map_err(|e| ctx(e, "socket"))?;
        // SAFETY: fresh descriptor we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn ifreq(name: &str) -> io::Result<libc::ifreq> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad interface name {name:?}"),
            ));
        }
        // SAFETY: ifreq is plain old data.
        let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in r.ifr_name.iter_mut().zip(name.bytes()) {
            *d = s as libc::c_char;
        }
        Ok(r)
    }

    fn sockaddr(a: Ipv4Addr) -> libc::sockaddr {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(a).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: sockaddr_in and sockaddr have the same size on Linux.
        unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
    }

    pub fn link_up(name: &str) -> io::Result<()> {
        let s = sock()?;
        let mut r = ifreq(name)?;
        // SAFETY: valid ifreq.
        cvt(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r) })
            .map_err(|e| ctx(e, &format!("SIOCGIFFLAGS {name}")))?;
        // SAFETY: union field written by the kernel above.
        unsafe { r.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        // SAFETY: valid ifreq.
        cvt(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &r) })
            .map_err(|e| ctx(e, &format!("SIOCSIFFLAGS {name}")))?;
        Ok(())
    }

    /// `cidr` like `172.16.0.2/30`.
    pub fn configure(ifname: &str, cidr: &str, gw: Option<&str>) -> io::Result<()> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("bad {what}"));
        let (addr, prefix) = cidr.split_once('/').unwrap_or((cidr, "24"));
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad("sandbox.ip"))?;
        let prefix: u32 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| bad("prefix"))?;
        let mask = Ipv4Addr::from(if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        });
        let s = sock()?;
        let mut r = ifreq(ifname)?;
        r.ifr_ifru.ifru_addr = sockaddr(addr);
        // SAFETY: valid ifreq.
        cvt(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFADDR, &r) })
            .map_err(|e| ctx(e, &format!("SIOCSIFADDR {ifname}")))?;
        r.ifr_ifru.ifru_netmask = sockaddr(mask);
        // SAFETY: valid ifreq.
        cvt(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFNETMASK, &r) })
            .map_err(|e| ctx(e, &format!("SIOCSIFNETMASK {ifname}")))?;
        // Recorded once the link has its address, even if what follows
        // fails: from here on it can hold neighbour entries.
        let _ = LINK.set(Link {
            name: ifname.to_string(),
            addr,
            prefix,
            gw: gw.and_then(|g| g.parse().ok()),
            sock: s.try_clone().ok(),
        });
        // Sessions have no IPv6 (the host side of the link has it off), so
        // the link gets no IPv6 address: no DAD, router solicitations or
        // MLD reports, whose timers would also fire after every restore
        // (~600 translated blocks of the first exec under QEMU/TCG).
        // Loopback keeps ::1.
        match std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"),
            "1",
        ) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                log::warn!("disable IPv6 on {ifname}: {e}")
            }
            _ => {}
        }
        link_up(ifname)?;
        if let Some(gw) = gw {
            let gw: Ipv4Addr = gw.parse().map_err(|_| bad("sandbox.gw"))?;
            // SAFETY: rtentry is plain old data.
            let mut rt: RtEntry = unsafe { std::mem::zeroed() };
            rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
            rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
            rt.rt_gateway = sockaddr(gw);
            rt.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
            // SAFETY: valid rtentry.
            cvt(unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCADDRT, &rt) })
                .map_err(|e| ctx(e, "SIOCADDRT default"))?;
        }
        Ok(())
    }

    /// The link [`configure`] set up (the guest's only one besides
    /// loopback): a restore's neighbour flush deletes just its possible
    /// neighbours instead of reading the whole table through /proc.
    pub(super) struct Link {
        pub(super) name: String,
        pub(super) addr: Ipv4Addr,
        pub(super) prefix: u32,
        pub(super) gw: Option<Ipv4Addr>,
        /// Kept for [`flush_arp`]: a snapshot holds it, so a restore
        /// creates no socket (~500 newly translated blocks under TCG).
        pub(super) sock: Option<OwnedFd>,
    }

    static LINK: std::sync::OnceLock<Link> = std::sync::OnceLock::new();

    /// Subnets up to this many addresses are flushed address by address.
    const SMALL_SUBNET: u32 = 8;

    /// The addresses that can have a neighbour entry on `l` (the subnet's
    /// hosts but our own, and the gateway), or `None` when the subnet is too
    /// large to list.
    pub(super) fn neighbours(l: &Link) -> Option<Vec<Ipv4Addr>> {
        let size = 1u64 << (32 - l.prefix);
        if size > SMALL_SUBNET as u64 {
            return None;
        }
        let net = u32::from(l.addr) & (u64::from(u32::MAX) << (32 - l.prefix)) as u32;
        // Up to /30 the first and last address are the network and its
        // broadcast; /31 (RFC 3021) and /32 have no such addresses.
        let hosts = if size >= 4 { 1..size - 1 } else { 0..size };
        let mut out: Vec<Ipv4Addr> = hosts
            .map(|i| Ipv4Addr::from(net | i as u32))
            .filter(|a| *a != l.addr)
            .collect();
        if let Some(gw) = l.gw.filter(|g| !out.contains(g)) {
            out.push(gw);
        }
        Some(out)
    }

    /// `struct rtentry` from <net/route.h> (not in the libc crate for glibc).
    #[repr(C)]
    struct RtEntry {
        rt_pad1: libc::c_ulong,
        rt_dst: libc::sockaddr,
        rt_gateway: libc::sockaddr,
        rt_genmask: libc::sockaddr,
        rt_flags: libc::c_ushort,
        rt_pad2: libc::c_short,
        rt_pad3: libc::c_ulong,
        rt_pad4: *mut libc::c_void,
        rt_metric: libc::c_short,
        rt_dev: *mut libc::c_char,
        rt_mtu: libc::c_ulong,
        rt_window: libc::c_ulong,
        rt_irtt: libc::c_ushort,
    }

    /// Deletes every IPv4 neighbour entry: after a restore the host side
    /// of the link may have a new MAC. With no link configured there is
    /// nothing to delete (loopback has no neighbours); on the daemon's /30
    /// it is one ioctl (the gateway), not a /proc read (which under TCG
    /// costs ~1k newly translated guest blocks on a restored VM's hello).
    pub fn flush_arp() -> io::Result<()> {
        let Some(link) = LINK.get() else {
            return Ok(());
        };
        let Some(addrs) = neighbours(link) else {
            return flush_table();
        };
        let made;
        let s = match &link.sock {
            Some(s) => s,
            None => {
                made = sock()?;
                &made
            }
        };
        for ip in addrs {
            delete_neighbour(s, ip, &link.name);
        }
        Ok(())
    }

    fn delete_neighbour(s: &OwnedFd, ip: Ipv4Addr, dev: &str) {
        // SAFETY: arpreq is plain old data.
        let mut req: libc::arpreq = unsafe { std::mem::zeroed() };
        req.arp_pa = sockaddr(ip);
        for (d, c) in req.arp_dev.iter_mut().zip(dev.bytes().take(15)) {
            *d = c as libc::c_char;
        }
        // SAFETY: valid arpreq.
        if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCDARP, &req) } < 0 {
            let e = io::Error::last_os_error();
            // No entry (ENXIO) is the usual case, and what we want.
            if e.raw_os_error() != Some(libc::ENXIO) {
                log::warn!("SIOCDARP {ip} on {dev}: {e}");
            }
        }
    }

    /// Every entry of /proc/net/arp.
    fn flush_table() -> io::Result<()> {
        let table = match std::fs::read_to_string("/proc/net/arp") {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(ctx(e, "/proc/net/arp")),
        };
        let s = sock()?;
        for line in table.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(ip), Some(dev)) = (cols.first(), cols.get(5)) else {
                continue;
            };
            let Ok(ip) = ip.parse::<Ipv4Addr>() else {
                continue;
            };
            delete_neighbour(&s, ip, dev);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_of_small_subnets_are_listed() {
        let link = |addr: &str, prefix, gw: Option<&str>| net::Link {
            name: "eth0".into(),
            addr: addr.parse().unwrap(),
            prefix,
            gw: gw.map(|g| g.parse().unwrap()),
            sock: None,
        };
        let ips = |v: Vec<Ipv4Addr>| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        // The daemon's /30: the gateway is the only other host.
        let n = net::neighbours(&link("172.16.0.2", 30, Some("172.16.0.1"))).unwrap();
        assert_eq!(ips(n), ["172.16.0.1"]);
        // /31 has no network or broadcast address.
        let n = net::neighbours(&link("10.0.0.2", 31, None)).unwrap();
        assert_eq!(ips(n), ["10.0.0.3"]);
        // A gateway outside the subnet is added.
        let n = net::neighbours(&link("10.0.0.2", 32, Some("10.0.0.1"))).unwrap();
        assert_eq!(ips(n), ["10.0.0.1"]);
        let n = net::neighbours(&link("192.168.1.9", 29, None)).unwrap();
        assert_eq!(
            ips(n),
            [
                "192.168.1.10",
                "192.168.1.11",
                "192.168.1.12",
                "192.168.1.13",
                "192.168.1.14"
            ]
        );
        // Larger subnets: the whole table is read instead.
        assert!(net::neighbours(&link("10.0.0.2", 28, None)).is_none());
        assert!(net::neighbours(&link("10.0.0.2", 0, None)).is_none());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("64m"), Some(64 << 20));
        assert_eq!(parse_bytes("1G"), Some(1 << 30));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("12k"), Some(12 << 10));
        assert_eq!(parse_bytes(""), None);
        assert_eq!(parse_bytes("m"), None);
        assert_eq!(parse_bytes("-1m"), None);
        assert_eq!(parse_bytes("99999999999999999g"), None);
    }

    #[test]
    fn confinement_defaults_and_overrides() {
        let total = 240 << 20;
        let c = confinement(&Cmdline::parse("quiet"), total);
        assert_eq!(c.pids_max, Some(DEFAULT_PIDS_MAX));
        assert_eq!(c.mem_max, total - DEFAULT_MEM_RESERVE);
        assert_eq!(c.nofile, DEFAULT_NOFILE);
        let c = confinement(
            &Cmdline::parse("sandbox.pids_max=100 sandbox.mem_reserve=16m sandbox.nofile=4096"),
            total,
        );
        assert_eq!(c.pids_max, Some(100));
        assert_eq!(c.mem_max, total - (16 << 20));
        assert_eq!(c.nofile, 4096);
        assert_eq!(
            confinement(&Cmdline::parse("sandbox.pids_max=max"), total).pids_max,
            None
        );
        // A reserve larger than the machine still leaves users half of it.
        let c = confinement(&Cmdline::parse("sandbox.mem_reserve=1g"), total);
        assert_eq!(c.mem_max, total / 2);
    }
}
