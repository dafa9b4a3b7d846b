//! `agent-sandbox`: the host daemon and its administration commands.

use agent_sandbox::config::seed_env::EnvLayer;
use agent_sandbox::config::{parse_duration, BackendKind, Config, FileConfig};
use agent_sandbox::ops::auth::{self, validate_scopes, KeyStore};
use agent_sandbox::sandbox;
use agent_sandbox::sandbox::wiring;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "agent-sandbox",
    version,
    about = "Disposable microVM sandboxes for AI-agent sessions"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (REST API, metrics).
    Serve(Box<ServeArgs>),
    /// Bring a host up in one go: install what is missing, build the guest
    /// images, make the snapshots, then serve (same flags as `serve`).
    Up(Box<ServeArgs>),
    /// MCP server on stdin/stdout (in-process host, or --url to a daemon).
    Mcp(agent_sandbox::mcp::stdio::McpArgs),
    /// Manage API keys in the key file.
    Keys {
        #[command(subcommand)]
        cmd: KeysCmd,
        /// Key file (default: the config's keys_file, else <state dir>/keys.json).
        #[arg(long, global = true)]
        key_file: Option<PathBuf>,
        /// The daemon's config file, for its keys_file / state_dir.
        #[arg(long, global = true)]
        config: Option<PathBuf>,
    },
    /// The daemon's config file.
    Config {
        #[command(subcommand)]
        cmd: ConfigCmd,
    },
    /// What this host has and lacks for running sandboxes, with fixes.
    Doctor {
        /// [the config's backend, else qemu]
        #[arg(long)]
        backend: Option<String>,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// The daemon's config file (backend, artifact paths, state dir).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// Check a router's HAProxy config instead (`agent-sandbox router
        /// config`): haproxy -c, every host answers with the host id its
        /// server is named by, the same templates everywhere (with a key:
        /// AGENT_SANDBOX_API_KEY or AGENT_SANDBOX_KEY_FILE).
        #[arg(long, value_name = "FILE")]
        router: Option<PathBuf>,
    },
    /// Guest images (kernel, root filesystems).
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
    /// Template snapshots sessions restore from.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
    },
    /// Templates from your own images: OCI images and Dockerfiles.
    Template {
        #[command(subcommand)]
        cmd: TemplateCmd,
        /// [the config's backend, else qemu]
        #[arg(long, global = true)]
        backend: Option<String>,
        #[arg(long, global = true)]
        state_dir: Option<PathBuf>,
        /// The daemon's config file (backend, artifact paths, state dir).
        #[arg(long, global = true)]
        config: Option<PathBuf>,
    },
    /// Sessions' audit logs.
    Audit {
        #[command(subcommand)]
        cmd: AuditCmd,
    },
    /// Drain a daemon (at its own address, not the router's): it takes no
    /// new sessions and serves its own until they end (SIGUSR1 does the
    /// same).
    Drain {
        /// The daemon [the config's listen address].
        #[arg(long)]
        url: Option<String>,
        /// File holding an admin API key [AGENT_SANDBOX_API_KEY,
        /// AGENT_SANDBOX_KEY_FILE].
        #[arg(long)]
        key_file: Option<PathBuf>,
        /// The daemon's config file (for its listen address).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Wait until it is drained, at most this long (`30m`, `2h`).
        #[arg(long, value_name = "TIME", num_args = 0..=1, default_missing_value = "24h")]
        wait: Option<String>,
        /// End the drain: take new sessions again.
        #[arg(long, conflicts_with_all = ["wait", "status"])]
        cancel: bool,
        /// Only show the state (serving, draining, drained).
        #[arg(long)]
        status: bool,
        #[arg(long)]
        json: bool,
    },
    /// Several hosts behind HAProxy (docs/operations.md, "Several hosts").
    Router {
        #[command(subcommand)]
        cmd: RouterCmd,
    },
}

#[derive(Subcommand)]
enum RouterCmd {
    /// Print the HAProxy config that routes every session's requests to its
    /// host: `--host h1=10.0.0.1:3000 --host h2=10.0.0.2:3000 ...`.
    Config {
        /// Where clients reach the API.
        #[arg(long, default_value = "0.0.0.0:3000")]
        listen: SocketAddr,
        /// One host: ID=ADDR (its --host-id and listen address), with
        /// `,preview=ADDR` for its preview listener.
        #[arg(long = "host", value_name = "ID=ADDR[,preview=ADDR]", required = true)]
        hosts: Vec<agent_sandbox::router::RouterHost>,
        /// Where clients reach preview URLs (every host's --preview-url).
        #[arg(long)]
        preview_listen: Option<SocketAddr>,
        /// The hosts share one key file on shared storage: key changes
        /// through the router are passed on (else refused).
        #[arg(long)]
        shared_keys: bool,
        /// HAProxy's stats page on this address.
        #[arg(long)]
        stats_listen: Option<SocketAddr>,
    },
}

#[derive(Subcommand)]
enum AuditCmd {
    /// Check the hash chain of FILE... (one session's files in chain
    /// order: rotated `<session>.<n>.jsonl` by n, then `<session>.jsonl`).
    /// Exit 0 with a summary line, 1 naming the first broken record.
    Verify {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// `SEQ HASH` or `HASH` (the `Audit-Head` the daemon answered
        /// with): the chain must contain it, which shows a cut-off tail.
        #[arg(long)]
        head: Option<String>,
    },
}

