//! File changes of an audited exec: a metadata scan of every writable root
//! before the exec and another after it, compared.
//!
//! Why scans and not fanotify: the root is an overlay whose writable layer
//! (the upper dir, a tmpfs) holds exactly what differs from the image, so
//! scanning it costs in proportion to what was written since boot, not to
//! the image; a whiteout there (a 0:0 character device) is a deletion. The
//! other writable mounts (`/tmp`, `/dev/shm`) are scanned whole. fanotify
//! with `FAN_REPORT_FID` would need a name lookup per event and loses
//! events when its queue overflows (a flood makes the record incomplete
//! exactly when it matters); a scan's result depends only on the state
//! before and after. Entries are compared by (inode, size, mtime, ctime,
//! mode, owner): ctime changes on every write, so a modification is not
//! missed even if mtime is reset.
//!
//! What it misses: changes by any other process during the exec's window
//! are attributed to the exec (the VM has one user, but background
//! processes write too); a file changed and changed back within the exec
//! still shows as modified (same hash); files outside the scanned roots
//! (`/run`, `/dev`, `/proc`, `/sys`, mounts the user makes); a directory
//! deleted and recreated hides its image content (noted); and scans stop
//! at [`MAX_SCAN_ENTRIES`] (noted). `/run/secrets` is never scanned (it is
//! on `/run`), and any path there is dropped.

use crate::proto::audit::limits;
use crate::proto::{FileChange, FileChangeKind, FileType};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, VecDeque};
use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Entries one scan visits over all roots.
pub const MAX_SCAN_ENTRIES: usize = 200_000;
/// Bytes hashed per exec; files past it get no sha256 (noted).
pub const HASH_BUDGET: u64 = 256 << 20;
/// Small text files the agent keeps for later diffs.
const CACHE_BYTES: usize = 4 << 20;
/// Longest a diff computation may take.
const DIFF_TIMEOUT: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    /// An overlay whiteout: the image's entry here is deleted.
    Whiteout,
    Other,
}

