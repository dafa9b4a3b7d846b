//! Daemon configuration: every tunable of `serve`, with defaults that suit a
//! single host. The CLI (`main.rs`) fills it from a JSON config file
//! ([`FileConfig`]) and flags; tests build it directly.

pub mod guest_ca;
pub mod seed_env;

use crate::net::{EgressPolicy, NetConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What `backend` names (see `crate::sandbox::build_factory`); here for
/// the front ends, which reach the backend kinds through their config.
pub use crate::vm::BackendKind;

/// Failed authentications one client address may make in a burst (the
/// default of `auth_fail_burst`), and how many per second it earns back.
pub const AUTH_FAIL_BURST: f64 = 20.0;
pub const AUTH_FAIL_RATE: f64 = 2.0;

/// A token prefix an operator may choose: 1-32 of `A-Za-z0-9_-`.
pub fn validate_key_prefix(p: &str) -> Result<(), String> {
    if p.is_empty()
        || p.len() > 32
        || !p
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "key prefix {p:?}: 1 to 32 of A-Z, a-z, 0-9, '_' and '-'"
        ));
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// Holds the key file and per-sandbox runtime directories.
    pub state_dir: PathBuf,
    pub key_file: PathBuf,
    /// `false` only with `--no-auth`, which is refused unless `listen` is a
    /// loopback address.
    pub auth: bool,
    pub idle_timeout: Duration,
    /// Hard cap on a session's age, whatever its activity.
    pub max_lifetime: Duration,
    pub max_sessions: usize,
    /// Warm sandboxes kept ready per template.
    pub pool_size: usize,
    /// VMMs kept started ahead of restores, one per recently used shape
    /// (`sandbox::standby`); 0 turns them off.
    pub standby_vmms: usize,
    pub default_template: String,
    /// Open client connections in all (a thread each); 503 beyond.
    pub max_connections: usize,
    /// Open connections from one client address; 503 beyond.
    pub max_connections_per_ip: usize,
    /// Streaming responses in flight at once; each holds one thread.
    pub max_streams: usize,
    /// Largest JSON request body.
    pub max_body: usize,
    /// Largest raw file upload / download.
    pub max_file: usize,
    /// Output kept for a buffered (non-streaming) exec answer.
    pub max_output: usize,
    /// Bytes of guest data (file contents, listings, their JSON) all
    /// replies in flight may hold together (`budget::ReplyBudget`).
    pub max_reply_memory: usize,
    pub default_exec_timeout: Duration,
    pub max_exec_timeout: Duration,
    /// Socket write timeout: a client that stops reading is dropped.
    pub write_timeout: Duration,
    /// How long an API thread waits for a session to start.
    pub create_timeout: Duration,
    /// Per-key token bucket: sustained requests per second and burst.
    pub rate_per_sec: f64,
    pub rate_burst: f64,
    /// Failed authentications one client address may make in a burst
    /// before it gets 429 `auth_throttled` (refilled at
    /// [`crate::api::auth::AUTH_FAIL_RATE`] per second).
    pub auth_fail_burst: f64,
    pub reap_interval: Duration,
    pub default_vcpus: u32,
    pub default_mem_mib: u32,
    pub default_disk_mib: u32,
    /// Largest session shape a request may ask for (`session::limits`;
    /// vCPUs and memory are also bounded by the host's).
    pub max_vcpus: u32,
    pub max_mem_mib: u32,
    pub max_disk_mib: u32,
    /// What one API key may hold at once: live sessions, and their vCPUs
    /// and memory summed.
    pub max_sessions_per_key: usize,
    /// What an idle session's timeout does by default (file key `on_idle`,
    /// `"destroy"` or `"pause"`): true for pause (issue #21).
    pub idle_pause: bool,
    /// How long a paused session is kept by default.
    pub paused_ttl: Duration,
    /// Paused sessions one key may hold.
    pub max_paused_per_key: usize,
    /// Checkpoints one key may hold, and the bytes they may take on disk.
    pub max_snapshots_per_key: usize,
    pub max_snapshot_bytes_per_key: u64,
    pub max_vcpus_per_key: u32,
    pub max_mem_mib_per_key: u32,
    /// `Origin` values the MCP endpoint accepts (browsers); empty = none.
    pub mcp_allowed_origins: Vec<String>,
    /// Per-session networking (namespace, veth, TAP, NAT, egress policy);
    /// `None`: sessions have no network (their NIC leads nowhere).
    pub network: Option<NetConfig>,
    /// Name prefix of the namespaces made while networking is off (the
    /// isolated NICs); with networking on, `network.prefix` rules.
    pub net_prefix: Option<String>,
    /// Sandbox backend: `qemu`, `firecracker`, or `local-process`
    /// (development only: no isolation). Kept as given (file, flag, env)
    /// so `validate` reports a bad name with its key; [`Config::backend_kind`]
    /// parses it.
    pub backend: String,
    /// Guest agent binary for the local-process backend.
    pub agent_bin: Option<PathBuf>,
    /// Serve MCP over Streamable HTTP at `/mcp` on the REST listener.
    pub mcp_http: bool,
    /// Egress policy of a session that asks for none.
    pub default_egress: EgressPolicy,
    /// Guest images and VMM binaries.
    pub artifacts: Artifacts,
    /// uids/gids VMMs run as: one per session (see `vm::ids`).
    pub vm_ids: crate::vm::ids::IdRange,
    /// `io.max` rule (`rbps=... wbps=... riops=... wiops=...`) of each VM's
    /// cgroup on the disks of the state and image directories.
    pub vm_io_max: Option<String>,
    /// The VMM's memory beyond guest RAM in each VM's memory limit
    /// (`None`: the backend's default, `cgroup::MEMORY_OVERHEAD_MIB` for
    /// QEMU).
    pub vm_memory_overhead_mib: Option<u64>,
    /// Start VMMs even where no cgroup hierarchy offers the controllers of
    /// their limits (memory, cpu, pids, io with `vm_io_max`): they then run
    /// without those limits. Off: `serve` refuses to start.
    pub allow_unlimited_vmms: bool,
    /// Where VMs' cgroups go: below the daemon's own cgroup (`own`, what a
    /// systemd unit with `Delegate=yes` gets under `auto`) or below
    /// `agent-sandbox/d-<hash>` (`standalone`).
    pub cgroup_placement: crate::vm::cgroup::Placement,
    /// A fixed `cpu.max` for every VM (`None`: one CPU per vCPU).
    pub vm_cpu_max: Option<crate::vm::cgroup::CpuMax>,
    /// Each VMM's RLIMIT_NOFILE (`None`: `vm::launch::DEFAULT_NOFILE`).
    pub vm_nofile_limit: Option<u64>,
    /// The Firecracker jailer's chroot base (`None`: `<state dir>/jail`);
    /// on the state dir's filesystem, since snapshot files are hard-linked
    /// into jails.
    pub jail_dir: Option<PathBuf>,
    /// What new API keys' tokens start with (`asbx_`; the seed's
    /// `AUTH_KEY_PREFIX`); keys made under another prefix keep working.
    pub key_prefix: String,
    /// PEM file of extra CAs every guest trusts (`guest_ca::HOST`, `host`:
    /// the host's own bundle); `None`: guests keep their image's store.
    pub guest_ca_bundle: Option<PathBuf>,
    /// Where the preview listener (guest ports, issue #26) listens; `None`:
    /// no preview URLs.
    pub preview_listen: Option<SocketAddr>,
    /// Wildcard domain of host-based preview URLs (`<token>.<domain>`);
    /// `None`: only path-based ones (`/ports/<token>/`).
    pub preview_domain: Option<String>,
    /// How clients reach the preview listener (`https://preview.example`
    /// behind a TLS proxy); `None`: `http://<preview_listen>`.
    pub preview_url: Option<String>,
    /// The audit log (`audit::Settings`; on by default, files under
    /// `<state dir>/audit`).
    pub audit: crate::audit::Settings,
    /// This host's name among several behind a router (issue #28,
    /// docs/operations.md "Several hosts"): ids this daemon makes carry it
    /// (`s-<host>-...`) so the router sends their requests here; `None`:
    /// one host, ids without a tag.
    pub host_id: Option<String>,
}