#[derive(clap::Args)]
struct BuildArgs {
    #[command(flatten)]
    spec: agent_sandbox::vm::build::BuildSpec,
    /// Static guest agent [the one `image build` used].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Largest image (layers, and the unpacked tree) [16384].
    #[arg(long, default_value_t = 16384)]
    max_mib: u64,
    /// Only build the image; the snapshot is made on first use.
    #[arg(long)]
    no_snapshot: bool,
    /// Progress as JSON lines on stdout (no progress bar).
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum TemplateCmd {
    /// Build template NAME from an image or a Dockerfile, then make its
    /// snapshot. Labels `template.displayName`, `template.tools`,
    /// `template.description` of the image fill what flags leave unset.
    Build(Box<BuildArgs>),
    /// List templates (built-in and built from images).
    List,
    /// Remove a template built from an image, with its image and snapshots.
    Rm { name: String },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Parse and validate FILE, print the effective config as JSON (the
    /// same keys; defaults and environment filled in). Exit 0 if valid, 2
    /// if not.
    Check { file: PathBuf },
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Build what is missing (idempotent; cached by input hash).
    Build {
        /// Templates to build (default: all).
        #[arg(long)]
        template: Vec<String>,
        /// Static guest agent to put in the images (default: build it).
        #[arg(long)]
        agent: Option<PathBuf>,
    },
    /// Remove kernels and root filesystems that later builds replaced
    /// (`current.json` names what stays), except those a running daemon uses.
    Gc {
        /// Only list what would be removed.
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Make the snapshot of each template that lacks a fresh one.
    Create {
        #[arg(long)]
        template: Vec<String>,
        /// [the config's backend, else qemu]
        #[arg(long)]
        backend: Option<String>,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// The daemon's config file (backend, artifact paths, state dir).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Remake even fresh snapshots.
        #[arg(long)]
        force: bool,
    },
}

/// Config of the admin commands: the daemon's config file if given, then
/// `--state-dir` and `--backend`.
fn admin_config(
    config: Option<&Path>,
    state_dir: Option<PathBuf>,
    backend: Option<String>,
) -> Result<Config, String> {
    let mut c = Config::default();
    let env = EnvLayer::from_process()?;
    env.file.apply(&mut c);
    if let Some(path) = config {
        FileConfig::load(path)?.apply(&mut c);
    }
    c.artifacts.fill_from_env();
    if let Some(d) = state_dir {
        c.key_file = d.join("keys.json");
        c.state_dir = d;
    }
    if let Some(b) = backend {
        c.backend = b;
    }
    Ok(c)
}

fn dur(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

/// Flags of `serve` and `up`. Every setting flag is optional: a flag given
/// overrides the config file, which overrides the built-in default (shown
/// in brackets).
#[derive(clap::Args)]
struct ServeArgs {
    /// JSON config file (reference: docs/operations.md); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Validate the config (file and flags), print the effective config
    /// as JSON and exit: 0 if valid, 2 if not.
    #[arg(long)]
    check: bool,
    /// Address to listen on; port 0 picks a free port [127.0.0.1:3000].
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// State directory (key file, runtime dirs).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// This host's id behind a router (`agent-sandbox router config`):
    /// the ids it makes carry it, so their requests come back here
    /// (1-16 lower-case letters and digits) [none: one host].
    #[arg(long, value_name = "ID")]
    host_id: Option<String>,
    /// [<state dir>/keys.json]
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Disable authentication (only on a loopback address).
    #[arg(long)]
    no_auth: bool,
    /// Sandbox backend: local-process (development only, no isolation), qemu, firecracker [qemu].
    #[arg(long)]
    backend: Option<String>,
    /// Guest agent binary for --backend local-process.
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    /// [30m]
    #[arg(long, value_parser = dur)]
    idle_timeout: Option<Duration>,
    /// [24h]
    #[arg(long, value_parser = dur)]
    max_lifetime: Option<Duration>,
    /// [64]
    #[arg(long)]
    max_sessions: Option<usize>,
    /// Most vCPUs one session may ask for (also at most the host's online CPUs) [8].
    #[arg(long)]
    max_vcpus: Option<u32>,
    /// Most guest memory (MiB) one session may ask for (also at most a share of the host RAM) [8192].
    #[arg(long)]
    max_mem_mib: Option<u32>,
    /// Most disk (MiB) one session may ask for [65536].
    #[arg(long)]
    max_disk_mib: Option<u32>,
    /// Live sessions one API key may hold [16].
    #[arg(long)]
    max_sessions_per_key: Option<usize>,
    /// vCPUs of all live sessions of one API key [32].
    #[arg(long)]
    max_vcpus_per_key: Option<u32>,
    /// Memory (MiB) of all live sessions of one API key [16384].
    #[arg(long)]
    max_mem_mib_per_key: Option<u32>,
    /// Warm sandboxes kept ready per template [0].
    #[arg(long)]
    pool_size: Option<usize>,
    /// VMMs kept started ahead of restores, one per recently used
    /// template shape; 0 turns them off [2].
    #[arg(long)]
    standby_vmms: Option<usize>,
    /// [default]
    #[arg(long)]
    default_template: Option<String>,
    /// Open client connections in all (a thread each) [1024].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Open connections from one client address [64].
    #[arg(long)]
    max_connections_per_ip: Option<usize>,
    /// Long-running requests (commands, streams, transfers) in flight at once [256].
    #[arg(long)]
    max_streams: Option<usize>,
    /// Largest JSON body in bytes [1 MiB].
    #[arg(long)]
    max_body: Option<usize>,
    /// Largest file transfer in bytes [64 MiB].
    #[arg(long)]
    max_file: Option<usize>,
    /// Default command timeout [10m].
    #[arg(long, value_parser = dur)]
    exec_timeout: Option<Duration>,
    /// Per-key requests per second (token refill rate) [50].
    #[arg(long)]
    rate_limit: Option<f64>,
    /// [100]
    #[arg(long)]
    rate_burst: Option<f64>,
    /// Failed authentications one client address may make in a burst
    /// (then 2 per second) before it gets 429 auth_throttled [20]
    #[arg(long)]
    auth_fail_burst: Option<f64>,
    /// [5s]
    #[arg(long, value_parser = dur)]
    reap_interval: Option<Duration>,
    /// Socket write timeout (clients that stop reading a stream) [60s].
    #[arg(long, value_parser = dur)]
    write_timeout: Option<Duration>,
    /// Browser origin allowed to use /mcp (repeatable; replaces the file's list) [none].
    #[arg(long)]
    mcp_allowed_origin: Vec<String>,
    /// Per-session networking: `on` (own namespace, NAT to the uplink,
    /// egress policy) or `off` (VMs have no network).
    /// Default: on without a config file; with one, its `network` section.
    #[arg(long, value_parser = ["on", "off"])]
    network: Option<String>,
    /// Interface session traffic leaves by (default: the default route's).
    #[arg(long)]
    uplink: Option<String>,
    /// DNS resolver the sessions' resolvers forward to, `ADDR:PORT`
    /// (repeatable; default: the nameservers of /etc/resolv.conf).
    #[arg(long)]
    dns_upstream: Vec<SocketAddr>,
    /// Prefix of our namespaces, links and nftables table (1-6 of a-z0-9);
    /// two daemons on one host need different ones.
    #[arg(long)]
    net_prefix: Option<String>,
    /// CA bundle (PEM) the egress proxy verifies a secret's host against
    /// when it injects credentials [/etc/ssl/certs/ca-certificates.crt].
    #[arg(long, value_name = "PATH")]
    proxy_upstream_ca: Option<PathBuf>,
    /// uids/gids of VMs, `FIRST:COUNT`: the first is the snapshot builder's,
    /// each session's VMM gets one of the others for its life [2000000000:65536].
    #[arg(long, value_parser = agent_sandbox::vm::ids::IdRange::parse)]
    vm_ids: Option<agent_sandbox::vm::ids::IdRange>,
    /// io.max rule of each VM's cgroup, e.g. `wbps=104857600 wiops=2000`
    /// (rbps, wbps, riops, wiops), on the disks of the state and image
    /// directories, where the cgroup v2 `io` controller exists [none].
    #[arg(long)]
    vm_io_max: Option<String>,
    /// Memory a VMM may use beyond its guest RAM, in MiB, in each VM's
    /// cgroup memory limit [QEMU: 256].
    #[arg(long)]
    vm_memory_overhead_mib: Option<u64>,
    /// Start VMMs even where this host's cgroups cannot limit their
    /// memory, CPU and processes (they then run without those limits);
    /// without it `serve` refuses to start there (`doctor` says why).
    #[arg(long)]
    allow_unlimited_vmms: bool,
    /// Where VMs' cgroups go: `own` below the daemon's own cgroup (it
    /// moves into `<own>/daemon`, VMs into `<own>/vms/<id>`), `standalone`
    /// below `agent-sandbox/d-<hash>`, `auto` own where systemd delegated
    /// the daemon's cgroup (Delegate=yes) [auto].
    #[arg(long)]
    cgroup_placement: Option<agent_sandbox::vm::cgroup::Placement>,
    /// PEM file of extra CAs every guest trusts (trust store and
    /// SSL_CERT_FILE & co.), e.g. a TLS-inspecting proxy's; `host`: the
    /// host's own bundle, /etc/ssl/certs/ca-certificates.crt [none].
    #[arg(long, value_name = "PATH")]
    guest_ca_bundle: Option<PathBuf>,
    /// Address of the preview listener, which reaches guests' exposed
    /// ports (`POST /v1/sessions/:id/ports`) [none: no preview URLs].
    #[arg(long, value_name = "ADDR")]
    preview_listen: Option<SocketAddr>,
    /// Wildcard domain for host-based preview URLs, `<token>.<domain>`
    /// (its wildcard DNS record points at the preview listener) [none].
    #[arg(long, value_name = "DOMAIN")]
    preview_domain: Option<String>,
    /// How clients reach the preview listener, e.g. behind a TLS proxy
    /// `https://preview.example.com` [http://<preview-listen>].
    #[arg(long, value_name = "URL")]
    preview_url: Option<String>,
    /// The audit log (docs/security.md, "Audit log") [on].
    #[arg(long, value_parser = ["on", "off"])]
    audit: Option<String>,
    /// Where the audit files go [<state dir>/audit].
    #[arg(long, value_name = "PATH")]
    audit_dir: Option<PathBuf>,
    /// A session's current audit file is rotated past this size [16777216].
    #[arg(long, value_name = "BYTES")]
    audit_rotate_bytes: Option<u64>,
    /// Audit files older than this are removed: `30d`, `12h` [30d].
    #[arg(long, value_parser = dur)]
    audit_retention: Option<Duration>,
    /// All audit files together are kept under this [4294967296].
    #[arg(long, value_name = "BYTES")]
    audit_retention_bytes: Option<u64>,
    /// One session's audit files end (a `truncated` record) at [268435456].
    #[arg(long, value_name = "BYTES")]
    audit_max_session_bytes: Option<u64>,
    /// Process, file, stdin, PTY and egress records per second and session [200].
    #[arg(long)]
    audit_rate: Option<f64>,
    /// ... and their burst [2000].
    #[arg(long)]
    audit_burst: Option<f64>,
    /// Also every record as an RFC 5424 datagram to /dev/log [off].
    #[arg(long)]
    audit_syslog: bool,
    /// Also every record POSTed as NDJSON to this URL [none].
    #[arg(long, value_name = "URL")]
    audit_http_url: Option<String>,
    /// Network namespace (path) that plays the host: tests use one whose
    /// only uplink leads to a test network.
    #[arg(long, hide = true)]
    net_host_netns: Option<PathBuf>,
}

/// The `network` section after `serve`'s flags: `--network off` wins,
/// `--network on` (the default without a config file) takes the file's
/// section or the defaults; the uplink defaults to the default route's
/// interface and the resolvers to the host's.
fn network_config(
    a: &ServeArgs,
    from_file: Option<agent_sandbox::net::NetConfig>,
    env_dns: &[SocketAddr],
    wait: Option<&libc::sigset_t>,
) -> Result<Option<agent_sandbox::net::NetConfig>, String> {
    use agent_sandbox::sandbox::wiring;
    let on = match a.network.as_deref() {
        Some("off") => false,
        Some(_) => true,
        None => a.config.is_none() || from_file.is_some(),
    };
    if !on {
        return Ok(None);
    }
    let mut n = from_file.unwrap_or_default();
    if let Some(p) = &a.net_prefix {
        n.prefix = p.clone();
    }
    if a.net_host_netns.is_some() {
        n.host_netns = a.net_host_netns.clone();
    }
    if let Some(u) = &a.uplink {
        n.uplink_if = u.clone();
    } else if n.uplink_if.is_empty() {
        const HOW: &str = "pass --uplink IF (or network.uplink_if), or --network off";
        let host = n.host_netns.clone();
        let find = || wiring::default_uplink_in(host.as_deref());
        n.uplink_if = match (find(), wait) {
            (Some(i), _) => i,
            (None, None) => return Err(format!("no default route to take the uplink from: {HOW}")),
            (None, Some(sigs)) => wait_for_uplink(find, sigs, HOW)?,
        };
    }
    if let Some(p) = &a.proxy_upstream_ca {
        n.proxy_upstream_ca = p.clone();
    }
    if !a.dns_upstream.is_empty() {
        n.dns_upstreams = a.dns_upstream.clone();
    } else if n.dns_upstreams.is_empty() && !env_dns.is_empty() {
        n.dns_upstreams = env_dns.to_vec();
    } else if n.dns_upstreams.is_empty() {
        n.dns_upstreams = wiring::host_resolvers();
    }
    n.validate().map_err(|e| format!("network: {e}"))?;
    Ok(Some(n))
}

/// Waits for `find` to see a default route (a host whose DHCP lease comes
/// after the daemon's start), polling each second, saying so every 30 s;
/// a shutdown signal ends the wait. Runs before any thread starts.
fn wait_for_uplink(
    find: impl Fn() -> Option<String>,
    sigs: &libc::sigset_t,
    how: &str,
) -> Result<String, String> {
    let t0 = std::time::Instant::now();
    let mut said = None::<std::time::Instant>;
    loop {
        if let Some(i) = find() {
            log::info!(
                "network: default route via {i} after {:.1} s: it is the uplink",
                t0.elapsed().as_secs_f64()
            );
            return Ok(i);
        }
        if said.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
            log::warn!(
                "network: no default route yet to take the uplink from; waiting for one \
                 (waited {} s; {how})",
                t0.elapsed().as_secs()
            );
            said = Some(std::time::Instant::now());
        }
        let ts = libc::timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        // SAFETY: a valid blocked set and timeout; no siginfo wanted.
        let sig = unsafe { libc::sigtimedwait(sigs, std::ptr::null_mut(), &ts) };
        if sig > 0 {
            return Err(format!(
                "stopped (signal {sig}) while waiting for a default route"
            ));
        }
    }
}

/// The daemon's Config: built-in defaults, then the seed's environment
/// variables (`config::seed_env`), then the config file, then the
/// environment for artifact paths the file leaves unset, then flags.
/// `wait`: for `serve`/`up`, the shutdown signals to watch while waiting
/// for a default route to take the uplink from; `None` (a check): no route
/// is an error.
fn serve_config(a: &ServeArgs, wait: Option<&libc::sigset_t>) -> Result<Config, String> {
    let env = EnvLayer::from_process()?;
    serve_config_with(a, &env, wait).map_err(|e| env.annotate(e))
}

fn serve_config_with(
    a: &ServeArgs,
    env: &EnvLayer,
    wait: Option<&libc::sigset_t>,
) -> Result<Config, String> {
    let mut c = Config::default();
    let mut file_names_key_file = env.file.keys_file.is_some();
    env.file.clone().apply(&mut c);
    if let Some(path) = &a.config {
        let fc = FileConfig::load(path)?;
        file_names_key_file |= fc.keys_file.is_some();
        fc.apply(&mut c);
    }
    c.artifacts.fill_from_env();
    if let Some(d) = &a.state_dir {
        // The key file follows the state dir unless named (flag or file).
        if !file_names_key_file {
            c.key_file = d.join("keys.json");
        }
        c.state_dir = d.clone();
    }
    macro_rules! flag {
        ($($arg:ident => $field:expr),* $(,)?) => {
            $(if let Some(v) = &a.$arg { $field = v.clone(); })*
        };
    }
    flag!(
        listen => c.listen,
        key_file => c.key_file,
        backend => c.backend,
        idle_timeout => c.idle_timeout,
        max_lifetime => c.max_lifetime,
        max_sessions => c.max_sessions,
        max_vcpus => c.max_vcpus,
        max_mem_mib => c.max_mem_mib,
        max_disk_mib => c.max_disk_mib,
        max_sessions_per_key => c.max_sessions_per_key,
        max_vcpus_per_key => c.max_vcpus_per_key,
        max_mem_mib_per_key => c.max_mem_mib_per_key,
        pool_size => c.pool_size,
        standby_vmms => c.standby_vmms,
        default_template => c.default_template,
        max_connections => c.max_connections,
        max_connections_per_ip => c.max_connections_per_ip,
        max_streams => c.max_streams,
        max_body => c.max_body,
        max_file => c.max_file,
        exec_timeout => c.default_exec_timeout,
        rate_limit => c.rate_per_sec,
        rate_burst => c.rate_burst,
        auth_fail_burst => c.auth_fail_burst,
        reap_interval => c.reap_interval,
        write_timeout => c.write_timeout,
        vm_ids => c.vm_ids,
    );
    if a.agent_bin.is_some() {
        c.agent_bin = a.agent_bin.clone();
    }
    if a.no_auth {
        c.auth = false;
    }
    if !a.mcp_allowed_origin.is_empty() {
        c.mcp_allowed_origins = a.mcp_allowed_origin.clone();
    }
    if a.vm_io_max.is_some() {
        c.vm_io_max = a.vm_io_max.clone();
    }
    if a.vm_memory_overhead_mib.is_some() {
        c.vm_memory_overhead_mib = a.vm_memory_overhead_mib;
    }
    if a.allow_unlimited_vmms {
        c.allow_unlimited_vmms = true;
    }
    if let Some(p) = a.cgroup_placement {
        c.cgroup_placement = p;
    }
    if a.guest_ca_bundle.is_some() {
        c.guest_ca_bundle = a.guest_ca_bundle.clone();
    }
    if a.preview_listen.is_some() {
        c.preview_listen = a.preview_listen;
    }
    if a.preview_domain.is_some() {
        c.preview_domain = a.preview_domain.clone();
    }
    if a.preview_url.is_some() {
        c.preview_url = a.preview_url.clone();
    }
    if a.host_id.is_some() {
        c.host_id = a.host_id.clone();
    }
    if let Some(v) = &a.audit {
        c.audit.enabled = v == "on";
    }
    if a.audit_dir.is_some() {
        c.audit.dir = a.audit_dir.clone();
    }
    if let Some(d) = a.audit_retention {
        c.audit.retention_secs = d.as_secs();
    }
    if a.audit_syslog {
        c.audit.syslog = true;
    }
    if a.audit_http_url.is_some() {
        c.audit.http_url = a.audit_http_url.clone();
    }
    flag!(
        audit_rotate_bytes => c.audit.rotate_bytes,
        audit_retention_bytes => c.audit.retention_bytes,
        audit_max_session_bytes => c.audit.max_session_bytes,
        audit_rate => c.audit.rate_per_sec,
        audit_burst => c.audit.rate_burst,
    );
    c.net_prefix = a.net_prefix.clone();
    c.network = if c.backend_kind() == Ok(BackendKind::LocalProcess) {
        None
    } else {
        network_config(a, c.network.take(), &env.dns_upstreams, wait)?
    };
    c.validate().map_err(|e| match &a.config {
        Some(p) => format!("config {} (with flags): {e}", p.display()),
        None => e,
    })?;
    Ok(c)
}

/// Prints `c` as the effective config file (`config check`, `--check`).
fn print_effective(c: &Config) -> Result<(), String> {
    use std::io::Write;
    let json = serde_json::to_string_pretty(&FileConfig::from_config(c))
        .map_err(|e| format!("print config: {e}"))?;
    writeln!(std::io::stdout().lock(), "{json}").map_err(|e| format!("print config: {e}"))
}

#[derive(Subcommand)]
enum KeysCmd {
    /// Create a key and print it (shown only once).
    Create {
        #[arg(long, default_value = "")]
        name: String,
        /// Comma-separated: exec, admin, metrics.
        #[arg(long, default_value = "exec")]
        scopes: String,
        /// Requests per second for this key.
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long)]
        burst: Option<f64>,
        /// The key stops working this long from now: `7d`, `12h`, `30m`,
        /// `90s` (default: never).
        #[arg(long)]
        expires: Option<String>,
    },
    /// Keys with their state (active, revoked, expired) and expiry.
    List,
    /// Replace a key's secret (same id and scopes).
    Rotate {
        id: String,
    },
    Revoke {
        id: String,
    },
}

fn main() -> ExitCode {
    // Before any thread starts, so every thread inherits the mask and only
    // the signal thread receives SIGTERM/SIGINT.
    let sigs = block_shutdown_signals();
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Serve(a) if a.check => return check(serve_config(&a, None)),
        Cmd::Up(a) if a.check => return check(serve_config(&a, None)),
        Cmd::Config {
            cmd: ConfigCmd::Check { file },
        } => return check(config_check(&file)),
        Cmd::Serve(a) => serve_config(&a, Some(&sigs)).and_then(|c| serve(c, sigs)),
        Cmd::Up(a) => serve_config(&a, Some(&sigs)).and_then(|c| up(c, sigs)),
        Cmd::Keys {
            cmd,
            key_file,
            config,
        } => keys(cmd, key_file, config.as_deref()),
        Cmd::Doctor {
            router: Some(file), ..
        } => agent_sandbox::mcp::forward::key_from(None)
            .and_then(|k| agent_sandbox::admin::router::doctor_router(&file, k.as_deref())),
        Cmd::Doctor {
            backend,
            state_dir,
            config,
            json,
            router: None,
        } => admin_config(config.as_deref(), state_dir, backend)
            .and_then(|c| agent_sandbox::admin::doctor(&c, &c.backend, json)),
        Cmd::Image {
            cmd: ImageCmd::Build { template, agent },
        } => agent_sandbox::admin::image_build(&template, agent, &wiring::cache_dir()),
        Cmd::Image {
            cmd: ImageCmd::Gc { dry_run },
        } => image_gc(dry_run),
        Cmd::Snapshot {
            cmd:
                SnapshotCmd::Create {
                    template,
                    backend,
                    state_dir,
                    config,
                    force,
                },
        } => admin_config(config.as_deref(), state_dir, backend)
            .and_then(|c| agent_sandbox::admin::snapshot_create(&c, &c.backend, &template, force)),
        Cmd::Template {
            cmd,
            backend,
            state_dir,
            config,
        } => admin_config(config.as_deref(), state_dir, backend).and_then(|c| template(&c, cmd)),
        Cmd::Mcp(a) => mcp(a),
        Cmd::Audit {
            cmd: AuditCmd::Verify { files, head },
        } => return audit_verify(&files, head.as_deref()),
        Cmd::Drain {
            url,
            key_file,
            config,
            wait,
            cancel,
            status,
            json,
        } => drain(url, key_file, config, wait, cancel, status, json),
        Cmd::Router {
            cmd:
                RouterCmd::Config {
                    listen,
                    hosts,
                    preview_listen,
                    shared_keys,
                    stats_listen,
                },
        } => agent_sandbox::router::render(&agent_sandbox::router::RouterSpec {
            listen,
            preview_listen,
            hosts,
            shared_keys,
            stats_listen,
        })
        .map(|c| print!("{c}")),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            ExitCode::FAILURE
        }
    }
}

