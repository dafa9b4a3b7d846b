//! File operations inside an unpacked image tree that never leave it.
//!
//! An image's tree is untrusted: `/sbin` may be a symlink to `/usr/sbin`
//! (merged-usr images, which we must follow, inside the tree) or to
//! `/etc/cron.d` on the host (which we must not). Every path is resolved
//! by the kernel with `openat2(RESOLVE_IN_ROOT)`: absolute symlinks and
//! `..` stop at the tree's root, as they would inside the guest.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// An open image tree.
pub struct Root {
    dir: OwnedFd,
    path: PathBuf,
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

fn ctx(e: io::Error, what: &str, path: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {path}: {e}"))
}

/// `a/b/c` -> (`a/b`, `c`); the path is relative to the tree's root.
fn split(rel: &str) -> io::Result<(&str, &str)> {
    let rel = rel.trim_start_matches('/');
    let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    if name.is_empty() || name == "." || name == ".." {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad path {rel:?}"),
        ));
    }
    Ok((parent, name))
}

impl Root {
    pub fn open(path: &Path) -> io::Result<Root> {
        let c = cstr(&path.to_string_lossy())?;
        // SAFETY: a valid C string; the fd returned is ours.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(ctx(
                io::Error::last_os_error(),
                "open",
                &path.display().to_string(),
            ));
        }
        // SAFETY: fd was just opened and is owned by nobody else.
        let dir = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Root {
            dir,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `openat2(root, rel, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`.
    fn open_in(&self, rel: &str, flags: i32, mode: u32) -> io::Result<OwnedFd> {
        let rel = rel.trim_start_matches('/');
        let rel = if rel.is_empty() { "." } else { rel };
        let c = cstr(rel)?;
        // SAFETY: open_how is plain integers; all-zero is its default.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (flags | libc::O_CLOEXEC) as u64;
        how.mode = mode as u64;
        how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: valid pointers for the duration of the call; the kernel
        // reads `size_of::<open_how>()` bytes of `how`.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.dir.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd < 0 {
            return Err(ctx(io::Error::last_os_error(), "open", rel));
        }
        // SAFETY: a new fd the kernel just gave us.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }

    /// `mkdir -p` inside the tree (existing components are kept, symlinks
    /// among them followed inside the tree); new directories get `mode`,
    /// owned by root.
    pub fn mkdir_all(&self, rel: &str, mode: u32) -> io::Result<()> {
        let mut done = String::new();
        for comp in rel.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if comp == ".." {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("'..' in {rel:?}"),
                ));
            }
            let parent = self.open_in(&done, libc::O_DIRECTORY | libc::O_RDONLY, 0)?;
            let c = cstr(comp)?;
            // SAFETY: a directory fd we own and a valid C string.
            let r = unsafe { libc::mkdirat(parent.as_raw_fd(), c.as_ptr(), mode) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    return Err(ctx(e, "mkdir", &format!("{done}/{comp}")));
                }
            } else {
                // SAFETY: as above; a fresh directory of ours.
                unsafe { libc::fchmodat(parent.as_raw_fd(), c.as_ptr(), mode, 0) };
            }
            if !done.is_empty() {
                done.push('/');
            }
            done.push_str(comp);
        }
        // It must be a directory now (a file or dangling link fails here).
        self.open_in(rel, libc::O_DIRECTORY | libc::O_PATH, 0)
            .map(drop)
    }

    /// Replaces whatever is at `rel` (a file, a symlink: not followed)
    /// with a new root-owned file of `mode` holding `data`.
    pub fn write_file(&self, rel: &str, data: &[u8], mode: u32) -> io::Result<()> {
        let (parent, name) = split(rel)?;
        self.mkdir_all(parent, 0o755)?;
        let dir = self.open_in(parent, libc::O_DIRECTORY | libc::O_RDONLY, 0)?;
        let c = cstr(name)?;
        // SAFETY: a directory fd we own and a valid C string.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(ctx(e, "remove", rel));
            }
        }
        // SAFETY: as above; O_EXCL|O_NOFOLLOW so only a new file is written.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode,
            )
        };
        if fd < 0 {
            return Err(ctx(io::Error::last_os_error(), "create", rel));
        }
        // SAFETY: the fd was just opened and is ours.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(data).map_err(|e| ctx(e, "write", rel))?;
        // SAFETY: fchown/fchmod on our own fd (the umask does not apply).
        unsafe {
            libc::fchown(f.as_raw_fd(), 0, 0);
            libc::fchmod(f.as_raw_fd(), mode);
        }
        Ok(())
    }

    /// Creates an empty root-owned file at `rel` unless something is there.
    pub fn touch(&self, rel: &str, mode: u32) -> io::Result<()> {
        match self.open_in(rel, libc::O_PATH | libc::O_NOFOLLOW, 0) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => self.write_file(rel, b"", mode),
            Err(e) => Err(e),
        }
    }

    /// The file at `rel` (symlinks followed inside the tree), at most `max`
    /// bytes; `None` when there is none.
    pub fn read_file(&self, rel: &str, max: u64) -> io::Result<Option<Vec<u8>>> {
        let fd = match self.open_in(rel, libc::O_RDONLY, 0) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        File::from(fd)
            .take(max + 1)
            .read_to_end(&mut out)
            .map_err(|e| ctx(e, "read", rel))?;
        if out.len() as u64 > max {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{rel} is larger than {max} bytes"),
            ));
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn writes_follow_links_inside_the_tree_only() {
        let outside = tempfile::tempdir().unwrap();
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("usr/sbin")).unwrap();
        symlink("usr/sbin", t.path().join("sbin")).unwrap();
        // An absolute link to a host directory: must land in the tree (at
        // the same path below it, as in the guest), never on the host.
        symlink(outside.path(), t.path().join("etc")).unwrap();
        let inside_dir = t.path().join(outside.path().strip_prefix("/").unwrap());
        std::fs::create_dir_all(&inside_dir).unwrap();
        symlink("../../../../..", t.path().join("up")).unwrap();
        let r = Root::open(t.path()).unwrap();
        r.write_file("/sbin/agent", b"x", 0o755).unwrap();
        assert_eq!(
            std::fs::read(t.path().join("usr/sbin/agent")).unwrap(),
            b"x"
        );
        r.write_file("/etc/agent-sandbox/t.json", b"{}", 0o644)
            .unwrap();
        r.write_file("/up/escape", b"no", 0o644).unwrap();
        assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none());
        // The absolute link resolved to <tree><outside>, inside the tree.
        let inside = inside_dir.join("agent-sandbox/t.json");
        assert!(inside.exists(), "{inside:?}");
        assert!(t.path().join("escape").exists());
        // A file replaced by us is a new file, not written through a link.
        symlink("/etc/passwd", t.path().join("usr/sbin/x")).unwrap();
        r.write_file("/sbin/x", b"y", 0o600).unwrap();
        assert!(!std::fs::symlink_metadata(t.path().join("usr/sbin/x"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(r.read_file("/sbin/x", 10).unwrap().unwrap(), b"y");
        assert!(r.read_file("/sbin/x", 0).is_err());
        assert_eq!(r.read_file("/nope", 10).unwrap(), None);
        std::fs::write(t.path().join("file"), b"").unwrap();
        assert!(r.mkdir_all("/file/sub", 0o755).is_err());
        assert!(r.mkdir_all("/a/../b", 0o755).is_err());
    }
}