/// What the VM backends run: guest kernel and images, the template
/// definitions, VMM binaries. `None` falls back to the environment
/// (`AGENT_SANDBOX_TEMPLATES`, `_CACHE`, `_SNAPSHOT_STATE`, `_FIRECRACKER`,
/// `_JAILER`), then to built-in defaults (see `sandbox::wiring`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Artifacts {
    /// Guest kernel (uncompressed `vmlinux`); default: the newest in the cache.
    pub kernel: Option<PathBuf>,
    /// Root filesystem per template; a template not named here uses the
    /// newest image of the cache.
    pub images: BTreeMap<String, PathBuf>,
    /// Template definitions (`images/templates`).
    pub templates_dir: Option<PathBuf>,
    /// Image cache `agent-sandbox image build` writes.
    pub cache_dir: Option<PathBuf>,
    /// Snapshots go to `<snapshot_dir>/snapshots/<backend>/<template>`.
    pub snapshot_dir: Option<PathBuf>,
    /// QEMU binary (a bare name is looked up in PATH).
    pub qemu: Option<PathBuf>,
    pub firecracker: Option<PathBuf>,
    pub jailer: Option<PathBuf>,
}

impl Artifacts {
    /// Fills what is unset from the environment variables that predate the
    /// config file, so an effective config shows what the daemon will use.
    pub fn fill_from_env(&mut self) {
        let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
        self.templates_dir = self
            .templates_dir
            .take()
            .or_else(|| env("AGENT_SANDBOX_TEMPLATES"));
        self.cache_dir = self.cache_dir.take().or_else(|| env("AGENT_SANDBOX_CACHE"));
        self.snapshot_dir = self
            .snapshot_dir
            .take()
            .or_else(|| env("AGENT_SANDBOX_SNAPSHOT_STATE"));
        self.firecracker = self
            .firecracker
            .take()
            .or_else(|| env("AGENT_SANDBOX_FIRECRACKER"));
        self.jailer = self.jailer.take().or_else(|| env("AGENT_SANDBOX_JAILER"));
    }
}