fn template(c: &Config, cmd: TemplateCmd) -> Result<(), String> {
    match cmd {
        TemplateCmd::Build(b) => {
            let BuildArgs {
                spec,
                agent,
                max_mib,
                no_snapshot,
                json,
            } = *b;
            agent_sandbox::admin::template_build(
                c,
                &spec,
                agent_sandbox::admin::TemplateBuildOpts {
                    agent,
                    json,
                    snapshot: !no_snapshot,
                    max_bytes: max_mib << 20,
                },
            )
        }
        TemplateCmd::List => agent_sandbox::admin::template_list(c),
        TemplateCmd::Rm { name } => agent_sandbox::admin::template_rm(c, &name),
    }
}

fn audit_verify(files: &[PathBuf], head: Option<&str>) -> ExitCode {
    let head = head.map(|h| h.split_whitespace().last().unwrap_or(h));
    match agent_sandbox::audit::verify::verify(files, head) {
        Ok(s) => {
            println!(
                "ok: {} records, seq {}..{}, head {}",
                s.records, s.first_seq, s.last_seq, s.head
            );
            ExitCode::SUCCESS
        }
        Err(b) => {
            eprintln!("agent-sandbox audit verify: {b}");
            ExitCode::FAILURE
        }
    }
}

/// `config check FILE`: the file alone, as `serve --config FILE` would
/// read it (environment fallbacks included).
fn config_check(file: &Path) -> Result<Config, String> {
    let env = EnvLayer::from_process()?;
    let mut c = Config::default();
    env.file.clone().apply(&mut c);
    FileConfig::load(file)?.apply(&mut c);
    c.artifacts.fill_from_env();
    c.validate()
        .map_err(|e| env.annotate(format!("config {}: {e}", file.display())))?;
    Ok(c)
}

