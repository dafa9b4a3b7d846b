//! Guest RAM in memfds: a booted VM's own ([`GuestRam`], saved sparsely
//! into a snapshot) and a snapshot's, sealed and shared by every restore
//! of it ([`SnapshotMemory`]).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::{io_err, lock, QemuBackend};
use crate::vm::{Result, VmError};

impl QemuBackend {
    /// The sealed memfd holding the snapshot RAM file `path` (`len` bytes),
    /// made on first use and reused while the file is unchanged (a rebuilt
    /// snapshot is a new file: its first restore loads it again).
    pub(super) fn snapshot_memory(&self, path: &Path, len: u64) -> Result<Arc<SnapshotMemory>> {
        let bad = |problem: String| VmError::BadFile {
            path: path.to_path_buf(),
            problem,
            fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
        };
        let m = fs::metadata(path).map_err(|e| bad(format!("cannot stat snapshot memory: {e}")))?;
        if m.len() != len {
            return Err(bad(format!(
                "snapshot memory is {} bytes, the VM has {len}",
                m.len()
            )));
        }
        let id = (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec());
        // Held while loading: concurrent first restores load it once.
        let mut cache = lock(&self.snap_mem);
        if let Some(s) = cache.get(path) {
            if s.id == id {
                return Ok(s.clone());
            }
        }
        let t = Instant::now();
        let s = Arc::new(SnapshotMemory::load(path, len, id)?);
        log::info!(
            "qemu: loaded snapshot memory {} ({} MiB of data) in {} ms",
            path.display(),
            s.data_bytes >> 20,
            t.elapsed().as_millis()
        );
        cache.insert(path.to_path_buf(), s.clone());
        Ok(s)
    }
}

/// A booted VM's RAM: a memfd of the daemon's, sized to the guest's RAM
/// and sealed against resizing, that QEMU maps shared. Its pages live in
/// memory (charged to the VM's cgroup as QEMU touches them), never on a
/// persistent disk, and go when the last holder closes it.
pub struct GuestRam {
    pub(super) fd: OwnedFd,
}

impl GuestRam {
    pub fn new(mem_mib: u32) -> Result<GuestRam> {
        // SAFETY: memfd_create with a NUL-terminated name; the fd is ours.
        let fd = unsafe {
            libc::memfd_create(
                c"agent-sandbox-ram".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io_err(
                "memfd_create for guest RAM".into(),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new fd nobody else owns.
        let mem = unsafe { fs::File::from_raw_fd(fd) };
        mem.set_len(u64::from(mem_mib) << 20)
            .map_err(|e| io_err(format!("size the guest RAM memfd to {mem_mib} MiB"), e))?;
        // A compromised QEMU can reopen it through /proc/self/fd: it must
        // not grow it past the guest's size (or shrink it under the daemon).
        let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own fd.
        if unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io_err(
                "seal the guest RAM memfd".into(),
                io::Error::last_os_error(),
            ));
        }
        Ok(GuestRam { fd: mem.into() })
    }

    /// Copies the RAM's data into a new 0600 file `dst` of the same size,
    /// keeping holes (most of a fresh guest's RAM was never touched).
    pub(super) fn save(self, dst: &Path, mem_mib: u32) -> Result<()> {
        let d = new_ram_file(dst, mem_mib)?;
        self.copy_to(&d, dst, mem_mib).map(|_| ())
    }

    /// Copies the RAM's data into `d` (a new file of the RAM's size, at
    /// `dst`), keeping holes; the RAM stays the VM's. Returns the bytes
    /// copied.
    pub(super) fn copy_to(&self, d: &fs::File, dst: &Path, mem_mib: u32) -> Result<u64> {
        let src = fs::File::from(
            self.fd
                .try_clone()
                .map_err(|e| io_err("dup the guest RAM memfd".into(), e))?,
        );
        let len = u64::from(mem_mib) << 20;
        copy_extents(&src, d, len, Path::new("guest RAM memfd"), dst)
    }
}

/// A new 0600 file `dst` of `mem_mib` MiB, all hole: a snapshot's `memory`
/// before its data is written.
pub(super) fn new_ram_file(dst: &Path, mem_mib: u32) -> Result<fs::File> {
    let d = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)
        .map_err(|e| io_err(format!("create {}", dst.display()), e))?;
    d.set_len(u64::from(mem_mib) << 20)
        .map_err(|e| io_err(format!("size {}", dst.display()), e))?;
    Ok(d)
}