impl Default for Config {
    fn default() -> Self {
        let state_dir = default_state_dir();
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            key_file: state_dir.join("keys.json"),
            state_dir,
            auth: true,
            idle_timeout: Duration::from_secs(30 * 60),
            max_lifetime: Duration::from_secs(24 * 3600),
            max_sessions: 64,
            pool_size: 0,
            standby_vmms: 2,
            default_template: "default".into(),
            max_connections: 1024,
            max_connections_per_ip: 64,
            max_streams: 256,
            max_body: 1 << 20,
            max_file: 64 << 20,
            max_output: 16 << 20,
            max_reply_memory: 512 << 20,
            default_exec_timeout: Duration::from_secs(600),
            max_exec_timeout: Duration::from_secs(24 * 3600),
            write_timeout: Duration::from_secs(60),
            create_timeout: Duration::from_secs(60),
            rate_per_sec: 50.0,
            rate_burst: 100.0,
            auth_fail_burst: AUTH_FAIL_BURST,
            reap_interval: Duration::from_secs(5),
            default_vcpus: 1,
            default_mem_mib: 256,
            default_disk_mib: 1024,
            max_vcpus: 8,
            max_mem_mib: 8192,
            max_disk_mib: 65536,
            max_sessions_per_key: 16,
            idle_pause: false,
            paused_ttl: Duration::from_secs(7 * 24 * 3600),
            max_paused_per_key: 16,
            max_snapshots_per_key: 32,
            max_snapshot_bytes_per_key: 64 << 30,
            max_vcpus_per_key: 32,
            max_mem_mib_per_key: 16384,
            mcp_allowed_origins: Vec::new(),
            network: None,
            net_prefix: None,
            backend: "qemu".into(),
            agent_bin: None,
            mcp_http: true,
            default_egress: EgressPolicy::default(),
            artifacts: Artifacts::default(),
            vm_ids: crate::vm::ids::IdRange::default(),
            vm_io_max: None,
            vm_memory_overhead_mib: None,
            allow_unlimited_vmms: false,
            cgroup_placement: crate::vm::cgroup::Placement::Auto,
            vm_cpu_max: None,
            vm_nofile_limit: None,
            jail_dir: None,
            key_prefix: "asbx_".into(),
            guest_ca_bundle: None,
            preview_listen: None,
            preview_domain: None,
            preview_url: None,
            audit: crate::audit::Settings::default(),
            host_id: None,
        }
    }
}

impl Config {
    /// Largest JSON reply built from guest data (a file read, a listing):
    /// room for a `max_file` file in base64 plus the fields around it. A
    /// file whose text would escape to more (control bytes take six bytes
    /// each) is refused with 413 and read as base64 or raw bytes instead.
    pub fn max_json_reply(&self) -> usize {
        self.max_file
            .div_ceil(3)
            .saturating_mul(4)
            .saturating_add(64 << 10)
    }

    /// `backend` parsed; the error names the key.
    pub fn backend_kind(&self) -> Result<BackendKind, String> {
        self.backend.parse().map_err(|_| {
            format!(
                "backend {:?}: one of {}",
                self.backend,
                BackendKind::names()
            )
        })
    }