/// Exit status of a config check: 0 and the effective config on stdout,
/// or 2 and the reason on stderr.
fn check(r: Result<Config, String>) -> ExitCode {
    match r.and_then(|c| print_effective(&c)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            ExitCode::from(2)
        }
    }
}

/// `agent-sandbox drain`: the daemon's URL from the flag, else its config's
/// listen address (a wildcard one as loopback).
fn drain(
    url: Option<String>,
    key_file: Option<PathBuf>,
    config: Option<PathBuf>,
    wait: Option<String>,
    cancel: bool,
    status: bool,
    json: bool,
) -> Result<(), String> {
    use agent_sandbox::admin::router::DrainAction;
    let base = match url {
        Some(u) => u,
        None => {
            let c = admin_config(config.as_deref(), None, None)?;
            let mut a = c.listen;
            if a.ip().is_unspecified() {
                a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            format!("http://{a}")
        }
    };
    let key = agent_sandbox::mcp::forward::key_from(key_file.as_deref())?;
    let wait = wait
        .map(|w| parse_duration(&w).map_err(|e| format!("--wait: {e}")))
        .transpose()?;
    let action = match (cancel, status) {
        (true, _) => DrainAction::Cancel,
        (_, true) => DrainAction::Status,
        _ => DrainAction::Start,
    };
    agent_sandbox::admin::router::drain(&base, key.as_deref(), action, wait, json)
}

fn block_shutdown_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-set manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        // SIGUSR1: drain (issue #28), taken by `serve`'s signal wait.
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        // Writes to a client that went away must fail, not kill us.
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        set
    }
}