impl Kind {
    fn file_type(self) -> FileType {
        match self {
            Kind::File => FileType::File,
            Kind::Dir => FileType::Dir,
            Kind::Symlink => FileType::Symlink,
            Kind::Whiteout | Kind::Other => FileType::Other,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub kind: Kind,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Overlay directory made opaque (recreated: hides the image's).
    pub opaque: bool,
}

impl Meta {
    fn from_stat(st: &libc::stat) -> Meta {
        let fmt = st.st_mode & libc::S_IFMT;
        let kind = match fmt {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFCHR if st.st_rdev == 0 => Kind::Whiteout,
            _ => Kind::Other,
        };
        Meta {
            kind,
            ino: st.st_ino,
            size: st.st_size as u64,
            mtime_ns: st.st_mtime * 1_000_000_000 + st.st_mtime_nsec,
            ctime_ns: st.st_ctime * 1_000_000_000 + st.st_ctime_nsec,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            opaque: false,
        }
    }
}

/// A scanned tree: its guest path, a directory descriptor to read it by,
/// and for the overlay the image below it.
pub struct Root {
    /// Where the tree appears in the guest ("/" for the overlay).
    pub guest: String,
    pub dir: OwnedFd,
    /// The overlay's lower layer (the image), for the upper dir.
    pub lower: Option<OwnedFd>,
}

#[derive(Debug, Default)]
pub struct Snapshot {
    /// Per root, relative path -> metadata.
    pub roots: Vec<BTreeMap<String, Meta>>,
    pub truncated: bool,
}

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn lstat_at(dir: RawFd, name: &str) -> io::Result<libc::stat> {
    let c = cstr(name)?;
    // SAFETY: zeroed stat is a valid out buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, NUL-terminated name and out pointer.
    let r = unsafe { libc::fstatat(dir, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens `rel` below `root` without following any symlink and without
/// leaving the root's mount: a guest process cannot redirect the agent's
/// reads elsewhere (e.g. to `/run/secrets`) by swapping a directory.
pub fn open_beneath(root: RawFd, rel: &str, flags: i32) -> io::Result<OwnedFd> {
    let rel = if rel.is_empty() { "." } else { rel };
    let c = cstr(rel)?;
    // SAFETY: open_how is plain data; zeroed is valid.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64;
    how.resolve = libc::RESOLVE_BENEATH
        | libc::RESOLVE_NO_SYMLINKS
        | libc::RESOLVE_NO_MAGICLINKS
        | libc::RESOLVE_NO_XDEV;
    // SAFETY: valid descriptor, path and open_how of the size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root,
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn is_opaque(dir: RawFd) -> bool {
    let path = match cstr(&format!("/proc/self/fd/{dir}")) {
        Ok(p) => p,
        Err(_) => return false,
    };
    let mut v = [0u8; 4];
    // SAFETY: valid path and attribute name, buffer of the given size.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            c"trusted.overlay.opaque".as_ptr(),
            v.as_mut_ptr() as *mut libc::c_void,
            v.len(),
        )
    };
    n == 1 && v[0] == b'y'
}

/// A name the agent itself makes (`WriteFile`'s temporary `.NAME.sbx-PID-ID`).
fn agent_private(name: &str) -> bool {
    name.starts_with('.')
        && name.rsplit_once(".sbx-").is_some_and(|(_, t)| {
            t.split_once('-').is_some_and(|(a, b)| {
                !a.is_empty()
                    && !b.is_empty()
                    && a.bytes().all(|c| c.is_ascii_digit())
                    && b.bytes().all(|c| c.is_ascii_digit())
            })
        })
}

/// A guest path the record must never name.
pub fn excluded(guest_path: &str) -> bool {
    guest_path == "/run/secrets" || guest_path.starts_with("/run/secrets/")
}

fn guest_path(root: &str, rel: &str) -> String {
    if root == "/" {
        format!("/{rel}")
    } else {
        format!("{root}/{rel}")
    }
}

/// Walks one root breadth first, not following symlinks or leaving its
/// mount. `budget`: entries left for this scan.
pub fn scan_root(root: &Root, budget: &mut usize) -> (BTreeMap<String, Meta>, bool) {
    let mut out = BTreeMap::new();
    let root_dev = match lstat_at(root.dir.as_raw_fd(), ".") {
        Ok(st) => st.st_dev,
        Err(_) => return (out, false),
    };
    let mut queue: VecDeque<String> = VecDeque::new();
    queue.push_back(String::new());
    while let Some(rel) = queue.pop_front() {
        let Ok(dfd) = open_beneath(
            root.dir.as_raw_fd(),
            &rel,
            libc::O_RDONLY | libc::O_DIRECTORY,
        ) else {
            continue;
        };
        let Ok(rd) = std::fs::read_dir(format!("/proc/self/fd/{}", dfd.as_raw_fd())) else {
            continue;
        };
        for ent in rd.flatten() {
            let Some(name) = ent.file_name().to_str().map(str::to_owned) else {
                // Not UTF-8: cannot be named faithfully in the record.
                continue;
            };
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if agent_private(&name) || excluded(&guest_path(&root.guest, &path)) {
                continue;
            }
            let Ok(st) = lstat_at(dfd.as_raw_fd(), &name) else {
                continue;
            };
            if *budget == 0 {
                return (out, true);
            }
            *budget -= 1;
            let mut m = Meta::from_stat(&st);
            if m.kind == Kind::Dir {
                // Another mount below (none is expected): not ours to scan.
                if st.st_dev != root_dev {
                    continue;
                }
                if root.lower.is_some() {
                    if let Ok(sub) =
                        open_beneath(dfd.as_raw_fd(), &name, libc::O_RDONLY | libc::O_DIRECTORY)
                    {
                        m.opaque = is_opaque(sub.as_raw_fd());
                    }
                }
                queue.push_back(path.clone());
            }
            out.insert(path, m);
        }
    }
    (out, false)
}

pub fn scan(roots: &[Root]) -> Snapshot {
    let mut budget = MAX_SCAN_ENTRIES;
    let mut snap = Snapshot::default();
    for r in roots {
        let (m, t) = scan_root(r, &mut budget);
        snap.roots.push(m);
        snap.truncated |= t;
    }
    snap
}

fn same(a: &Meta, b: &Meta) -> bool {
    (
        a.kind, a.ino, a.size, a.mtime_ns, a.ctime_ns, a.mode, a.uid, a.gid,
    ) == (
        b.kind, b.ino, b.size, b.mtime_ns, b.ctime_ns, b.mode, b.uid, b.gid,
    )
}

/// Where the previous contents of a change come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prev {
    /// Nothing was there.
    None,
    /// The image (overlay lower layer), with its metadata.
    Lower(Meta),
    /// An upper (or plain-root) entry as the earlier scan saw it.
    Scanned(Meta),
}

/// One classified difference between two scans of a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub rel: String,
    pub change: FileChangeKind,
    /// The entry now (created/modified) or before (deleted).
    pub kind: Kind,
    pub now: Option<Meta>,
    pub prev: Prev,
}

/// Classifies the differences between `before` and `after` of one root.
/// `lower(rel)`: the image's entry at `rel` (overlay only; `None` for a
/// plain root). Directories are reported only when created or deleted:
/// a directory in the upper dir that the image has is a copy-up of a
/// parent, not a change of its own.
pub fn classify(
    before: &BTreeMap<String, Meta>,
    after: &BTreeMap<String, Meta>,
    lower: &dyn Fn(&str) -> Option<Meta>,
) -> Vec<Change> {
    let mut out = Vec::new();
    let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
    keys.sort();
    keys.dedup();
    for rel in keys {
        let (b, a) = (before.get(rel), after.get(rel));
        let c = |change, kind, now, prev| Change {
            rel: rel.clone(),
            change,
            kind,
            now,
            prev,
        };
        match (b, a) {
            (None, None) => {}
            (Some(b), Some(a)) if same(b, a) => {}
            (_, Some(a)) if a.kind == Kind::Whiteout => {
                // Deleted now; what was there: the upper entry, else the image's.
                match b {
                    Some(b) if b.kind == Kind::Whiteout => {}
                    Some(b) => {
                        out.push(c(FileChangeKind::Deleted, b.kind, None, Prev::Scanned(*b)))
                    }
                    None => {
                        if let Some(l) = lower(rel) {
                            out.push(c(FileChangeKind::Deleted, l.kind, None, Prev::Lower(l)));
                        }
                    }
                }
            }
            (Some(b), Some(a)) => {
                if b.kind == Kind::Whiteout {
                    out.push(c(FileChangeKind::Created, a.kind, Some(*a), Prev::None));
                } else if a.kind != Kind::Dir || b.kind != Kind::Dir {
                    out.push(c(
                        FileChangeKind::Modified,
                        a.kind,
                        Some(*a),
                        Prev::Scanned(*b),
                    ));
                }
            }
            (None, Some(a)) => match lower(rel) {
                Some(l) if a.kind == Kind::Dir && l.kind == Kind::Dir => {}
                Some(l) => out.push(c(
                    FileChangeKind::Modified,
                    a.kind,
                    Some(*a),
                    Prev::Lower(l),
                )),
                None => out.push(c(FileChangeKind::Created, a.kind, Some(*a), Prev::None)),
            },
            (Some(b), None) => {
                if b.kind != Kind::Whiteout {
                    out.push(c(FileChangeKind::Deleted, b.kind, None, Prev::Scanned(*b)));
                }
            }
        }
    }
    out
}

/// Small text files seen by earlier audited scans, for diffs: contents by
/// guest path with the metadata they had, oldest evicted first.
#[derive(Default)]
pub struct TextCache {
    entries: BTreeMap<String, (Meta, String)>,
    order: VecDeque<String>,
    bytes: usize,
}

impl TextCache {
    pub fn get(&self, path: &str, meta: &Meta) -> Option<&str> {
        let (m, s) = self.entries.get(path)?;
        same(m, meta).then_some(s.as_str())
    }

    pub fn remove(&mut self, path: &str) {
        if let Some((_, s)) = self.entries.remove(path) {
            self.bytes -= s.len();
            self.order.retain(|p| p != path);
        }
    }

    pub fn put(&mut self, path: &str, meta: Meta, text: String) {
        self.remove(path);
        if text.len() > CACHE_BYTES {
            return;
        }
        while self.bytes + text.len() > CACHE_BYTES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some((_, s)) = self.entries.remove(&old) {
                self.bytes -= s.len();
            }
        }
        self.bytes += text.len();
        self.order.push_back(path.to_string());
        self.entries.insert(path.to_string(), (meta, text));
    }
}

/// Unified diff of `old` to `new` for `path`, bounded; whether it was cut.
pub fn unified_diff(path: &str, old: &str, new: &str, had_old: bool) -> (String, bool) {
    let diff = similar::TextDiff::configure()
        .timeout(DIFF_TIMEOUT)
        .diff_lines(old, new);
    let from = if had_old {
        format!("a{path}")
    } else {
        "/dev/null".to_string()
    };
    let to = if new.is_empty() && !old.is_empty() {
        "/dev/null".to_string()
    } else {
        format!("b{path}")
    };
    let mut s = diff
        .unified_diff()
        .context_radius(3)
        .header(&from, &to)
        .to_string();
    let cut = crate::proto::audit::cut_lines(&mut s, limits::MAX_DIFF_BYTES);
    (s, cut)
}

/// Hashes the regular file `rel` below `dir`, keeping its contents if it
/// is at most `keep` bytes. Checks it is still the scanned inode.
fn read_file(
    dir: RawFd,
    rel: &str,
    expect: &Meta,
    keep: u64,
) -> io::Result<(String, Option<Vec<u8>>)> {
    let fd = open_beneath(dir, rel, libc::O_RDONLY | libc::O_NONBLOCK)?;
    let mut f = std::fs::File::from(fd);
    let md = f.metadata()?;
    if !md.is_file() || std::os::unix::fs::MetadataExt::ino(&md) != expect.ino {
        return Err(io::Error::other("changed while reading"));
    }
    let mut h = Sha256::new();
    let mut kept = (md.len() <= keep).then(Vec::new);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
        if let Some(k) = &mut kept {
            if k.len() + n > keep as usize {
                kept = None;
            } else {
                k.extend_from_slice(&buf[..n]);
            }
        }
    }
    Ok((hex(&h.finalize()), kept))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What one root's changes become in the record.
pub struct Render<'a> {
    pub root: &'a Root,
    pub cache: &'a mut TextCache,
    pub hash_left: &'a mut u64,
    pub notes: &'a mut Vec<String>,
}

impl Render<'_> {
    fn lower_text(&self, rel: &str, m: &Meta) -> Option<String> {
        let lower = self.root.lower.as_ref()?;
        if m.kind != Kind::File || m.size > limits::DIFF_MAX_FILE {
            return None;
        }
        let (_, kept) = read_file(lower.as_raw_fd(), rel, m, limits::DIFF_MAX_FILE).ok()?;
        String::from_utf8(kept?).ok()
    }