    /// The checked `guest_ca_bundle`, read from disk (`None` when unset).
    pub fn guest_cas(&self) -> Result<Option<guest_ca::GuestCas>, String> {
        self.guest_ca_bundle
            .as_deref()
            .map(guest_ca::load)
            .transpose()
    }

    /// Checks what the types cannot: ranges, combinations, the network
    /// section. Messages name the config key.
    pub fn validate(&self) -> Result<(), String> {
        self.backend_kind()?;
        self.audit.validate()?;
        if !self.auth && !self.listen.ip().is_loopback() {
            return Err(format!(
                "auth: false (--no-auth) is only allowed on a loopback address, not {}",
                self.listen
            ));
        }
        if !(self.rate_per_sec > 0.0 && self.rate_per_sec.is_finite()) {
            return Err(format!("rate_limit {}: must be > 0", self.rate_per_sec));
        }
        if !(self.rate_burst >= 1.0 && self.rate_burst.is_finite()) {
            return Err(format!("rate_burst {}: must be >= 1", self.rate_burst));
        }
        if !(self.auth_fail_burst >= 1.0 && self.auth_fail_burst.is_finite()) {
            return Err(format!(
                "auth_fail_burst {}: must be >= 1",
                self.auth_fail_burst
            ));
        }
        for (key, v) in [
            ("max_sessions", self.max_sessions),
            ("max_sessions_per_key", self.max_sessions_per_key),
            ("max_paused_per_key", self.max_paused_per_key),
            ("max_snapshots_per_key", self.max_snapshots_per_key),
            ("max_connections", self.max_connections),
            ("max_connections_per_ip", self.max_connections_per_ip),
            ("max_streams", self.max_streams),
            ("max_body", self.max_body),
            ("max_file", self.max_file),
            ("max_output", self.max_output),
            ("max_reply_memory", self.max_reply_memory),
        ] {
            if v == 0 {
                return Err(format!("{key}: must be at least 1"));
            }
        }
        for (key, d) in [
            ("idle_timeout_secs", self.idle_timeout),
            ("max_lifetime_secs", self.max_lifetime),
            ("exec_timeout_secs", self.default_exec_timeout),
            ("max_exec_timeout_secs", self.max_exec_timeout),
            ("write_timeout_secs", self.write_timeout),
            ("create_timeout_secs", self.create_timeout),
            ("reap_interval_secs", self.reap_interval),
            ("paused_ttl_secs", self.paused_ttl),
        ] {
            if d.is_zero() {
                return Err(format!("{key}: must be at least 1 second"));
            }
        }
        // The largest read a client may ask for must fit: the file itself
        // and its base64 JSON reply.
        let one_read = self.max_file.saturating_add(self.max_json_reply());
        if self.max_reply_memory < one_read {
            return Err(format!(
                "max_reply_memory {}: must hold one max_file read and its JSON reply \
                 ({one_read} bytes with max_file {})",
                self.max_reply_memory, self.max_file
            ));
        }
        if self.default_exec_timeout > self.max_exec_timeout {
            return Err(format!(
                "exec_timeout_secs {} exceeds max_exec_timeout_secs {}",
                self.default_exec_timeout.as_secs(),
                self.max_exec_timeout.as_secs()
            ));
        }
        use crate::vm::shape::{DISK_MIB, MEM_MIB, VCPUS};
        // The same bounds the REST API puts on a session's request.
        for (key, v, range) in [
            ("default_vcpus", self.default_vcpus, &VCPUS),
            ("default_mem_mib", self.default_mem_mib, &MEM_MIB),
            ("default_disk_mib", self.default_disk_mib, &DISK_MIB),
            ("max_vcpus", self.max_vcpus, &VCPUS),
            ("max_mem_mib", self.max_mem_mib, &MEM_MIB),
            ("max_disk_mib", self.max_disk_mib, &DISK_MIB),
        ] {
            if !range.contains(&v) {
                return Err(format!("{key} {v}: {}..={}", range.start(), range.end()));
            }
        }
        for (key, default, max, max_key) in [
            (
                "default_vcpus",
                self.default_vcpus,
                self.max_vcpus,
                "max_vcpus",
            ),
            (
                "default_mem_mib",
                self.default_mem_mib,
                self.max_mem_mib,
                "max_mem_mib",
            ),
            (
                "default_disk_mib",
                self.default_disk_mib,
                self.max_disk_mib,
                "max_disk_mib",
            ),
            (
                "default_vcpus",
                self.default_vcpus,
                self.max_vcpus_per_key,
                "max_vcpus_per_key",
            ),
            (
                "default_mem_mib",
                self.default_mem_mib,
                self.max_mem_mib_per_key,
                "max_mem_mib_per_key",
            ),
        ] {
            if default > max {
                return Err(format!("{key} {default} exceeds {max_key} {max}"));
            }
        }
        if self.default_template.is_empty() {
            return Err("default_template: must not be empty".into());
        }
        self.default_egress
            .validate(self.network.as_ref())
            .map_err(|e| format!("egress: {e}"))?;
        for name in self.artifacts.images.keys() {
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(format!("images: {name:?} is not a template name"));
            }
        }
        if let Some(n) = &self.network {
            n.validate().map_err(|e| format!("network: {e}"))?;
        }
        self.vm_ids.validate()?;
        if let Some(r) = &self.vm_io_max {
            crate::vm::cgroup::validate_io_rule(r).map_err(|e| format!("vm_io_max: {e}"))?;
        }
        validate_key_prefix(&self.key_prefix).map_err(|e| format!("key_prefix: {e}"))?;
        if let Some(c) = &self.vm_cpu_max {
            c.validate().map_err(|e| format!("vm_cpu_max: {e}"))?;
        }
        if let Some(n) = self.vm_nofile_limit {
            // Below 64 QEMU cannot open its disks, TAP and eventfds.
            if !(64..=1 << 20).contains(&n) {
                return Err(format!("vm_nofile_limit {n}: between 64 and 1048576"));
            }
        }
        if let Some(d) = &self.preview_domain {
            let ok = d.len() <= 200
                && d.split('.').count() >= 2
                && d.split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                });
            if !ok {
                return Err(format!(
                    "preview_domain {d:?}: a lower-case DNS name like preview.example.com \
                     (its wildcard *.{d} must point at preview_listen)"
                ));
            }
        }
        if let Some(h) = &self.host_id {
            if !crate::router::valid_host_id(h) {
                return Err(format!(
                    "host_id {h:?}: 1-{} lower-case letters and digits, starting with a letter",
                    crate::router::MAX_HOST_ID
                ));
            }
        }
        if let Some(u) = &self.preview_url {
            if !(u.starts_with("http://") || u.starts_with("https://")) || u.len() > 200 {
                return Err(format!(
                    "preview_url {u:?}: http:// or https:// and a host, like https://preview.example.com"
                ));
            }
        }
        if let Some(a) = self.preview_listen {
            if !self.auth && !a.ip().is_loopback() {
                return Err(format!(
                    "preview_listen {a}: without authentication only a loopback address"
                ));
            }
        } else if self.preview_domain.is_some() || self.preview_url.is_some() {
            return Err("preview_domain and preview_url need preview_listen".into());
        }
        // Read now, so a bad path fails `--check` and the start, not the
        // first session.
        self.guest_cas()?;
        if self.guest_ca_bundle.is_some() && self.backend_kind() == Ok(BackendKind::LocalProcess) {
            // Its "guest" is an agent process on this host: the install
            // would edit the host's own trust store.
            return Err(
                "guest_ca_bundle: not with backend local-process (its agent runs on this host, \
                 whose trust store it would edit)"
                    .into(),
            );
        }
        if (self.vm_ids.sessions() as usize) < self.max_sessions {
            return Err(format!(
                "vm_ids.count {}: fewer session ids than max_sessions {} (one id is the \
                 snapshot builder's)",
                self.vm_ids.count, self.max_sessions
            ));
        }
        Ok(())
    }
}

