//! Templates from users' images (issue #27): an OCI image or a Dockerfile
//! becomes a template like our own, with the same erofs root and snapshot
//! path, without Docker on the host.
//!
//! The steps, each named in progress and in every failure:
//! - `build` (Dockerfile only): `buildah build` (daemonless, OCI isolation
//!   through runc, no network unless asked), into storage of the build's
//!   own that is removed afterwards;
//! - `fetch`: `skopeo copy` of the source (`oci-archive:`, `oci:`,
//!   `docker-archive:`, `docker://`) into an OCI layout of the build's;
//!   skopeo checks every blob's digest as it copies;
//! - `verify`: the manifest and config are read ([`oci`]), each layer's
//!   size and sha256 checked again (a corrupt one is named: "layer 2 of
//!   3"), the total bounded;
//! - `unpack`: `umoci raw unpack`, which applies the layers with the OCI
//!   whiteout rules and keeps ownership, modes, xattrs and hard links
//!   (and resolves every path inside the tree);
//! - `agent`: our agent at `/sbin/sandbox-agent` (the kernel's `init=`;
//!   the image's own init is never run) and
//!   `/etc/agent-sandbox/template.json` with the image's `Env`,
//!   `WorkingDir` and `User`, written with [`inroot`] so no symlink of
//!   the image leads outside its tree;
//! - `erofs`: `mkfs.erofs` keeping owners (no `--all-root`);
//! - `register`: the template file, written last (a half-built template
//!   never becomes visible).
//!
//! The erofs is cached by the image's manifest digest and the agent: a
//! rebuild of the same image skips `unpack`..`erofs`. The build's work
//! directory is removed whatever happens.

pub mod dockerfile;
pub mod inroot;
pub mod oci;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use super::templates::{custom_templates_dir, AGENT_PATH};
use super::templates::{valid_name, Template, TemplateSource};

/// Bumped when what a build writes into an image changes: part of the
/// cache key, so older builds are not reused.
const BUILDER_VERSION: &str = "1";
/// The template description the agent reads at boot.
pub const TEMPLATE_FILE: &str = "/etc/agent-sandbox/template.json";
/// Lines of a tool's output kept for a failure and the build's status.
pub const LOG_TAIL: usize = 40;
/// The tag the fetched image gets in the build's own layout.
const TAG: &str = "img";

/// Where a template's image comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    OciArchive(PathBuf),
    Oci {
        dir: PathBuf,
        tag: Option<String>,
    },
    DockerArchive(PathBuf),
    /// A registry reference, pulled by skopeo.
    Docker(String),
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, String> {
        let path = |p: &str| -> Result<PathBuf, String> {
            if p.is_empty() {
                return Err(format!("{s:?}: no path"));
            }
            Ok(PathBuf::from(p))
        };
        if let Some(p) = s.strip_prefix("oci-archive:") {
            return Ok(Source::OciArchive(path(p)?));
        }
        if let Some(p) = s.strip_prefix("docker-archive:") {
            return Ok(Source::DockerArchive(path(p)?));
        }
        if let Some(r) = s.strip_prefix("docker://") {
            if r.is_empty() || r.len() > 512 || r.bytes().any(|b| b.is_ascii_whitespace()) {
                return Err(format!("{s:?}: not an image reference"));
            }
            return Ok(Source::Docker(r.to_string()));
        }
        if let Some(p) = s.strip_prefix("oci:") {
            // oci:DIR or oci:DIR:TAG (a tag has no '/').
            return Ok(match p.rsplit_once(':') {
                Some((d, t)) if !t.contains('/') && !t.is_empty() => Source::Oci {
                    dir: path(d)?,
                    tag: Some(t.to_string()),
                },
                _ => Source::Oci {
                    dir: path(p)?,
                    tag: None,
                },
            });
        }
        Err(format!(
            "{s:?}: expected oci-archive:FILE, oci:DIR[:TAG], docker-archive:FILE or docker://REF"
        ))
    }

    /// The reference skopeo takes.
    fn skopeo_ref(&self) -> String {
        match self {
            Source::OciArchive(p) => format!("oci-archive:{}", p.display()),
            Source::Oci { dir, tag: Some(t) } => format!("oci:{}:{t}", dir.display()),
            Source::Oci { dir, tag: None } => format!("oci:{}", dir.display()),
            Source::DockerArchive(p) => format!("docker-archive:{}", p.display()),
            Source::Docker(r) => format!("docker://{r}"),
        }
    }

    /// The host file or directory it names, if any.
    pub fn local_path(&self) -> Option<&Path> {
        match self {
            Source::OciArchive(p) | Source::DockerArchive(p) => Some(p),
            Source::Oci { dir, .. } => Some(dir),
            Source::Docker(_) => None,
        }
    }
}