fn image_gc(dry_run: bool) -> Result<(), String> {
    let cache = wiring::cache_dir();
    let r = agent_sandbox::admin::image_gc(&cache, dry_run)?;
    let verb = if dry_run { "would remove" } else { "removed" };
    for (p, size) in &r.removed {
        println!("{verb} {} ({} MiB)", p.display(), size >> 20);
    }
    for p in &r.in_use {
        println!("kept {} (in use by a running daemon)", p.display());
    }
    let total: u64 = r.removed.iter().map(|(_, s)| s).sum();
    println!(
        "{} {} file(s), {} MiB; {} current kept, {} in use",
        verb,
        r.removed.len(),
        total >> 20,
        r.kept.len(),
        r.in_use.len()
    );
    Ok(())
}

fn serve(cfg: Config, sigs: libc::sigset_t) -> Result<(), String> {
    let backend = cfg.backend_kind()?;
    let agent_bin = (backend == BackendKind::LocalProcess).then(|| {
        let b = cfg
            .agent_bin
            .clone()
            .unwrap_or_else(sandbox::local::LocalProcessFactory::default_agent_bin);
        // The spawner's allowlist compares exact paths.
        std::fs::canonicalize(&b).unwrap_or(b)
    });
    // The images this daemon restores from stay ours while it runs: `image
    // gc` skips them even once a newer build replaced them.
    // The registry is given the same paths, read once.
    let pins = (backend != BackendKind::LocalProcess).then(|| wiring::pinned_images(&cfg));
    let _images = pins
        .as_ref()
        .map(|p| agent_sandbox::admin::lock_images(p.paths()));
    // Still single-threaded here: nothing before this starts a thread
    // (`up` runs its builds in a child process).
    let mut host = harden_daemon(backend, agent_bin.as_deref(), &cfg)?;
    host.images = pins;
    let factory =
        sandbox::build_factory_on(backend, agent_bin, &cfg, &host).map_err(|e| e.to_string())?;
    let auth = cfg.auth;
    let server = agent_sandbox::start_daemon(cfg, factory)?;
    let keys = &server.ctx.auth.keys;
    println!("agent-sandbox: key file {}", keys.path().display());
    if auth && keys.is_empty() {
        let (rec, token) = keys.create(
            "initial-admin",
            vec!["admin".into(), "exec".into(), "metrics".into()],
            None,
            None,
            None,
        )?;
        println!(
            "agent-sandbox: created the first API key {} (scopes admin, exec, metrics); \
             it is shown only this once:\nagent-sandbox: API key: {token}",
            rec.id
        );
    } else if !auth {
        println!("agent-sandbox: authentication is DISABLED (loopback only)");
    }
    println!("agent-sandbox: listening on http://{}", server.addr());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let sig = loop {
        match wait_for_signal(&sigs) {
            libc::SIGUSR1 => {
                let d = server.ctx.ops.drain(true);
                log::info!("SIGUSR1: {} ({} sessions)", d.state, d.sessions);
            }
            sig => break sig,
        }
    };
    log::info!("signal {sig}: shutting down");
    server.shutdown();
    for p in &host.cgroup_parents {
        // Every VM's cgroup went with its session; the parents are ours too.
        if let Err(e) = std::fs::remove_dir(p) {
            log::warn!("remove cgroup parent {}: {e}", p.display());
        }
    }
    log::info!("shutdown complete");
    Ok(())
}