/// The JSON config file of `serve --config FILE`: every key optional
/// (absent = the default, or the flag), unknown keys rejected. The NixOS
/// module writes it with `builtins.toJSON` (`nixos-module/cli.nix`);
/// `agent-sandbox config check FILE` prints the effective one in this
/// same shape. Reference: docs/operations.md, "Config file".
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub backend: Option<String>,
    pub agent_bin: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub keys_file: Option<PathBuf>,
    pub auth: Option<bool>,
    pub max_sessions: Option<usize>,
    pub pool_size: Option<usize>,
    pub standby_vmms: Option<usize>,
    pub default_template: Option<String>,
    pub idle_timeout_secs: Option<u64>,
    pub max_lifetime_secs: Option<u64>,
    pub exec_timeout_secs: Option<u64>,
    pub max_exec_timeout_secs: Option<u64>,
    pub create_timeout_secs: Option<u64>,
    pub write_timeout_secs: Option<u64>,
    pub reap_interval_secs: Option<u64>,
    pub max_connections: Option<usize>,
    pub max_connections_per_ip: Option<usize>,
    pub max_streams: Option<usize>,
    pub max_body: Option<usize>,
    pub max_file: Option<usize>,
    pub max_output: Option<usize>,
    pub max_reply_memory: Option<usize>,
    pub rate_limit: Option<f64>,
    pub rate_burst: Option<f64>,
    pub auth_fail_burst: Option<f64>,
    pub default_vcpus: Option<u32>,
    pub default_mem_mib: Option<u32>,
    pub default_disk_mib: Option<u32>,
    pub max_vcpus: Option<u32>,
    pub max_mem_mib: Option<u32>,
    pub max_disk_mib: Option<u32>,
    pub max_sessions_per_key: Option<usize>,
    pub on_idle: Option<String>,
    pub paused_ttl_secs: Option<u64>,
    pub max_paused_per_key: Option<usize>,
    pub max_snapshots_per_key: Option<usize>,
    pub max_snapshot_bytes_per_key: Option<u64>,
    pub max_vcpus_per_key: Option<u32>,
    pub max_mem_mib_per_key: Option<u32>,
    pub mcp_http: Option<bool>,
    pub mcp_allowed_origins: Option<Vec<String>>,
    pub egress: Option<EgressPolicy>,
    pub network: Option<NetConfig>,
    pub kernel: Option<PathBuf>,
    pub images: Option<BTreeMap<String, PathBuf>>,
    pub templates_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    pub snapshot_dir: Option<PathBuf>,
    pub qemu: Option<PathBuf>,
    pub firecracker: Option<PathBuf>,
    pub jailer: Option<PathBuf>,
    pub vm_ids: Option<crate::vm::ids::IdRange>,
    pub vm_io_max: Option<String>,
    pub vm_memory_overhead_mib: Option<u64>,
    pub allow_unlimited_vmms: Option<bool>,
    pub cgroup_placement: Option<crate::vm::cgroup::Placement>,
    pub vm_cpu_max: Option<crate::vm::cgroup::CpuMax>,
    pub vm_nofile_limit: Option<u64>,
    pub jail_dir: Option<PathBuf>,
    pub key_prefix: Option<String>,
    pub guest_ca_bundle: Option<PathBuf>,
    pub preview_listen: Option<SocketAddr>,
    pub preview_domain: Option<String>,
    pub preview_url: Option<String>,
    pub audit: Option<crate::audit::Settings>,
    pub host_id: Option<String>,
}