/// Network of a Dockerfile's `RUN` steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BuildNetwork {
    /// None at all (the default: a build reaches nothing).
    #[default]
    None,
    /// The host's network, as `docker build` has.
    Host,
}

/// What to build: the arguments of `agent-sandbox template build` (one
/// definition for the CLI and the builder process's requests).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BuildSpec {
    /// Template name: [a-z0-9][a-z0-9_-]{0,31}.
    pub name: String,
    /// oci-archive:FILE | oci:DIR[:TAG] | docker-archive:FILE | docker://REF
    #[serde(default)]
    #[arg(
        long,
        conflicts_with = "dockerfile",
        required_unless_present = "dockerfile"
    )]
    pub from: Option<String>,
    /// A Dockerfile, built with buildah (its FROM may name
    /// oci-archive:FILE or another transport).
    #[serde(default)]
    #[arg(long)]
    pub dockerfile: Option<PathBuf>,
    /// Build context [the Dockerfile's directory].
    #[serde(default)]
    #[arg(long, requires = "dockerfile")]
    pub context: Option<PathBuf>,
    /// [the image's label template.displayName]
    #[serde(default)]
    #[arg(long)]
    pub display_name: Option<String>,
    /// [the label template.description]
    #[serde(default)]
    #[arg(long)]
    pub description: Option<String>,
    /// Comma-separated commands the template offers [the label template.tools].
    #[serde(default)]
    #[arg(long, value_delimiter = ',')]
    pub tools: Option<Vec<String>>,
    /// Default vCPUs of its sessions.
    #[serde(default)]
    #[arg(long)]
    pub vcpus: Option<u32>,
    /// Default memory of its sessions.
    #[serde(default)]
    #[arg(long)]
    pub memory_mib: Option<u32>,
    /// Default cap of its writable layer.
    #[serde(default)]
    #[arg(long)]
    pub disk_mib: Option<u32>,
    /// Network of RUN steps.
    #[serde(default)]
    #[arg(long, value_enum, default_value = "none")]
    pub network: BuildNetwork,
    /// docker:// without TLS verification (a registry on localhost).
    #[serde(default)]
    #[arg(long)]
    pub insecure_registry: bool,
}

/// Where a build reads and writes, and how much it may.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The image cache: `rootfs/` gets the erofs, `templates/` the template
    /// file, `build/` the work directories.
    pub cache_dir: PathBuf,
    /// Our own templates (`images/templates`): their names are taken.
    pub builtin_templates: PathBuf,
    /// The static guest agent to put in the image.
    pub agent: PathBuf,
    /// Bound on the image's layers (compressed) and on its unpacked tree.
    pub max_bytes: u64,
}

impl Paths {
    pub fn templates_dir(&self) -> PathBuf {
        custom_templates_dir(&self.cache_dir)
    }
}

/// A step's name, for progress and failures.
pub const STEPS_IMAGE: &[&str] = &["fetch", "verify", "unpack", "agent", "erofs", "register"];
pub const STEPS_DOCKERFILE: &[&str] = &[
    "build", "fetch", "verify", "unpack", "agent", "erofs", "register",
];

/// What a build tells as it goes (the worker's stdout lines, in JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Event {
    /// Step `index` (1-based) of `total` starts.
    #[serde(rename_all = "camelCase")]
    Step {
        name: String,
        index: usize,
        total: usize,
    },
    /// Bytes of the current step done, of `total` (0: unknown).
    Bytes {
        done: u64,
        total: u64,
    },
    /// A line of a tool's output.
    Log {
        line: String,
    },
    Ready(Built),
    Failed(BuildError),
}

/// A finished build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Built {
    pub template: String,
    pub rootfs: PathBuf,
    /// The image's manifest digest.
    pub digest: String,
    /// Size of the erofs image.
    pub image_bytes: u64,
    /// The erofs of an earlier build of the same image was reused.
    pub cached: bool,
    pub seconds: f64,
}

