//! The QEMU backend opens a session's TAP inside the session's network
//! namespace itself (so QEMU needs neither /dev/net/tun nor the namespace):
//! `net::tap::open` on a thread of `net::netns::run_in`, as here.
//! No VM boots and no packet is sent: the namespace and TAP are made here
//! and removed on drop, even on failure.

#[path = "common/skip.rs"]
mod skip;

use agent_sandbox::net::{netns, tap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// What the QEMU backend does with a session's TAP.
fn open_tap(ns: &Path, name: &str) -> Result<File, agent_sandbox::net::NetError> {
    let ns = netns::open(ns)?;
    netns::run_in(Some(&ns), "the test namespace", || tap::open(name, true))
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn tap_is_opened_inside_the_namespace() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/net/tun").exists() {
        skip!("needs root and /dev/net/tun");
    }
    let name = format!("asbx-qtap-{}", std::process::id());
    if !ip(&["netns", "add", &name]) {
        skip!("cannot create a network namespace (ip netns add {name})");
    }
    let ns = Netns(name.clone());
    let tap = "asbxtap0";
    assert!(ip(&[
        "-n", &ns.0, "tuntap", "add", "dev", tap, "mode", "tap"
    ]));
    let path = PathBuf::from("/run/netns").join(&ns.0);
    let fd = open_tap(&path, tap).expect("open TAP in the namespace");

    // TUNGETIFF: the fd is attached to our TAP, as a TAP with vnet headers.
    let mut ifr = [0u8; 40];
    const TUNGETIFF: libc::c_ulong = 0x800454d2;
    // SAFETY: TUNGETIFF fills a struct ifreq we own.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNGETIFF, ifr.as_mut_ptr()) };
    assert_eq!(r, 0, "TUNGETIFF: {}", std::io::Error::last_os_error());
    let end = ifr[..16].iter().position(|&b| b == 0).unwrap_or(16);
    assert_eq!(&ifr[..end], tap.as_bytes());
    let flags = u16::from_ne_bytes([ifr[16], ifr[17]]) as i32;
    assert_ne!(flags & libc::IFF_TAP, 0);
    assert_ne!(flags & libc::IFF_VNET_HDR, 0);
    assert_ne!(flags & libc::IFF_NO_PI, 0);
    // The host namespace got nothing; the calling thread is still in it.
    assert!(!Path::new("/sys/class/net").join(tap).exists());
    // TUNSETIFF creates a TAP that does not exist yet (it vanishes with the
    // fd), inside the namespace, not here.
    let other = open_tap(&path, "asbxtap1").expect("create a TAP in the namespace");
    assert!(!Path::new("/sys/class/net/asbxtap1").exists());
    drop(other);
    drop(fd);
}