fn secs(d: Duration) -> Option<u64> {
    Some(d.as_secs())
}

impl FileConfig {
    /// Reads and parses `path`; errors name the file and the key.
    pub fn load(path: &Path) -> Result<FileConfig, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("config {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("config {}: {e}", path.display()))
    }

    /// Parses JSON text; an error names the key path (`network.prefix`)
    /// and the line.
    pub fn parse(text: &str) -> Result<FileConfig, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let fc: FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            }
        })?;
        fc.check_paths()?;
        Ok(fc)
    }

    /// A config file is read by a daemon whose working directory is
    /// whatever its service manager chose: relative paths would be a trap.
    /// `qemu` may be a bare command name (looked up in PATH).
    fn check_paths(&self) -> Result<(), String> {
        if let Some(o) = &self.on_idle {
            if o != "destroy" && o != "pause" {
                return Err(format!("on_idle {o:?}: must be \"destroy\" or \"pause\""));
            }
        }
        let mut paths: Vec<(String, &PathBuf)> = [
            ("agent_bin", &self.agent_bin),
            ("state_dir", &self.state_dir),
            ("keys_file", &self.keys_file),
            ("kernel", &self.kernel),
            ("templates_dir", &self.templates_dir),
            ("cache_dir", &self.cache_dir),
            ("snapshot_dir", &self.snapshot_dir),
            ("firecracker", &self.firecracker),
            ("jailer", &self.jailer),
            ("jail_dir", &self.jail_dir),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|p| (k.to_string(), p)))
        .collect();
        if let Some(p) = &self.guest_ca_bundle {
            if p != Path::new(guest_ca::HOST) {
                paths.push(("guest_ca_bundle".into(), p));
            }
        }
        for (t, p) in self.images.iter().flatten() {
            paths.push((format!("images.{t}"), p));
        }
        if let Some(q) = &self.qemu {
            if q.components().count() > 1 {
                paths.push(("qemu".into(), q));
            }
        }
        for (k, p) in paths {
            if !p.is_absolute() {
                return Err(format!("{k}: {} is not an absolute path", p.display()));
            }
        }
        Ok(())
    }

    /// Sets every key present in the file on `c`. `keys_file` absent keeps
    /// the key file beside the (possibly new) state dir.
    pub fn apply(self, c: &mut Config) {
        macro_rules! set {
            ($($key:ident => $field:expr),* $(,)?) => {
                $(if let Some(v) = self.$key { $field = v; })*
            };
        }
        macro_rules! set_secs {
            ($($key:ident => $field:expr),* $(,)?) => {
                $(if let Some(v) = self.$key { $field = Duration::from_secs(v); })*
            };
        }
        if let Some(d) = self.state_dir {
            c.key_file = d.join("keys.json");
            c.state_dir = d;
        }
        set!(
            listen => c.listen,
            backend => c.backend,
            keys_file => c.key_file,
            auth => c.auth,
            max_sessions => c.max_sessions,
            pool_size => c.pool_size,
            standby_vmms => c.standby_vmms,
            default_template => c.default_template,
            max_connections => c.max_connections,
            max_connections_per_ip => c.max_connections_per_ip,
            max_streams => c.max_streams,
            max_body => c.max_body,
            max_file => c.max_file,
            max_output => c.max_output,
            max_reply_memory => c.max_reply_memory,
            rate_limit => c.rate_per_sec,
            rate_burst => c.rate_burst,
            auth_fail_burst => c.auth_fail_burst,
            default_vcpus => c.default_vcpus,
            default_mem_mib => c.default_mem_mib,
            default_disk_mib => c.default_disk_mib,
            max_vcpus => c.max_vcpus,
            max_mem_mib => c.max_mem_mib,
            max_disk_mib => c.max_disk_mib,
            max_sessions_per_key => c.max_sessions_per_key,
            max_paused_per_key => c.max_paused_per_key,
            max_snapshots_per_key => c.max_snapshots_per_key,
            max_snapshot_bytes_per_key => c.max_snapshot_bytes_per_key,
            max_vcpus_per_key => c.max_vcpus_per_key,
            max_mem_mib_per_key => c.max_mem_mib_per_key,
            mcp_http => c.mcp_http,
            mcp_allowed_origins => c.mcp_allowed_origins,
            egress => c.default_egress,
            images => c.artifacts.images,
            vm_ids => c.vm_ids,
            allow_unlimited_vmms => c.allow_unlimited_vmms,
            cgroup_placement => c.cgroup_placement,
            key_prefix => c.key_prefix,
            audit => c.audit,
        );
        set_secs!(
            idle_timeout_secs => c.idle_timeout,
            max_lifetime_secs => c.max_lifetime,
            exec_timeout_secs => c.default_exec_timeout,
            max_exec_timeout_secs => c.max_exec_timeout,
            create_timeout_secs => c.create_timeout,
            write_timeout_secs => c.write_timeout,
            reap_interval_secs => c.reap_interval,
            paused_ttl_secs => c.paused_ttl,
        );
        if let Some(o) = &self.on_idle {
            c.idle_pause = o == "pause";
        }
        // Optional in Config too: set only when the file names them.
        macro_rules! set_opt {
            ($($key:ident => $field:expr),* $(,)?) => {
                $(if self.$key.is_some() { $field = self.$key; })*
            };
        }
        set_opt!(
            agent_bin => c.agent_bin,
            network => c.network,
            kernel => c.artifacts.kernel,
            templates_dir => c.artifacts.templates_dir,
            cache_dir => c.artifacts.cache_dir,
            snapshot_dir => c.artifacts.snapshot_dir,
            qemu => c.artifacts.qemu,
            firecracker => c.artifacts.firecracker,
            jailer => c.artifacts.jailer,
            vm_io_max => c.vm_io_max,
            vm_memory_overhead_mib => c.vm_memory_overhead_mib,
            vm_cpu_max => c.vm_cpu_max,
            vm_nofile_limit => c.vm_nofile_limit,
            jail_dir => c.jail_dir,
            guest_ca_bundle => c.guest_ca_bundle,
            preview_listen => c.preview_listen,
            preview_domain => c.preview_domain,
            preview_url => c.preview_url,
            host_id => c.host_id,
        );
    }

    /// `c` in file form: what `config check` prints. Unset optional keys
    /// come out as `null`; the output is itself a valid config file.
    pub fn from_config(c: &Config) -> FileConfig {
        let a = &c.artifacts;
        FileConfig {
            listen: Some(c.listen),
            backend: Some(c.backend.clone()),
            agent_bin: c.agent_bin.clone(),
            state_dir: Some(c.state_dir.clone()),
            keys_file: Some(c.key_file.clone()),
            auth: Some(c.auth),
            max_sessions: Some(c.max_sessions),
            pool_size: Some(c.pool_size),
            standby_vmms: Some(c.standby_vmms),
            default_template: Some(c.default_template.clone()),
            idle_timeout_secs: secs(c.idle_timeout),
            max_lifetime_secs: secs(c.max_lifetime),
            exec_timeout_secs: secs(c.default_exec_timeout),
            max_exec_timeout_secs: secs(c.max_exec_timeout),
            create_timeout_secs: secs(c.create_timeout),
            write_timeout_secs: secs(c.write_timeout),
            reap_interval_secs: secs(c.reap_interval),
            max_connections: Some(c.max_connections),
            max_connections_per_ip: Some(c.max_connections_per_ip),
            max_streams: Some(c.max_streams),
            max_body: Some(c.max_body),
            max_file: Some(c.max_file),
            max_output: Some(c.max_output),
            max_reply_memory: Some(c.max_reply_memory),
            rate_limit: Some(c.rate_per_sec),
            rate_burst: Some(c.rate_burst),
            auth_fail_burst: Some(c.auth_fail_burst),
            default_vcpus: Some(c.default_vcpus),
            default_mem_mib: Some(c.default_mem_mib),
            default_disk_mib: Some(c.default_disk_mib),
            max_vcpus: Some(c.max_vcpus),
            max_mem_mib: Some(c.max_mem_mib),
            max_disk_mib: Some(c.max_disk_mib),
            max_sessions_per_key: Some(c.max_sessions_per_key),
            on_idle: Some(if c.idle_pause { "pause" } else { "destroy" }.into()),
            paused_ttl_secs: secs(c.paused_ttl),
            max_paused_per_key: Some(c.max_paused_per_key),
            max_snapshots_per_key: Some(c.max_snapshots_per_key),
            max_snapshot_bytes_per_key: Some(c.max_snapshot_bytes_per_key),
            max_vcpus_per_key: Some(c.max_vcpus_per_key),
            max_mem_mib_per_key: Some(c.max_mem_mib_per_key),
            mcp_http: Some(c.mcp_http),
            mcp_allowed_origins: Some(c.mcp_allowed_origins.clone()),
            egress: Some(c.default_egress.clone()),
            network: c.network.clone(),
            kernel: a.kernel.clone(),
            images: Some(a.images.clone()),
            templates_dir: a.templates_dir.clone(),
            cache_dir: a.cache_dir.clone(),
            snapshot_dir: a.snapshot_dir.clone(),
            qemu: a.qemu.clone(),
            firecracker: a.firecracker.clone(),
            jailer: a.jailer.clone(),
            vm_ids: Some(c.vm_ids),
            vm_io_max: c.vm_io_max.clone(),
            vm_memory_overhead_mib: c.vm_memory_overhead_mib,
            allow_unlimited_vmms: Some(c.allow_unlimited_vmms),
            cgroup_placement: Some(c.cgroup_placement),
            vm_cpu_max: c.vm_cpu_max,
            vm_nofile_limit: c.vm_nofile_limit,
            jail_dir: c.jail_dir.clone(),
            key_prefix: Some(c.key_prefix.clone()),
            guest_ca_bundle: c.guest_ca_bundle.clone(),
            preview_listen: c.preview_listen,
            preview_domain: c.preview_domain.clone(),
            preview_url: c.preview_url.clone(),
            audit: Some(c.audit.clone()),
            host_id: c.host_id.clone(),
        }
    }
}

/// `/var/lib/agent-sandbox` for root, otherwise the XDG state directory.
pub fn default_state_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/agent-sandbox");
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("agent-sandbox");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/state/agent-sandbox"),
        None => PathBuf::from("/tmp/agent-sandbox"),
    }
}

/// Parses `250ms`, `30s`, `30m`, `2h`, `1d` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (try 30s, 30m, 2h, 250ms)"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => return Err(format!("bad duration unit in {s:?} (ms, s, m, h, d)")),
    };
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("5y").is_err());
    }
}