/// A snapshot's RAM in a sealed memfd: QEMU maps it privately (reads share
/// its pages, writes are copy-on-write in the VM's own memory). The seals
/// make it immutable for every holder, including a compromised VMM that
/// reopens it read-write through `/proc/self/fd`: no write, no resize, no
/// shared writable mapping, no seal removed.
pub struct SnapshotMemory {
    pub(super) fd: OwnedFd,
    /// (dev, inode, size, mtime s, mtime ns) of the file it was loaded from.
    pub(super) id: (u64, u64, u64, i64, i64),
    pub(super) data_bytes: u64,
}

impl SnapshotMemory {
    /// `path` must be `len` bytes long (checked by the caller).
    pub(super) fn load(
        path: &Path,
        len: u64,
        id: (u64, u64, u64, i64, i64),
    ) -> Result<SnapshotMemory> {
        let bad = |problem: String| VmError::BadFile {
            path: path.to_path_buf(),
            problem,
            fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
        };
        let src =
            fs::File::open(path).map_err(|e| bad(format!("cannot open snapshot memory: {e}")))?;
        // SAFETY: memfd_create with a NUL-terminated name; the fd is ours.
        let fd = unsafe {
            libc::memfd_create(
                c"agent-sandbox-snapshot-ram".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io_err(
                format!("memfd_create for {}", path.display()),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: a new fd nobody else owns.
        let mem = unsafe { fs::File::from_raw_fd(fd) };
        mem.set_len(len)
            .map_err(|e| io_err(format!("size the memfd for {}", path.display()), e))?;
        let data_bytes = copy_extents(&src, &mem, len, path, Path::new("memfd"))?;
        let seals =
            libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own fd.
        if unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
            return Err(io_err(
                format!("seal the memfd for {}", path.display()),
                io::Error::last_os_error(),
            ));
        }
        Ok(SnapshotMemory {
            fd: mem.into(),
            id,
            data_bytes,
        })
    }
}

/// Copies the data extents of `s` to the same offsets of `d`; returns the
/// bytes copied.
pub(super) fn copy_extents(
    s: &fs::File,
    d: &fs::File,
    len: u64,
    src: &Path,
    dst: &Path,
) -> Result<u64> {
    let bad = |problem: String| VmError::BadFile {
        path: src.to_path_buf(),
        problem,
        fix: "rebuild the snapshot: agent-sandbox snapshot create --template <T>".into(),
    };
    let (sfd, dfd) = (s.as_raw_fd(), d.as_raw_fd());
    let mut off: i64 = 0;
    let mut copied: u64 = 0;
    while (off as u64) < len {
        // SAFETY: lseek on our own fd.
        let data = unsafe { libc::lseek(sfd, off, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return Err(io_err(format!("SEEK_DATA in {}", src.display()), e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io_err(
                format!("SEEK_HOLE in {}", src.display()),
                io::Error::last_os_error(),
            ));
        }
        let mut so = data;
        let mut doff = data;
        while so < hole {
            // SAFETY: copy_file_range between two fds we own with offsets
            // we own.
            let n = unsafe {
                libc::copy_file_range(sfd, &mut so, dfd, &mut doff, (hole - so) as usize, 0)
            };
            let n = if n < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EXDEV) {
                // copy_file_range does not cross file systems (into a
                // memfd, for one): sendfile writes at the file position.
                // SAFETY: lseek/sendfile on our own fds and offsets.
                unsafe {
                    if libc::lseek(dfd, doff, libc::SEEK_SET) < 0 {
                        -1
                    } else {
                        let n = libc::sendfile(dfd, sfd, &mut so, (hole - so) as usize);
                        if n > 0 {
                            doff += n as i64;
                        }
                        n
                    }
                }
            } else {
                n
            };
            if n < 0 {
                return Err(io_err(
                    format!("copy {} to {}", src.display(), dst.display()),
                    io::Error::last_os_error(),
                ));
            }
            if n == 0 {
                return Err(bad("snapshot memory shrank while being copied".into()));
            }
            copied += n as u64;
        }
        off = hole;
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::qemu::QemuConfig;
    use std::time::Duration;

    #[test]
    fn snapshot_memory_is_a_sealed_copy_reloaded_when_the_file_changes() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("memory");
        let f = fs::File::create(&src).expect("create");
        f.set_len(16 << 20).expect("size");
        f.write_all_at(b"guest", 3 << 20).expect("write");
        drop(f);
        let b = QemuBackend::new(QemuConfig::default());
        let m = b.snapshot_memory(&src, 16 << 20).expect("load");
        assert_eq!(m.data_bytes % 4096, 0);
        assert!(
            m.data_bytes < 1 << 20,
            "holes were copied: {}",
            m.data_bytes
        );
        let mem = fs::File::from(m.fd.try_clone().expect("dup"));
        assert_eq!(mem.metadata().expect("stat").len(), 16 << 20);
        let mut buf = [0u8; 5];
        mem.read_exact_at(&mut buf, 3 << 20).expect("read");
        assert_eq!(&buf, b"guest");
        // Sealed: a VMM holding it (or reopening it read-write through
        // /proc/self/fd) cannot change what later restores start from.
        let rw = fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/self/fd/{}", mem.as_raw_fd()))
            .expect("reopen read-write");
        assert!(rw.write_all_at(b"evil!", 3 << 20).is_err());
        assert!(rw.set_len(1 << 20).is_err());
        // SAFETY: F_GET_SEALS on our own fd.
        let seals = unsafe { libc::fcntl(mem.as_raw_fd(), libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_SEAL, 0);
        // Unchanged file: the same copy; a rebuilt one: a new copy.
        assert!(Arc::ptr_eq(
            &m,
            &b.snapshot_memory(&src, 16 << 20).expect("again")
        ));
        std::thread::sleep(Duration::from_millis(10));
        fs::OpenOptions::new()
            .write(true)
            .open(&src)
            .expect("open")
            .write_all_at(b"other", 3 << 20)
            .expect("write");
        let m2 = b.snapshot_memory(&src, 16 << 20).expect("reload");
        assert!(!Arc::ptr_eq(&m, &m2));
        match b.snapshot_memory(&src, 32 << 20) {
            Err(VmError::BadFile { path, .. }) => assert_eq!(path, src),
            other => panic!("{:?}", other.err()),
        }
    }

    #[test]
    fn a_forgotten_snapshot_dir_loses_its_cached_ram() {
        use crate::vm::Backend;
        let d = tempfile::tempdir().expect("tempdir");
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        let mut paths = Vec::new();
        for dir in [&a, &b] {
            fs::create_dir(dir).expect("mkdir");
            let p = dir.join("memory");
            fs::File::create(&p)
                .and_then(|f| f.set_len(1 << 20))
                .expect("memory");
            paths.push(p);
        }
        let be = QemuBackend::new(QemuConfig::default());
        let ma = be.snapshot_memory(&paths[0], 1 << 20).expect("a");
        let mb = be.snapshot_memory(&paths[1], 1 << 20).expect("b");
        be.forget_snapshot(&a);
        // A restore still running holds its copy; the cache does not.
        assert_eq!(Arc::strong_count(&ma), 1);
        assert_eq!(Arc::strong_count(&mb), 2);
        assert!(!Arc::ptr_eq(
            &ma,
            &be.snapshot_memory(&paths[0], 1 << 20).expect("a again")
        ));
        assert!(Arc::ptr_eq(
            &mb,
            &be.snapshot_memory(&paths[1], 1 << 20).expect("b again")
        ));
    }

    #[test]
    fn guest_ram_is_a_sealed_memfd_saved_sparsely() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(64).expect("memfd");
        let path = format!("/proc/self/fd/{}", ram.fd.as_raw_fd());
        let link = fs::read_link(&path).expect("readlink");
        assert!(
            link.to_string_lossy()
                .starts_with("/memfd:agent-sandbox-ram"),
            "{link:?}"
        );
        // What QEMU does: open it by path and write through it.
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("reopen");
        f.write_all_at(b"hello", 10 << 20).expect("write");
        f.write_all_at(b"world", (64 << 20) - 5).expect("write");
        // Sealed: neither grown nor shrunk, by anyone.
        assert!(f.set_len(128 << 20).is_err());
        assert!(f.set_len(1 << 20).is_err());
        drop(f);
        let d = tempfile::tempdir().expect("tempdir");
        let dst = d.path().join("memory");
        ram.save(&dst, 64).expect("save");
        let m = fs::metadata(&dst).expect("stat");
        assert_eq!(m.len(), 64 << 20);
        assert_eq!(m.mode() & 0o777, 0o600);
        assert!(m.blocks() * 512 < 8 << 20, "copy is not sparse");
        let data = fs::read(&dst).expect("read");
        assert_eq!(&data[10 << 20..(10 << 20) + 5], b"hello");
        assert_eq!(&data[(64 << 20) - 5..], b"world");
        assert!(data[..10 << 20].iter().all(|&b| b == 0));
    }
}