/// A failed build: the step, where in the input (a layer, a Dockerfile
/// line), the tool's or our own message, and the tool's last lines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "camelCase")]
#[error("{}", self.describe())]
pub struct BuildError {
    pub step: String,
    #[serde(default)]
    pub at: Option<String>,
    pub message: String,
    #[serde(default)]
    pub log_tail: Vec<String>,
}

impl BuildError {
    fn new(step: &str, message: impl Into<String>) -> Self {
        BuildError {
            step: step.into(),
            at: None,
            message: message.into(),
            log_tail: Vec::new(),
        }
    }

    fn at(mut self, at: Option<String>) -> Self {
        self.at = at;
        self
    }

    fn describe(&self) -> String {
        match &self.at {
            Some(a) => format!("step {}: {a}: {}", self.step, self.message),
            None => format!("step {}: {}", self.step, self.message),
        }
    }
}

/// The last [`LOG_TAIL`] lines of a tool.
#[derive(Default)]
struct Tail(std::collections::VecDeque<String>);

impl Tail {
    fn push(&mut self, l: String) {
        if self.0.len() == LOG_TAIL {
            self.0.pop_front();
        }
        self.0.push_back(l);
    }
    fn lines(&self) -> Vec<String> {
        self.0.iter().cloned().collect()
    }
    /// The tool's own error: its last line that says so, else its last line.
    fn error_line(&self) -> Option<String> {
        self.0
            .iter()
            .rev()
            .find(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("error") || l.contains("fatal")
            })
            .or_else(|| self.0.back())
            .cloned()
    }
}

/// A program on PATH, or a failure of `step` saying how to get it.
fn tool(step: &str, name: &str, package: &str) -> Result<PathBuf, BuildError> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            BuildError::new(
                step,
                format!("{name} not found on PATH (install Debian's {package})"),
            )
        })
}

/// A pipe, both ends close-on-exec.
pub fn pipe() -> io::Result<(fs::File, fs::File)> {
    let mut fds = [0i32; 2];
    // SAFETY: a two-int array for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and belong to us alone.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((fs::File::from(r), fs::File::from(w)))
}

/// Runs a tool with stdout and stderr merged, each line to `emit` and the
/// tail; fails `step` with the tool's own error line.
fn run_tool(
    step: &str,
    cmd: &mut Command,
    emit: &mut dyn FnMut(Event),
    tail: &mut Tail,
) -> Result<(), BuildError> {
    let prog = cmd.get_program().to_string_lossy().into_owned();
    let (r, w) = pipe().map_err(|e| BuildError::new(step, format!("pipe: {e}")))?;
    let w2 = w
        .try_clone()
        .map_err(|e| BuildError::new(step, format!("pipe: {e}")))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(w))
        .stderr(Stdio::from(w2))
        .spawn()
        .map_err(|e| BuildError::new(step, format!("start {prog}: {e}")))?;
    // The Command keeps the write ends it was given until they are
    // replaced: without this the read below never sees EOF.
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    for line in BufReader::new(r).split(b'\n') {
        let Ok(line) = line else { break };
        // Progress bars redraw with \r: keep the last state of the line.
        let s = String::from_utf8_lossy(&line);
        let s = s.rsplit('\r').find(|p| !p.trim().is_empty()).unwrap_or("");
        let s: String = s.chars().take(1000).collect();
        if s.trim().is_empty() {
            continue;
        }
        tail.push(s.clone());
        emit(Event::Log { line: s });
    }
    let st = child
        .wait()
        .map_err(|e| BuildError::new(step, format!("wait for {prog}: {e}")))?;
    if st.success() {
        return Ok(());
    }
    let msg = tail.error_line().unwrap_or_default();
    Err(BuildError {
        step: step.into(),
        at: None,
        message: format!("{} failed ({st}): {msg}", Path::new(&prog).display()),
        log_tail: tail.lines(),
    })
}

/// Removes a build's work directory whatever happens.
struct WorkDir(PathBuf);

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            if e.kind() != io::ErrorKind::NotFound {
                log::warn!("build dir {}: {e}", self.0.display());
            }
        }
    }
}

/// A temporary file that goes unless kept.
struct TmpFile(Option<PathBuf>);