    /// Previous text of a change: `Ok(Some)` known, `Ok(None)` not text
    /// (no diff wanted), `Err(())` text we do not have.
    #[allow(clippy::result_unit_err)]
    fn prev_text(&self, path: &str, rel: &str, prev: &Prev) -> Result<Option<String>, ()> {
        match prev {
            Prev::None => Ok(Some(String::new())),
            Prev::Lower(m) if m.kind != Kind::File || m.size > limits::DIFF_MAX_FILE => Ok(None),
            Prev::Lower(m) => Ok(self.lower_text(rel, m)),
            Prev::Scanned(m) if m.kind != Kind::File || m.size > limits::DIFF_MAX_FILE => Ok(None),
            Prev::Scanned(m) => self
                .cache
                .get(path, m)
                .map(|s| Some(s.to_string()))
                .ok_or(()),
        }
    }

    pub fn change(&mut self, c: &Change) -> Option<FileChange> {
        let path = guest_path(&self.root.guest, &c.rel);
        if excluded(&path) {
            return None;
        }
        let mut fc = FileChange {
            path: path.clone(),
            path_truncated: false,
            change: c.change,
            file_type: c.kind.file_type(),
            size: c.now.map(|m| m.size),
            sha256: None,
            diff: None,
            diff_truncated: false,
            diff_unavailable: false,
        };
        if c.change == FileChangeKind::Deleted {
            // The deletion as a diff, when the old text is known.
            if let Ok(Some(old)) = self.prev_text(&path, &c.rel, &c.prev) {
                if !old.is_empty() {
                    let (d, cut) = unified_diff(&path, &old, "", true);
                    fc.diff = Some(d);
                    fc.diff_truncated = cut;
                }
            }
            self.cache.remove(&path);
            return Some(fc);
        }
        let now = c.now?;
        if now.kind != Kind::File {
            return Some(fc);
        }
        if now.size > *self.hash_left {
            self.notes.push_note(format!(
                "sha256 omitted for files past the {HASH_BUDGET}-byte hashing budget"
            ));
            return Some(fc);
        }
        let (sha, kept) = match read_file(
            self.root.dir.as_raw_fd(),
            &c.rel,
            &now,
            limits::DIFF_MAX_FILE,
        ) {
            Ok(x) => x,
            Err(_) => return Some(fc),
        };
        *self.hash_left = self.hash_left.saturating_sub(now.size);
        if let Prev::Lower(l) = c.prev {
            // A copy-up without a change (opened for writing, touched
            // nothing that shows): not a change.
            if l.kind == Kind::File
                && l.size == now.size
                && (l.mode, l.uid, l.gid) == (now.mode, now.uid, now.gid)
            {
                let lower_sha = self
                    .root
                    .lower
                    .as_ref()
                    .and_then(|d| read_file(d.as_raw_fd(), &c.rel, &l, 0).ok())
                    .map(|(h, _)| h);
                if lower_sha.as_deref() == Some(sha.as_str()) {
                    return None;
                }
            }
        }
        fc.sha256 = Some(sha);
        let Some(text) = kept.and_then(|k| String::from_utf8(k).ok()) else {
            self.cache.remove(&path);
            return Some(fc);
        };
        match self.prev_text(&path, &c.rel, &c.prev) {
            Ok(Some(old)) => {
                let (d, cut) = unified_diff(&path, &old, &text, c.prev != Prev::None);
                fc.diff = Some(d);
                fc.diff_truncated = cut;
            }
            Ok(None) => {}
            Err(()) => fc.diff_unavailable = true,
        }
        self.cache.put(&path, now, text);
        Some(fc)
    }
}