/// Start-up hardening, in the order `docs/security.md` gives: fork the
/// spawner (the only process that may start processes, with a policy
/// fixed now), then drop the daemon's capabilities, set no_new_privs and
/// install the baseline seccomp filter, then start the spawner client.
/// Must run while the process is single-threaded.
/// `AGENT_SANDBOX_SECCOMP=enforce|log|off` chooses the filter mode
/// (default enforce); capabilities and no_new_privs apply in every mode.
fn harden_daemon(
    backend: BackendKind,
    agent_bin: Option<&std::path::Path>,
    cfg: &Config,
) -> Result<wiring::Host, String> {
    use agent_sandbox::harden::{self, caps, spawner};
    let t0 = std::time::Instant::now();
    let mode = harden::Mode::from_env().map_err(|e| e.to_string())?;
    // SAFETY: geteuid/getegid have no preconditions.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let root = euid == 0;
    let mut programs = Vec::new();
    let mut cgroup_parents = Vec::new();
    match backend {
        BackendKind::LocalProcess => {
            // No isolation in this backend: the agent runs as the daemon's
            // own uid, as it would without the spawner.
            if let Some(b) = agent_bin {
                programs.push(spawner::Program {
                    path: b.to_path_buf(),
                    may_run_as_root: true,
                });
            }
        }
        BackendKind::Qemu | BackendKind::Firecracker => {
            let q = wiring::qemu_config(cfg).binary;
            let q = agent_sandbox::vm::qemu::find_in_path(&q).unwrap_or(q);
            programs.push(spawner::Program {
                path: q,
                may_run_as_root: false,
            });
            let jc = wiring::jailer_config(cfg);
            programs.push(spawner::Program {
                path: jc.jailer_bin.clone(),
                may_run_as_root: true,
            });
            programs.push(spawner::Program {
                path: jc.firecracker_bin.clone(),
                may_run_as_root: false,
            });
            cgroup_parents = vmm_cgroups(cfg, root)?;
        }
    }
    // Unprivileged (development): the spawner can only start programs as
    // the daemon's own uid.
    let (uids, gids) = if root {
        let r = cfg.vm_ids;
        (r.first..=r.last(), r.first..=r.last())
    } else {
        (euid..=euid, egid..=egid)
    };
    let policy = spawner::Policy {
        programs,
        // (the first id: the snapshot builder's, never a session's)
        tool_uid: *uids.start(),
        tool_gid: *gids.start(),
        uids,
        gids,
        netns_dirs: vec!["/run/netns".into()],
        cgroup_dirs: cgroup_parents.clone(),
    };
    // The template builder (issue #27), forked like the spawner while we
    // still hold root: builds of users' images for `POST /v1/templates`.
    let builder = match (root, backend) {
        (true, BackendKind::Qemu | BackendKind::Firecracker) => template_builder(cfg),
        _ => None,
    };
    let forked = spawner::fork_spawner(policy, mode).map_err(|e| format!("spawner: {e}"))?;
    let spawner_pid = forked.pid();
    let mut opts = harden::Options {
        seccomp: mode,
        ..harden::Options::daemon().map_err(|e| e.to_string())?
    };
    // Domain allowlists run a DNS forwarder on port 53 in each session
    // namespace; a privileged API port needs the same.
    if cfg.network.is_some() || cfg.listen.port() < 1024 && cfg.listen.port() != 0 {
        opts.needs.push(caps::Need::BindLowPort);
    }
    let report = harden::apply(&opts).map_err(|e| format!("hardening: {e}"))?;
    let client = forked
        .start_client()
        .map_err(|e| format!("spawner client: {e}"))?;
    client.on_death(|why| {
        // It cannot be restarted (we no longer hold the privileges to fork
        // a privileged process): report not ready, exit for the supervisor
        // to restart us; the start-up sweep removes what is left.
        let msg = format!("spawner died ({why}): no sandbox can be started; exiting");
        let _ = agent_sandbox::api::rest::NOT_READY.set(msg.clone());
        log::error!("{msg}");
        std::process::exit(75);
    });
    let names = |v: &[::caps::Capability]| {
        v.iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    log::info!(
        "hardening: spawner pid {spawner_pid}; capabilities kept [{}]{}; no_new_privs; seccomp {:?}; RLIMIT_NOFILE {}; RLIMIT_CORE 0; took {:.1} ms",
        names(&report.caps.kept),
        if report.caps.missing.is_empty() {
            String::new()
        } else {
            format!(" (not held: [{}])", names(&report.caps.missing))
        },
        report.seccomp,
        report.nofile,
        t0.elapsed().as_secs_f64() * 1000.0
    );
    Ok(wiring::Host {
        spawner: Some(client),
        cgroup_parents,
        images: None,
        builder: std::sync::Arc::new(std::sync::Mutex::new(builder)),
    })
}

/// Forks the template builder, if this host can build (an agent from
/// `image build` to put into images).
fn template_builder(cfg: &Config) -> Option<sandbox::builds::BuilderHandle> {
    let cache = wiring::cfg_cache_dir(cfg);
    let Some(agent) = agent_sandbox::admin::current_agent(&cache) else {
        log::info!(
            "template builds off: no agent recorded in {}/current.json (run `agent-sandbox image build`)",
            cache.display()
        );
        return None;
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            log::warn!("template builds off: /proc/self/exe: {e}");
            return None;
        }
    };
    let bc = sandbox::builds::BuilderConfig {
        exe,
        cache_dir: cache,
        templates_dir: cfg
            .artifacts
            .templates_dir
            .clone()
            .unwrap_or_else(wiring::templates_dir),
        agent,
        max_mib: 16384,
        allow_host_network: false,
    };
    match sandbox::builds::fork_builder(bc) {
        Ok(h) => {
            log::info!("template builder pid {}", h.pid());
            Some(h)
        }
        Err(e) => {
            log::warn!("template builds off: fork: {e}");
            None
        }
    }
}

