//! Persistent TAP devices through the TUNSETIFF ioctl. The device is created
//! in the namespace of the calling thread, owned by the VMM's uid/gid so an
//! unprivileged VMM can attach to it later by name.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use super::NetError;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
const TUNSETGROUP: libc::c_ulong = 0x4004_54ce;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

fn ioctl(f: &File, req: libc::c_ulong, arg: libc::c_ulong, what: &str) -> Result<(), NetError> {
    // SAFETY: plain integer-argument ioctls on a tun fd.
    if unsafe { libc::ioctl(f.as_raw_fd(), req, arg) } < 0 {
        return Err(NetError::io(what.to_string(), io::Error::last_os_error()));
    }
    Ok(())
}

/// An interface name the kernel takes as given: not empty, shorter than
/// `IFNAMSIZ`, no NUL (the kernel would cut the name there) and no `/`.
pub fn check_name(name: &str) -> Result<(), NetError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', '\0']) {
        return Err(NetError::invalid(format!("bad TAP name {name:?}")));
    }
    Ok(())
}

/// Open `/dev/net/tun` and attach to (or create) TAP `name`; the fd keeps
/// the device alive until closed unless it was made persistent.
pub fn open(name: &str, vnet_hdr: bool) -> Result<File, NetError> {
    check_name(name)?;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(|e| NetError::io("open /dev/net/tun".to_string(), e))?;
    attach(&f, name, vnet_hdr)?;
    Ok(f)
}

/// Attach an open `/dev/net/tun` descriptor to TAP `name`. The permission
/// check (owner/group of a persistent TAP) happens here, not at open.
pub fn attach(f: &File, name: &str, vnet_hdr: bool) -> Result<(), NetError> {
    check_name(name)?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TAP | IFF_NO_PI | if vnet_hdr { IFF_VNET_HDR } else { 0 },
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: req is a properly sized struct ifreq.
    if unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) } < 0 {
        return Err(NetError::io(
            format!("TUNSETIFF {name}"),
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Create a persistent TAP named `name` in the current thread's namespace,
/// owned by `uid`/`gid` when given.
pub fn create_persistent(name: &str, uid: Option<u32>, gid: Option<u32>) -> Result<(), NetError> {
    // Firecracker and QEMU open their TAP with a virtio-net header.
    let f = open(name, true)?;
    if let Some(uid) = uid {
        ioctl(
            &f,
            TUNSETOWNER,
            uid as libc::c_ulong,
            &format!("TUNSETOWNER {name} {uid}"),
        )?;
    }
    if let Some(gid) = gid {
        ioctl(
            &f,
            TUNSETGROUP,
            gid as libc::c_ulong,
            &format!("TUNSETGROUP {name} {gid}"),
        )?;
    }
    ioctl(&f, TUNSETPERSIST, 1, &format!("TUNSETPERSIST {name}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_are_checked() {
        assert!(check_name("asbxtap0").is_ok());
        assert!(check_name("0123456789abcde").is_ok());
        for bad in ["", "a/b", "a\0b", "0123456789abcdef"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }
}