trait PushNote {
    fn push_note(&mut self, n: String);
}

impl PushNote for Vec<String> {
    fn push_note(&mut self, n: String) {
        if !self.contains(&n) {
            self.push(n);
        }
    }
}

/// Image entries below directory `rel` of the lower layer (a deleted or
/// replaced image directory's contents), at most `max`.
pub fn lower_subtree(lower: RawFd, rel: &str, max: usize) -> Vec<(String, Meta)> {
    let mut out = Vec::new();
    let mut queue = VecDeque::from([rel.to_string()]);
    while let Some(d) = queue.pop_front() {
        let Ok(dfd) = open_beneath(lower, &d, libc::O_RDONLY | libc::O_DIRECTORY) else {
            continue;
        };
        let Ok(rd) = std::fs::read_dir(format!("/proc/self/fd/{}", dfd.as_raw_fd())) else {
            continue;
        };
        for ent in rd.flatten() {
            let Some(name) = ent.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let Ok(st) = lstat_at(dfd.as_raw_fd(), &name) else {
                continue;
            };
            if out.len() >= max {
                return out;
            }
            let m = Meta::from_stat(&st);
            let p = format!("{d}/{name}");
            if m.kind == Kind::Dir {
                queue.push_back(p.clone());
            }
            out.push((p, m));
        }
    }
    out
}

