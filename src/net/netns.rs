//! Named network namespaces, created and removed the way iproute2 does it, so
//! `ip netns` sees ours: a bind mount of a namespace file on `/run/netns/NAME`.
//!
//! A network namespace is per thread, so all work "inside" a namespace runs on
//! a short-lived thread that `setns()`s into it. Sockets and `/dev/net/tun`
//! descriptors keep the namespace they were opened in, so such a thread only
//! opens descriptors and the caller keeps using them from anywhere.

use crate::sync::lock;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::NetError;

pub const NETNS_RUN_DIR: &str = "/run/netns";

/// Path of a named namespace.
pub fn path_of(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

fn cstr(p: &Path) -> Result<CString, NetError> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| NetError::invalid(format!("path {} contains NUL", p.display())))
}

fn last_err(what: String) -> NetError {
    NetError::io(what, io::Error::last_os_error())
}

/// Make `/run/netns` a shared mount point, like `ip netns add` does, so our
/// bind mounts propagate to mount namespaces created later (jailer, VMMs).
fn prepare_run_dir() -> Result<(), NetError> {
    static DONE: Mutex<bool> = Mutex::new(false);
    let mut done = lock(&DONE);
    if *done {
        return Ok(());
    }
    std::fs::create_dir_all(NETNS_RUN_DIR)
        .map_err(|e| NetError::io(format!("mkdir {NETNS_RUN_DIR}"), e))?;
    let dir = cstr(Path::new(NETNS_RUN_DIR))?;
    let none = c"none";
    // SAFETY: all pointers are valid NUL-terminated strings or null.
    let shared = |d: &CString| unsafe {
        libc::mount(
            none.as_ptr(),
            d.as_ptr(),
            none.as_ptr(),
            libc::MS_SHARED | libc::MS_REC,
            std::ptr::null(),
        )
    };
    if shared(&dir) != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(NetError::io(
                format!("mount --make-rshared {NETNS_RUN_DIR}"),
                err,
            ));
        }
        // Not a mount point yet: bind it onto itself first.
        // SAFETY: valid C strings.
        let rc = unsafe {
            libc::mount(
                dir.as_ptr(),
                dir.as_ptr(),
                none.as_ptr(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(last_err(format!("mount --rbind {NETNS_RUN_DIR}")));
        }
        if shared(&dir) != 0 {
            return Err(last_err(format!("mount --make-rshared {NETNS_RUN_DIR}")));
        }
    }
    *done = true;
    Ok(())
}

/// Enter the network namespace `ns` on the current thread.
pub fn enter(ns: &File, what: &str) -> Result<(), NetError> {
    // SAFETY: setns on a valid fd; affects only the calling thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(last_err(format!("setns(CLONE_NEWNET) into {what}")));
    }
    Ok(())
}

/// Open a namespace file (`/run/netns/NAME`, `/proc/PID/ns/net`).
pub fn open(path: &Path) -> Result<File, NetError> {
    File::open(path).map_err(|e| NetError::io(format!("open netns {}", path.display()), e))
}

/// Run `f` on a fresh thread inside namespace `ns` (or in the caller's
/// namespace when `ns` is `None`) and return its result.
pub fn run_in<T: Send>(
    ns: Option<&File>,
    what: &str,
    f: impl FnOnce() -> Result<T, NetError> + Send,
) -> Result<T, NetError> {
    std::thread::scope(|s| {
        let h = std::thread::Builder::new()
            .name("netns".into())
            .spawn_scoped(s, move || {
                if let Some(ns) = ns {
                    enter(ns, what)?;
                }
                f()
            })
            .map_err(|e| NetError::io(format!("spawn thread for netns {what}"), e))?;
        h.join()
            .map_err(|_| NetError::invalid(format!("thread working in netns {what} panicked")))?
    })
}