impl TmpFile {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = fs::remove_file(p);
        }
    }
}

/// Holds `<cache>/templates/.<name>.lock`: one build of a name at a time.
struct NameLock(#[allow(dead_code)] fs::File);

fn lock_name(dir: &Path, name: &str) -> Result<NameLock, BuildError> {
    let p = dir.join(format!(".{name}.lock"));
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .map_err(|e| BuildError::new("fetch", format!("{}: {e}", p.display())))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } < 0 {
        return Err(BuildError::new(
            "fetch",
            format!("template {name} is being built by another build"),
        ));
    }
    Ok(NameLock(f))
}

/// Removes work directories (`<name>-<pid>-<n>`) of builds whose process
/// is gone (killed: its own cleanup never ran).
fn sweep_dead_builds(work_root: &Path) {
    for e in fs::read_dir(work_root).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
}

/// Bytes of a tree (regular files' sizes), or an error past `max`.
fn tree_bytes(root: &Path, max: u64) -> io::Result<u64> {
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let m = e.metadata()?; // lstat: links are not followed
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                total += m.len();
            }
            if total > max {
                return Err(io::Error::other(format!(
                    "the unpacked image is larger than {} MiB",
                    max >> 20
                )));
            }
        }
    }
    Ok(total)
}

fn sha256_file(p: &Path) -> io::Result<String> {
    let mut f = fs::File::open(p)?;
    let mut h = Sha256::new();
    io::copy(&mut f, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

/// `user`, `uid`, `user:group` or `uid:gid` of an image's `User`, by the
/// image's own `/etc/passwd` and `/etc/group`; with the user's home.
fn resolve_user(root: &inroot::Root, user: &str) -> Result<(u32, u32, Option<String>), String> {
    let read = |p: &str| -> Result<String, String> {
        Ok(root
            .read_file(p, 4 << 20)
            .map_err(|e| e.to_string())?
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default())
    };
    let passwd = read("/etc/passwd")?;
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    // name:x:uid:gid:gecos:home:shell
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && (f[0] == u || f[2] == u));
    let uid = match u.parse::<u32>() {
        Ok(n) => n,
        Err(_) => entry
            .as_ref()
            .and_then(|f| f[2].parse().ok())
            .ok_or_else(|| format!("User {user:?}: no user {u:?} in the image's /etc/passwd"))?,
    };
    let home = entry.as_ref().map(|f| f[5].to_string());
    let gid = match g {
        None => entry
            .as_ref()
            .and_then(|f| f[3].parse().ok())
            .unwrap_or(if uid == 0 { 0 } else { uid }),
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => read("/etc/group")?
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| {
                    format!("User {user:?}: no group {g:?} in the image's /etc/group")
                })?,
        },
    };
    Ok((uid, gid, home))
}

/// What the agent reads from [`TEMPLATE_FILE`], and the template's
/// session defaults.
#[derive(Debug, Clone, Default, Serialize)]
struct Defaults {
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    uid: Option<u32>,
    gid: Option<u32>,
}

fn defaults_of(root: &inroot::Root, cfg: &oci::RunConfig) -> Result<Defaults, String> {
    let mut d = Defaults::default();
    for kv in cfg.env.iter().flatten() {
        match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                d.env.insert(k.to_string(), v.to_string());
            }
            _ => return Err(format!("Env entry {kv:?} is not KEY=VALUE")),
        }
    }
    d.workdir = cfg
        .working_dir
        .as_ref()
        .filter(|w| !w.is_empty())
        .map(|w| {
            if w.starts_with('/') {
                Ok(w.clone())
            } else {
                Err(format!("WorkingDir {w:?} is not absolute"))
            }
        })
        .transpose()?;
    let mut home = None;
    if let Some(u) = cfg.user.as_ref().filter(|u| !u.is_empty()) {
        let (uid, gid, h) = resolve_user(root, u)?;
        d.uid = Some(uid);
        d.gid = Some(gid);
        home = h;
    }
    if !d.env.contains_key("HOME") {
        let h = home.unwrap_or_else(|| "/root".into());
        d.env.insert("HOME".into(), h);
    }
    Ok(d)
}