/// The lower layer's entry at `rel`.
pub fn lower_meta(lower: RawFd, rel: &str) -> Option<Meta> {
    let (dir, name) = match rel.rsplit_once('/') {
        Some((d, n)) => (Some(d), n),
        None => (None, rel),
    };
    let st = match dir {
        Some(d) => {
            let dfd = open_beneath(lower, d, libc::O_RDONLY | libc::O_DIRECTORY).ok()?;
            lstat_at(dfd.as_raw_fd(), name).ok()?
        }
        None => lstat_at(lower, name).ok()?,
    };
    Some(Meta::from_stat(&st))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(kind: Kind, ino: u64, ctime: i64) -> Meta {
        Meta {
            kind,
            ino,
            size: 1,
            mtime_ns: ctime,
            ctime_ns: ctime,
            mode: 0o644,
            uid: 0,
            gid: 0,
            opaque: false,
        }
    }

    #[test]
    fn classifies_upper_dir_changes() {
        let before: BTreeMap<String, Meta> = [
            ("etc".into(), m(Kind::Dir, 1, 1)),
            ("etc/kept".into(), m(Kind::File, 2, 1)),
            ("etc/edited".into(), m(Kind::File, 3, 1)),
            ("etc/gone".into(), m(Kind::File, 4, 1)),
            ("old-whiteout".into(), m(Kind::Whiteout, 5, 1)),
            ("back".into(), m(Kind::Whiteout, 6, 1)),
        ]
        .into();
        let after: BTreeMap<String, Meta> = [
            ("etc".into(), m(Kind::Dir, 1, 2)),
            ("etc/kept".into(), m(Kind::File, 2, 1)),
            ("etc/edited".into(), m(Kind::File, 3, 2)),
            ("etc/passwd".into(), m(Kind::File, 7, 2)),
            ("etc/new".into(), m(Kind::File, 8, 2)),
            ("etc/newdir".into(), m(Kind::Dir, 9, 2)),
            ("usr".into(), m(Kind::Dir, 10, 2)),
            ("usr/bin-removed".into(), m(Kind::Whiteout, 11, 2)),
            ("old-whiteout".into(), m(Kind::Whiteout, 5, 1)),
            ("back".into(), m(Kind::File, 6, 2)),
        ]
        .into();
        let lower = |rel: &str| match rel {
            "etc" | "usr" => Some(m(Kind::Dir, 100, 0)),
            "etc/passwd" => Some(m(Kind::File, 101, 0)),
            "usr/bin-removed" => Some(m(Kind::File, 102, 0)),
            _ => None,
        };
        let got: Vec<(String, FileChangeKind, Kind)> = classify(&before, &after, &lower)
            .into_iter()
            .map(|c| (c.rel, c.change, c.kind))
            .collect();
        use FileChangeKind::*;
        assert_eq!(
            got,
            vec![
                ("back".into(), Created, Kind::File),
                ("etc/edited".into(), Modified, Kind::File),
                ("etc/gone".into(), Deleted, Kind::File),
                ("etc/new".into(), Created, Kind::File),
                ("etc/newdir".into(), Created, Kind::Dir),
                ("etc/passwd".into(), Modified, Kind::File),
                ("usr/bin-removed".into(), Deleted, Kind::File),
            ]
        );
    }

    #[test]
    fn plain_root_changes() {
        let before: BTreeMap<String, Meta> = [
            ("a".into(), m(Kind::File, 1, 1)),
            ("b".into(), m(Kind::File, 2, 1)),
        ]
        .into();
        let after: BTreeMap<String, Meta> = [
            ("b".into(), m(Kind::File, 2, 3)),
            ("c".into(), m(Kind::Symlink, 3, 3)),
        ]
        .into();
        let got: Vec<_> = classify(&before, &after, &|_| None)
            .into_iter()
            .map(|c| (c.rel, c.change))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".to_string(), FileChangeKind::Deleted),
                ("b".to_string(), FileChangeKind::Modified),
                ("c".to_string(), FileChangeKind::Created),
            ]
        );
    }

    #[test]
    fn diffs_are_bounded() {
        let (d, cut) = unified_diff("/etc/x", "a\nb\n", "a\nc\n", true);
        assert!(
            d.contains("--- a/etc/x") && d.contains("+++ b/etc/x"),
            "{d}"
        );
        assert!(d.contains("-b\n") && d.contains("+c\n"), "{d}");
        assert!(!cut);
        let (d, _) = unified_diff("/n", "", "hi\n", false);
        assert!(d.starts_with("--- /dev/null"), "{d}");
        let big: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        let (d, cut) = unified_diff("/big", "", &big, false);
        assert!(cut);
        assert!(d.len() <= limits::MAX_DIFF_BYTES && d.ends_with('\n'));
    }

    #[test]
    fn private_and_secret_paths() {
        assert!(agent_private(".notes.txt.sbx-1-42"));
        assert!(!agent_private("notes.sbx-1-42"));
        assert!(!agent_private(".x.sbx-a-1"));
        assert!(excluded("/run/secrets"));
        assert!(excluded("/run/secrets/token"));
        assert!(!excluded("/run/secretsX"));
    }

    #[test]
    fn text_cache_matches_metadata_and_evicts() {
        let mut c = TextCache::default();
        let a = m(Kind::File, 1, 1);
        c.put("/a", a, "hello".into());
        assert_eq!(c.get("/a", &a), Some("hello"));
        assert_eq!(c.get("/a", &m(Kind::File, 1, 2)), None, "changed since");
        c.put("/b", a, "x".repeat(CACHE_BYTES - 2));
        assert_eq!(c.get("/a", &a), None, "oldest evicted");
        assert!(c.bytes <= CACHE_BYTES);
        c.remove("/b");
        assert_eq!(c.bytes, 0);
    }

    #[test]
    fn scans_a_tree_and_reads_beneath_only() {
        let d = std::env::temp_dir().join(format!("fscan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/f"), "one\n").unwrap();
        std::os::unix::fs::symlink("/etc", d.join("link")).unwrap();
        let dir = std::fs::File::open(&d).unwrap();
        let root = Root {
            guest: "/w".into(),
            dir: OwnedFd::from(dir),
            lower: None,
        };
        let mut budget = 100;
        let (before, truncated) = scan_root(&root, &mut budget);
        assert!(!truncated);
        assert_eq!(before["sub/f"].kind, Kind::File);
        assert_eq!(before["link"].kind, Kind::Symlink);
        // Through the symlink: refused.
        assert!(open_beneath(root.dir.as_raw_fd(), "link/passwd", libc::O_RDONLY).is_err());
        std::fs::write(d.join("sub/f"), "two\n").unwrap();
        std::fs::write(d.join("new"), "n\n").unwrap();
        let (after, _) = scan_root(&root, &mut budget);
        let changes = classify(&before, &after, &|_| None);
        let mut cache = TextCache::default();
        let mut hash_left = HASH_BUDGET;
        let mut notes = Vec::new();
        let mut r = Render {
            root: &root,
            cache: &mut cache,
            hash_left: &mut hash_left,
            notes: &mut notes,
        };
        let out: Vec<FileChange> = changes.iter().filter_map(|c| r.change(c)).collect();
        let f = out.iter().find(|f| f.path == "/w/sub/f").unwrap();
        assert_eq!(f.change, FileChangeKind::Modified);
        assert!(f.diff_unavailable, "no earlier copy");
        let n = out.iter().find(|f| f.path == "/w/new").unwrap();
        assert_eq!(n.change, FileChangeKind::Created);
        assert_eq!(n.sha256, Some(hex(&Sha256::digest(b"n\n"))));
        assert!(n.diff.as_deref().unwrap().contains("+n\n"));
        // The new file is cached now: its next change gets a diff.
        std::fs::write(d.join("new"), "m\n").unwrap();
        let (again, _) = scan_root(&root, &mut budget);
        let ch = classify(&after, &again, &|_| None);
        let mut r = Render {
            root: &root,
            cache: &mut cache,
            hash_left: &mut hash_left,
            notes: &mut notes,
        };
        let out: Vec<FileChange> = ch.iter().filter_map(|c| r.change(c)).collect();
        let n = out.iter().find(|f| f.path == "/w/new").unwrap();
        let d2 = n.diff.as_deref().unwrap();
        assert!(d2.contains("-n\n") && d2.contains("+m\n"), "{d2}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