/// The daemon's cgroup parents (one per hierarchy used, v2 and v1) for
/// VMMs' limits. Refuses (an error) when a limit has no controller here,
/// unless `allow_unlimited_vmms`; a daemon not running as root cannot make
/// cgroups at all and is refused the same way.
fn vmm_cgroups(cfg: &Config, root: bool) -> Result<Vec<PathBuf>, String> {
    use agent_sandbox::vm::cgroup;
    const HOW: &str = "run `agent-sandbox doctor` for what is missing and how to fix it, \
                       or start with --allow-unlimited-vmms (config allow_unlimited_vmms) \
                       to run VMMs without those limits";
    let want = wiring::wanted_controllers(cfg);
    let refuse = |why: String| -> Result<Vec<PathBuf>, String> {
        if cfg.allow_unlimited_vmms {
            log::warn!("{why}: VMMs run WITHOUT those limits (allow_unlimited_vmms)");
            Ok(Vec::new())
        } else {
            Err(format!("{why}; {HOW}"))
        }
    };
    if !root {
        return refuse("not root: no per-VM cgroups (memory, CPU, process limits)".into());
    }
    // (The hash is of the canonical path, which needs the dir.)
    let _ = std::fs::create_dir_all(&cfg.state_dir);
    let self_cg = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let (own, rels) = cgroup::plan(
        &cgroup::hierarchies(),
        &cfg.state_dir,
        cfg.cgroup_placement,
        &self_cg,
    )?;
    if own {
        // Out of the cgroup its VMs' parent is in (cgroup v2 lets no
        // process sit beside children that have controllers), while the
        // daemon is still one process: the spawner forked next follows.
        cgroup::enter_daemon_leaf(&rels).map_err(|e| format!("cgroup placement own: {e}"))?;
        log::info!("cgroup: VMs below the daemon's own cgroup (cgroup_placement own)");
    }
    let p = cgroup::prepare_parents(&rels, &want).map_err(|e| format!("cgroup parent: {e}"))?;
    for (c, dir) in &p.enforced {
        log::info!("cgroup: VMM {c} limits in {}", dir.display());
    }
    if !p.missing.is_empty() {
        let parents = p.parents.clone();
        let why = format!(
            "no cgroup hierarchy (v2 or v1) offers the {} controller(s)",
            p.missing.join(", ")
        );
        return refuse(why).map(|_| parents);
    }
    Ok(p.parents)
}

fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: valid set and out pointer; the signals are blocked in
        // every thread, so sigwait is the only receiver.
        let r = unsafe { libc::sigwait(set, &mut sig) };
        if r == 0 {
            return sig;
        }
    }
}

fn keys(cmd: KeysCmd, key_file: Option<PathBuf>, config: Option<&Path>) -> Result<(), String> {
    // The config file (if any) and the seed's environment name the key
    // file and the prefix of new keys; --key-file names the file.
    let c = admin_config(config, None, None)?;
    let path = key_file.unwrap_or(c.key_file);
    let store = KeyStore::open_with_prefix(&path, &c.key_prefix)?;
    match cmd {
        KeysCmd::Create {
            name,
            scopes,
            rate,
            burst,
            expires,
        } => {
            let scopes: Vec<String> = scopes
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
            validate_scopes(&scopes)?;
            let expires_at = match expires {
                None => None,
                Some(e) => {
                    let d = parse_duration(&e).map_err(|m| format!("--expires: {m}"))?;
                    if d.as_millis() == 0 {
                        return Err("--expires must be longer than 0 (e.g. 7d, 12h, 30m)".into());
                    }
                    Some(auth::now_ms().saturating_add(d.as_millis() as u64))
                }
            };
            let (rec, token) = store.create(&name, scopes, rate, burst, expires_at)?;
            let until = rec
                .expires_at
                .map(|t| format!(", expires {}", auth::utc_string(t)))
                .unwrap_or_default();
            eprintln!(
                "created key {} ({}{until}) in {}",
                rec.id,
                rec.scopes.join(","),
                path.display()
            );
            println!("{token}");
        }
        KeysCmd::List => {
            let now = auth::now_ms();
            println!(
                "{:<16} {:<24} {:<22} {:<8} {:<20}",
                "ID", "NAME", "SCOPES", "STATE", "EXPIRES (UTC)"
            );
            for k in store.list() {
                println!(
                    "{:<16} {:<24} {:<22} {:<8} {:<20}",
                    k.id,
                    k.name,
                    k.scopes.join(","),
                    k.state(now),
                    k.expires_at.map_or("never".into(), auth::utc_string)
                );
            }
        }
        KeysCmd::Rotate { id } => {
            let (_, token) = store.rotate(&id).map_err(|e| e.to_string())?;
            eprintln!("rotated key {id}; the old secret no longer works");
            println!("{token}");
        }
        KeysCmd::Revoke { id } => {
            store.revoke(&id).map_err(|e| e.to_string())?;
            eprintln!("revoked key {id}");
        }
    }
    Ok(())
}

/// `up`: everything `serve` needs on a fresh host, then `serve`.
/// The builds run in a child process: `serve` must start single-threaded
/// and unhardened, and the builds start threads and processes of their own.
fn up(cfg: Config, sigs: libc::sigset_t) -> Result<(), String> {
    if cfg.backend_kind()? != BackendKind::LocalProcess {
        in_child("image build and snapshot", || {
            // Into the cache the daemon will read its images from.
            let cache = cfg
                .artifacts
                .cache_dir
                .clone()
                .unwrap_or_else(wiring::cache_dir);
            agent_sandbox::admin::image_build(&[], None, &cache)?;
            agent_sandbox::admin::snapshot_create(&cfg, &cfg.backend, &[], false)
        })?;
    }
    serve(cfg, sigs)
}

/// Run `f` in a forked child and wait for it. Call while single-threaded
/// (the child may then run anything); whatever threads and processes `f`
/// starts end with the child, so the parent stays single-threaded.
fn in_child(what: &str, f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: the process is single-threaded (serve's precondition).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!(
            "fork for {what}: {}",
            std::io::Error::last_os_error()
        ));
    }
    if pid == 0 {
        // SAFETY: signal-mask manipulation in the child; Ctrl-C and
        // SIGTERM should end the build, not wait for it.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
        let code = match f() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("agent-sandbox: {what}: {e}");
                1
            }
        };
        let _ = std::io::stdout().flush();
        // SAFETY: leave the child without running the parent's atexit state.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("wait for {what} (pid {pid}): {e}"));
        }
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(format!("{what} failed (wait status {status:#x})"))
    }
}

/// `agent-sandbox mcp`: forward to a daemon's `/mcp` (`--url`), or host
/// sessions in this process with the `--backend` factory.
fn mcp(a: agent_sandbox::mcp::stdio::McpArgs) -> Result<(), String> {
    use agent_sandbox::mcp::{forward, stdio};
    use agent_sandbox::metrics::Metrics;
    use agent_sandbox::ops::Ops;
    use agent_sandbox::sandbox::{local::LocalProcessFactory, SandboxFactory};
    use std::sync::Arc;
    if let Some(url) = &a.url {
        let key = forward::key_from(a.key_file.as_deref())?;
        return forward::run(url, key.as_deref(), std::io::stdin(), std::io::stdout());
    }
    let cfg = stdio::in_process_config(&a);
    let backend = a
        .backend
        .parse::<BackendKind>()
        .map_err(|e| e.to_string())?;
    let factory: Arc<dyn SandboxFactory> = match backend {
        BackendKind::LocalProcess => {
            log::warn!("backend local-process: commands run on this host WITHOUT isolation");
            let bin = a
                .agent_bin
                .clone()
                .unwrap_or_else(LocalProcessFactory::default_agent_bin);
            Arc::new(
                LocalProcessFactory::new(bin, cfg.state_dir.join("run"))
                    .map_err(|e| e.to_string())?,
            )
        }
        vmm @ (BackendKind::Qemu | BackendKind::Firecracker) => {
            sandbox::production_factory(vmm, &cfg).map_err(|e| e.to_string())?
        }
    };
    let ops = Ops::start(Arc::new(cfg), factory, Arc::new(Metrics::new()))?;
    stdio::main(a, ops)
}