/// Puts the agent and its files into the tree.
fn inject(tree: &Path, agent: &Path, name: &str, d: &Defaults) -> Result<(), String> {
    let root = inroot::Root::open(tree).map_err(|e| e.to_string())?;
    let bin = fs::read(agent).map_err(|e| format!("agent {}: {e}", agent.display()))?;
    // Mount points the agent needs before it has a writable root.
    for dir in ["/proc", "/sys", "/dev", "/mnt", "/run", "/tmp"] {
        root.mkdir_all(dir, 0o755).map_err(|e| e.to_string())?;
    }
    root.write_file(AGENT_PATH, &bin, 0o755)
        .map_err(|e| e.to_string())?;
    let mut tf = serde_json::to_value(d).map_err(|e| e.to_string())?;
    tf["name"] = name.into();
    let tf = serde_json::to_vec_pretty(&tf).map_err(|e| e.to_string())?;
    root.write_file(TEMPLATE_FILE, &tf, 0o644)
        .map_err(|e| e.to_string())?;
    root.touch("/etc/resolv.conf", 0o644)
        .map_err(|e| e.to_string())?;
    if let Some(w) = &d.workdir {
        root.mkdir_all(w, 0o755).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Builds `spec` into a registered template. `emit` gets every step,
/// byte count and tool line as it happens.
pub fn build(
    spec: &BuildSpec,
    paths: &Paths,
    emit: &mut dyn FnMut(Event),
) -> Result<Built, BuildError> {
    let t0 = Instant::now();
    let first = if spec.dockerfile.is_some() {
        "build"
    } else {
        "fetch"
    };
    let fail = |m: String| BuildError::new(first, m);
    if !valid_name(&spec.name) {
        return Err(fail(format!(
            "template name {:?}: expected [a-z0-9][a-z0-9_-]{{0,31}}",
            spec.name
        )));
    }
    if paths
        .builtin_templates
        .join(format!("{}.json", spec.name))
        .exists()
    {
        return Err(fail(format!(
            "{} is a built-in template: choose another name",
            spec.name
        )));
    }
    let source = match (&spec.from, &spec.dockerfile) {
        (Some(f), None) => Some(Source::parse(f).map_err(fail)?),
        (None, Some(_)) => None,
        _ => return Err(fail("give exactly one of from and dockerfile".into())),
    };
    if let Some(p) = source.as_ref().and_then(Source::local_path) {
        if !p.exists() {
            return Err(fail(format!("{}: no such file or directory", p.display())));
        }
    }
    let steps = if source.is_some() {
        STEPS_IMAGE
    } else {
        STEPS_DOCKERFILE
    };
    let total = steps.len();
    let mut step_no = 0;
    let mut step = |emit: &mut dyn FnMut(Event), name: &str| {
        step_no += 1;
        emit(Event::Step {
            name: name.into(),
            index: step_no,
            total,
        });
    };

    let tdir = paths.templates_dir();
    let rootfs_dir = paths.cache_dir.join("rootfs");
    let work_root = paths.cache_dir.join("build");
    for d in [&tdir, &rootfs_dir, &work_root] {
        fs::create_dir_all(d).map_err(|e| fail(format!("create {}: {e}", d.display())))?;
    }
    let _lock = lock_name(&tdir, &spec.name)?;
    sweep_dead_builds(&work_root);
    let work = WorkDir(work_root.join(format!(
        "{}-{}-{}",
        spec.name,
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    )));
    let tmpdir = work.0.join("tmp");
    fs::create_dir_all(&tmpdir).map_err(|e| fail(format!("create {}: {e}", tmpdir.display())))?;
    let layout = work.0.join("layout");
    let layout_ref = format!("oci:{}:{TAG}", layout.display());
    let mut dockerfile_text = None;

    if let Some(src) = &source {
        step(emit, "fetch");
        let skopeo = tool("fetch", "skopeo", "skopeo")?;
        let mut cmd = Command::new(skopeo);
        cmd.env("TMPDIR", &tmpdir).arg("copy");
        if matches!(src, Source::Docker(_)) {
            cmd.args(["--override-os", "linux", "--override-arch", "amd64"]);
            if spec.insecure_registry {
                cmd.arg("--src-tls-verify=false");
            }
        }
        cmd.arg(src.skopeo_ref()).arg(&layout_ref);
        run_tool("fetch", &mut cmd, emit, &mut Tail::default())?;
    } else if let Some(df) = &spec.dockerfile {
        step(emit, "build");
        let text = fs::read_to_string(df)
            .map_err(|e| BuildError::new("build", format!("{}: {e}", df.display())))?;
        let context = spec
            .context
            .clone()
            .or_else(|| df.parent().map(Path::to_path_buf))
            .unwrap_or_else(|| PathBuf::from("."));
        let buildah = tool("build", "buildah", "buildah")?;
        let storage = work.0.join("storage");
        let store = |c: &mut Command| {
            c.env("TMPDIR", &tmpdir)
                .arg("--root")
                .arg(storage.join("root"))
                .arg("--runroot")
                .arg(storage.join("run"))
                .args(["--storage-driver", "vfs"]);
        };
        let mut cmd = Command::new(&buildah);
        store(&mut cmd);
        cmd.arg("build")
            .args(["--isolation", "oci", "--layers=false"])
            .arg(format!(
                "--network={}",
                match spec.network {
                    BuildNetwork::None => "none",
                    BuildNetwork::Host => "host",
                }
            ));
        // crun refuses hosts whose cgroups are hybrid (v1 controllers);
        // runc runs everywhere.
        if let Ok(runc) = tool("build", "runc", "runc") {
            cmd.arg("--runtime").arg(runc);
        }
        let iid = work.0.join("iid");
        cmd.arg("--iidfile")
            .arg(&iid)
            .arg("-f")
            .arg(df)
            .arg(&context);
        let mut tail = Tail::default();
        if let Err(mut e) = run_tool("build", &mut cmd, emit, &mut tail) {
            let st = dockerfile::stages(&text);
            if let Some(i) = dockerfile::failed_step(&st, &tail.lines()) {
                e.at = Some(format!(
                    "Dockerfile line {} ({})",
                    i.line,
                    short_text(&i.text)
                ));
            }
            return Err(e);
        }
        dockerfile_text = Some(text);
        step(emit, "fetch");
        let id = fs::read_to_string(&iid)
            .map_err(|e| BuildError::new("fetch", format!("buildah wrote no image id: {e}")))?;
        let mut cmd = Command::new(&buildah);
        store(&mut cmd);
        cmd.args(["push", "--quiet", id.trim()]).arg(&layout_ref);
        run_tool("fetch", &mut cmd, emit, &mut Tail::default())?;
    }

    step(emit, "verify");
    let img = oci::read_layout(&layout, Some(TAG)).map_err(|m| BuildError::new("verify", m))?;
    let layer_bytes = img.layer_bytes();
    if layer_bytes > paths.max_bytes {
        return Err(BuildError::new(
            "verify",
            format!(
                "its layers are {} MiB, more than the {} MiB a template may have",
                layer_bytes >> 20,
                paths.max_bytes >> 20
            ),
        ));
    }
    let mut done = 0u64;
    for l in &img.layers {
        oci::verify_layer(&layout, l, &mut |n| {
            done += n;
            if done % (8 << 20) < n {
                emit(Event::Bytes {
                    done,
                    total: layer_bytes,
                });
            }
        })
        .map_err(|m| BuildError::new("verify", m).at(img.layer_name(&l.digest)))?;
    }
    emit(Event::Bytes {
        done,
        total: layer_bytes,
    });

    let agent_sha = sha256_file(&paths.agent)
        .map_err(|e| BuildError::new("verify", format!("agent {}: {e}", paths.agent.display())))?;
    let key = format!(
        "{:x}",
        Sha256::digest(format!(
            "asbx-oci {BUILDER_VERSION}\n{}\n{agent_sha}\n",
            img.digest
        ))
    );
    let hash = &key[..16];
    let rootfs = rootfs_dir.join(format!("{}-{hash}.erofs", spec.name));
    let manifest = PathBuf::from(format!("{}.json", rootfs.display()));
    let cached = rootfs.exists() && manifest.exists();

    let tree = work.0.join("rootfs");
    let defaults;
    if cached {
        // Same image, same agent: the erofs is what we would build. Its
        // defaults are in its manifest.
        let m: serde_json::Value = fs::read(&manifest)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        defaults = serde_json::from_value::<DefaultsIn>(m["defaults"].clone())
            .map(DefaultsIn::into)
            .unwrap_or_default();
        for s in ["unpack", "agent", "erofs"] {
            step(emit, s);
            emit(Event::Log {
                line: format!("{s}: reusing {}", rootfs.display()),
            });
        }
    } else {
        step(emit, "unpack");
        let umoci = tool("unpack", "umoci", "umoci")?;
        let mut cmd = Command::new(umoci);
        cmd.env("TMPDIR", &tmpdir)
            .args(["raw", "unpack", "--image"])
            .arg(format!("{}:{TAG}", layout.display()))
            .arg(&tree);
        let mut tail = Tail::default();
        run_tool("unpack", &mut cmd, emit, &mut tail).map_err(|e| {
            let at = img
                .layer_in(&e.message)
                .or_else(|| tail.lines().iter().rev().find_map(|l| img.layer_in(l)));
            e.at(at)
        })?;
        let bytes = tree_bytes(&tree, paths.max_bytes)
            .map_err(|e| BuildError::new("unpack", e.to_string()))?;
        emit(Event::Log {
            line: format!("unpacked {} MiB", bytes >> 20),
        });

        step(emit, "agent");
        let root =
            inroot::Root::open(&tree).map_err(|e| BuildError::new("agent", e.to_string()))?;
        defaults = defaults_of(&root, &img.config).map_err(|m| BuildError::new("agent", m))?;
        drop(root);
        inject(&tree, &paths.agent, &spec.name, &defaults)
            .map_err(|m| BuildError::new("agent", m))?;

        step(emit, "erofs");
        let mkfs = tool("erofs", "mkfs.erofs", "erofs-utils")?;
        let tmp = rootfs_dir.join(format!(".{}-{hash}.erofs.tmp", spec.name));
        let guard = TmpFile(Some(tmp.clone()));
        let uuid = format!(
            "{}-{}-{}-{}-{}",
            &key[0..8],
            &key[8..12],
            &key[12..16],
            &key[16..20],
            &key[20..32]
        );
        let mut cmd = Command::new(mkfs);
        cmd.args(["-zlz4hc", "-T0", "--quiet"])
            .arg(format!("-U{uuid}"))
            .arg(&tmp)
            .arg(&tree);
        run_tool("erofs", &mut cmd, emit, &mut Tail::default())?;
        let size = fs::metadata(&tmp).map(|m| m.len()).unwrap_or(0);
        fs::rename(&tmp, &rootfs)
            .map_err(|e| BuildError::new("erofs", format!("install {}: {e}", rootfs.display())))?;
        guard.keep();
        let m = serde_json::json!({
            "kind": "rootfs",
            "template": spec.name,
            "path": rootfs,
            "hash": hash,
            "size": size,
            "source": source.as_ref().map(Source::skopeo_ref).unwrap_or_else(|| "dockerfile".into()),
            "digest": img.digest,
            "agent_sha256": agent_sha,
            "defaults": &defaults,
            "build_seconds": t0.elapsed().as_secs_f64(),
        });
        write_atomic(
            &manifest,
            &serde_json::to_vec_pretty(&m).unwrap_or_default(),
        )
        .map_err(|e| BuildError::new("erofs", e))?;
    }

    step(emit, "register");
    let labels = img.config.labels.clone().unwrap_or_default();
    let label = |k: &str| labels.get(k).filter(|v| !v.is_empty()).cloned();
    let tools = spec.tools.clone().or_else(|| {
        label("template.tools").map(|t| {
            t.split([',', ' '])
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
    });
    let from = match (&source, &spec.dockerfile) {
        (Some(s), _) => s.skopeo_ref(),
        (None, Some(df)) => format!("dockerfile:{}", df.display()),
        _ => String::new(),
    };
    let t = Template {
        name: spec.name.clone(),
        display_name: spec
            .display_name
            .clone()
            .or_else(|| label("template.displayName")),
        version: Some(oci::short(&img.digest)),
        description: spec
            .description
            .clone()
            .or_else(|| label("template.description"))
            .unwrap_or_else(|| format!("Built from {from}")),
        tools,
        extends: None,
        env: defaults.env.clone(),
        warm: Vec::new(),
        memory_mib: spec.memory_mib,
        vcpus: spec.vcpus,
        disk_mib: spec.disk_mib,
        workdir: defaults.workdir.clone(),
        uid: defaults.uid,
        gid: defaults.gid,
        rootfs: Some(rootfs.clone()),
        source: Some(TemplateSource {
            from,
            digest: img.digest.clone(),
            built_at: now_secs(),
            labels,
            dockerfile: dockerfile_text.map(|t| t.chars().take(64 * 1024).collect()),
        }),
    };
    let body =
        serde_json::to_vec_pretty(&t).map_err(|e| BuildError::new("register", e.to_string()))?;
    write_atomic(&tdir.join(format!("{}.json", spec.name)), &body)
        .map_err(|e| BuildError::new("register", e))?;
    let image_bytes = fs::metadata(&rootfs).map(|m| m.len()).unwrap_or(0);
    drop(work);
    let built = Built {
        template: spec.name.clone(),
        rootfs,
        digest: img.digest,
        image_bytes,
        cached,
        seconds: t0.elapsed().as_secs_f64(),
    };
    emit(Event::Ready(built.clone()));
    Ok(built)
}

#[derive(Deserialize, Default)]
struct DefaultsIn {
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    workdir: Option<String>,
    #[serde(default)]
    uid: Option<u32>,
    #[serde(default)]
    gid: Option<u32>,
}

impl From<DefaultsIn> for Defaults {
    fn from(d: DefaultsIn) -> Self {
        Defaults {
            env: d.env,
            workdir: d.workdir,
            uid: d.uid,
            gid: d.gid,
        }
    }
}

fn short_text(s: &str) -> String {
    let mut t: String = s.chars().take(60).collect();
    if t.len() < s.len() {
        t.push_str("...");
    }
    t
}

/// Writes `path` through a temporary file and a rename: complete or absent.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), String> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    fs::write(&tmp, data).map_err(|e| format!("write {}: {e}", tmp.display()))?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        format!("install {}: {e}", path.display())
    })
}

/// Removes a template built from an image: its file first (so it is gone
/// at once), then its erofs and manifest. Snapshots are the caller's.
pub fn remove(cache: &Path, name: &str) -> Result<bool, String> {
    if !valid_name(name) {
        return Err(format!("template name {name:?} is not valid"));
    }
    let file = custom_templates_dir(cache).join(format!("{name}.json"));
    let t: Template = match fs::read(&file) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", file.display()))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    fs::remove_file(&file).map_err(|e| format!("remove {}: {e}", file.display()))?;
    if let Some(r) = t.rootfs {
        // Only files of the cache's rootfs directory, by the name we gave.
        let ok = r.parent() == Some(&cache.join("rootfs"))
            && r.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{name}-")) && n.ends_with(".erofs"));
        if ok {
            let _ = fs::remove_file(&r);
            let _ = fs::remove_file(format!("{}.json", r.display()));
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sources() {
        assert_eq!(
            Source::parse("oci:/x/y:v1").unwrap(),
            Source::Oci {
                dir: "/x/y".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            Source::parse("oci:/x/y").unwrap(),
            Source::Oci {
                dir: "/x/y".into(),
                tag: None
            }
        );
        assert_eq!(
            Source::parse("oci-archive:/a.tar").unwrap(),
            Source::OciArchive("/a.tar".into())
        );
        assert_eq!(
            Source::parse("docker://alpine:3.20").unwrap(),
            Source::Docker("alpine:3.20".into())
        );
        assert!(Source::parse("alpine").is_err());
        assert!(Source::parse("oci-archive:").is_err());
        assert!(Source::parse("docker://a b").is_err());
    }

    #[test]
    fn resolves_users_from_the_image() {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir_all(t.path().join("etc")).unwrap();
        fs::write(
            t.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:app:/home/app:/bin/sh\n",
        )
        .unwrap();
        fs::write(t.path().join("etc/group"), "root:x:0:\nstaff:x:50:\n").unwrap();
        let r = inroot::Root::open(t.path()).unwrap();
        assert_eq!(
            resolve_user(&r, "app").unwrap(),
            (1000, 1001, Some("/home/app".into()))
        );
        assert_eq!(resolve_user(&r, "app:staff").unwrap().1, 50);
        assert_eq!(resolve_user(&r, "42:7").unwrap(), (42, 7, None));
        assert!(resolve_user(&r, "nobody").unwrap_err().contains("passwd"));
        assert!(resolve_user(&r, "app:nogroup")
            .unwrap_err()
            .contains("group"));
    }
}