/// Create the named namespace `name` and run `init` inside it, on the
/// calling thread (which returns to its own namespace afterwards: no thread
/// to spawn and schedule, which under load costs milliseconds). On any
/// failure the namespace is removed again. Returns an open handle to the
/// namespace and what `init` returned.
pub fn create<T>(
    name: &str,
    init: impl FnOnce() -> Result<T, NetError>,
) -> Result<(File, T), NetError> {
    prepare_run_dir()?;
    let path = path_of(name);
    // The mount point; O_EXCL makes a name clash an error instead of a takeover.
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o000)
        .open(&path)
        .map_err(|e| NetError::io(format!("create {}", path.display()), e))?;
    let res = cstr(&path).and_then(|cpath| {
        in_new_netns(name, || {
            // SAFETY: valid C strings.
            let rc = unsafe {
                libc::mount(
                    c"/proc/thread-self/ns/net".as_ptr(),
                    cpath.as_ptr(),
                    c"none".as_ptr(),
                    libc::MS_BIND,
                    std::ptr::null(),
                )
            };
            if rc != 0 {
                return Err(last_err(format!(
                    "bind mount netns onto {}",
                    path.display()
                )));
            }
            let out = init()?;
            Ok((open(&path)?, out))
        })
    });
    if res.is_err() {
        let _ = delete(name);
    }
    res
}

/// Puts the thread back into its namespace, even on unwind.
struct Home(File);

impl Drop for Home {
    fn drop(&mut self) {
        // SAFETY: setns on a valid fd, this thread only.
        if unsafe { libc::setns(self.0.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            // A daemon thread left in a session's namespace would do host
            // work in the wrong place; that must not go on.
            log::error!(
                "cannot return to the original network namespace: {}",
                io::Error::last_os_error()
            );
            std::process::abort();
        }
    }
}

/// Run `f` on the calling thread inside a brand-new network namespace.
fn in_new_netns<T>(name: &str, f: impl FnOnce() -> Result<T, NetError>) -> Result<T, NetError> {
    let home = Home(
        File::open("/proc/thread-self/ns/net")
            .map_err(|e| NetError::io("open /proc/thread-self/ns/net".into(), e))?,
    );
    // SAFETY: unshare affects only this thread's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(last_err(format!("unshare(CLONE_NEWNET) for {name}")));
    }
    let r = f();
    drop(home);
    r
}

/// Run `f` on the calling thread inside the existing namespace `ns`, then
/// return to the thread's own namespace (used to open sockets there).
pub fn within<T>(
    ns: &File,
    what: &str,
    f: impl FnOnce() -> Result<T, NetError>,
) -> Result<T, NetError> {
    let home = Home(
        File::open("/proc/thread-self/ns/net")
            .map_err(|e| NetError::io("open /proc/thread-self/ns/net".into(), e))?,
    );
    enter(ns, what)?;
    let r = f();
    drop(home);
    r
}

/// Remove the named namespace. Idempotent: a missing one is not an error.
/// The kernel frees the namespace (and the links still in it) once the last
/// reference (mount, open fd, process) is gone.
pub fn delete(name: &str) -> Result<(), NetError> {
    let path = path_of(name);
    let cpath = cstr(&path)?;
    // SAFETY: valid C string.
    if unsafe { libc::umount2(cpath.as_ptr(), libc::MNT_DETACH) } != 0 {
        let err = io::Error::last_os_error();
        // EINVAL: not mounted (half-created); ENOENT: already gone.
        if !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) {
            return Err(NetError::io(format!("umount {}", path.display()), err));
        }
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(NetError::io(format!("unlink {}", path.display()), e)),
    }
}

/// Names of the namespaces under `/run/netns` starting with `prefix`.
pub fn list(prefix: &str) -> Result<Vec<String>, NetError> {
    let rd = match std::fs::read_dir(NETNS_RUN_DIR) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NetError::io(format!("read {NETNS_RUN_DIR}"), e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| NetError::io(format!("read {NETNS_RUN_DIR}"), e))?;
        if let Some(n) = ent.file_name().to_str() {
            if n.starts_with(prefix) {
                out.push(n.to_string());
            }
        }
    }
    Ok(out)
}

/// Write a sysctl of the calling thread's network namespace.
pub fn sysctl(key: &str, value: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| NetError::io(format!("write {value} to {path}"), e))
}

/// Like [`sysctl`] with a path already split (interface names may hold dots).
pub fn sysctl_path(parts: &[&str], value: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/{}", parts.join("/"));
    std::fs::write(&path, value).map_err(|e| NetError::io(format!("write {value} to {path}"), e))
}
