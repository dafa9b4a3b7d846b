//! `agent-sandbox`: the host daemon and its administration commands.

use agent_sandbox::api::auth::{validate_scopes, KeyStore};
use agent_sandbox::api::Server;
use agent_sandbox::config::{default_state_dir, parse_duration, Config};
use agent_sandbox::sandbox;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
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
        /// Key file (default: <state dir>/keys.json).
        #[arg(long, global = true)]
        key_file: Option<PathBuf>,
    },
    /// What this host has and lacks for running sandboxes, with fixes.
    Doctor {
        #[arg(long, default_value = "qemu")]
        backend: String,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
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
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Make the snapshot of each template that lacks a fresh one.
    Create {
        #[arg(long)]
        template: Vec<String>,
        #[arg(long, default_value = "qemu")]
        backend: String,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Remake even fresh snapshots.
        #[arg(long)]
        force: bool,
    },
}

fn admin_config(state_dir: Option<PathBuf>) -> Config {
    let mut c = Config::default();
    if let Some(d) = state_dir {
        c.key_file = d.join("keys.json");
        c.state_dir = d;
    }
    c
}

fn dur(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// State directory (key file, runtime dirs).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Disable authentication (only on a loopback address).
    #[arg(long)]
    no_auth: bool,
    /// Sandbox backend: local-process (development only, no isolation), qemu, firecracker.
    #[arg(long, default_value = "qemu")]
    backend: String,
    /// Guest agent binary for --backend local-process.
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    #[arg(long, value_parser = dur, default_value = "30m")]
    idle_timeout: Duration,
    #[arg(long, value_parser = dur, default_value = "24h")]
    max_lifetime: Duration,
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// Warm sandboxes kept ready per template.
    #[arg(long, default_value_t = 0)]
    pool_size: usize,
    #[arg(long, default_value = "default")]
    default_template: String,
    #[arg(long, default_value_t = 16)]
    http_workers: usize,
    /// Long-running requests (commands, streams, transfers) in flight at once.
    #[arg(long, default_value_t = 256)]
    max_streams: usize,
    /// Largest JSON body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body: usize,
    /// Largest file transfer in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_file: usize,
    #[arg(long, value_parser = dur, default_value = "10m")]
    exec_timeout: Duration,
    /// Per-key requests per second (token refill rate).
    #[arg(long, default_value_t = 50.0)]
    rate_limit: f64,
    #[arg(long, default_value_t = 100.0)]
    rate_burst: f64,
    #[arg(long, value_parser = dur, default_value = "5s")]
    reap_interval: Duration,
    /// Socket write timeout (clients that stop reading a stream).
    #[arg(long, value_parser = dur, default_value = "60s")]
    write_timeout: Duration,
    /// Browser origin allowed to use /mcp (repeatable; default: none).
    #[arg(long)]
    mcp_allowed_origin: Vec<String>,
    /// Per-session networking: `on` (own namespace, NAT to the uplink,
    /// egress policy) or `off` (VMs have no network).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    network: String,
    /// Interface session traffic leaves by (default: the default route's).
    #[arg(long)]
    uplink: Option<String>,
    /// DNS resolver the sessions' resolvers forward to, `ADDR:PORT`
    /// (repeatable; default: the nameservers of /etc/resolv.conf).
    #[arg(long)]
    dns_upstream: Vec<SocketAddr>,
    /// Prefix of our namespaces, links and nftables table (1-6 of a-z0-9);
    /// two daemons on one host need different ones.
    #[arg(long, default_value = "asbx")]
    net_prefix: String,
    /// Network namespace (path) that plays the host: tests use one whose
    /// only uplink leads to a test network.
    #[arg(long, hide = true)]
    net_host_netns: Option<PathBuf>,
}

/// The `network` part of the config from `serve`'s flags.
fn network_config(a: &ServeArgs) -> Result<Option<agent_sandbox::net::NetConfig>, String> {
    use agent_sandbox::sandbox::wiring;
    if a.network == "off" || a.backend == "local-process" {
        return Ok(None);
    }
    let mut n = agent_sandbox::net::NetConfig {
        prefix: a.net_prefix.clone(),
        host_netns: a.net_host_netns.clone(),
        ..Default::default()
    };
    n.uplink_if = match &a.uplink {
        Some(u) => u.clone(),
        None => wiring::default_uplink()
            .ok_or("no default route to take the uplink from: pass --uplink IF or --network off")?,
    };
    n.dns_upstreams = if a.dns_upstream.is_empty() {
        wiring::host_resolvers()
    } else {
        a.dns_upstream.clone()
    };
    n.validate().map_err(|e| e.to_string())?;
    Ok(Some(n))
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
    },
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
        Cmd::Serve(a) => serve(*a, sigs),
        Cmd::Up(a) => up(*a, sigs),
        Cmd::Keys { cmd, key_file } => keys(cmd, key_file),
        Cmd::Doctor {
            backend,
            state_dir,
            json,
        } => agent_sandbox::admin::doctor(&admin_config(state_dir), &backend, json),
        Cmd::Image {
            cmd: ImageCmd::Build { template, agent },
        } => agent_sandbox::admin::image_build(&template, agent),
        Cmd::Snapshot {
            cmd:
                SnapshotCmd::Create {
                    template,
                    backend,
                    state_dir,
                    force,
                },
        } => agent_sandbox::admin::snapshot_create(
            &admin_config(state_dir),
            &backend,
            &template,
            force,
        ),
        Cmd::Mcp(a) => agent_sandbox::mcp::stdio::main(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-sandbox: {e}");
            ExitCode::FAILURE
        }
    }
}

fn block_shutdown_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-set manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        // Writes to a client that went away must fail, not kill us.
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        set
    }
}

fn serve(a: ServeArgs, sigs: libc::sigset_t) -> Result<(), String> {
    let network = network_config(&a)?;
    let state_dir = a.state_dir.unwrap_or_else(default_state_dir);
    let cfg = Config {
        listen: a.listen,
        key_file: a.key_file.unwrap_or_else(|| state_dir.join("keys.json")),
        state_dir: state_dir.clone(),
        auth: !a.no_auth,
        idle_timeout: a.idle_timeout,
        max_lifetime: a.max_lifetime,
        max_sessions: a.max_sessions,
        pool_size: a.pool_size,
        default_template: a.default_template,
        http_workers: a.http_workers,
        max_streams: a.max_streams,
        max_body: a.max_body,
        max_file: a.max_file,
        default_exec_timeout: a.exec_timeout,
        rate_per_sec: a.rate_limit,
        rate_burst: a.rate_burst,
        reap_interval: a.reap_interval,
        write_timeout: a.write_timeout,
        mcp_allowed_origins: a.mcp_allowed_origin,
        network,
        ..Config::default()
    };
    if !(cfg.rate_per_sec > 0.0 && cfg.rate_burst >= 1.0) {
        return Err("--rate-limit must be > 0 and --rate-burst >= 1".into());
    }
    let factory =
        sandbox::build_factory(&a.backend, a.agent_bin, &cfg).map_err(|e| e.to_string())?;
    let auth = cfg.auth;
    let server = Server::start(cfg, factory)?;
    let keys = &server.ctx.keys;
    println!("agent-sandbox: key file {}", keys.path().display());
    if auth && keys.is_empty() {
        let (rec, token) = keys.create(
            "initial-admin",
            vec!["admin".into(), "exec".into(), "metrics".into()],
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
    let sig = wait_for_signal(&sigs);
    log::info!("signal {sig}: shutting down");
    server.shutdown();
    log::info!("shutdown complete");
    Ok(())
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

fn keys(cmd: KeysCmd, key_file: Option<PathBuf>) -> Result<(), String> {
    let path = key_file.unwrap_or_else(|| default_state_dir().join("keys.json"));
    let store = KeyStore::open(&path)?;
    match cmd {
        KeysCmd::Create {
            name,
            scopes,
            rate,
            burst,
        } => {
            let scopes: Vec<String> = scopes
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
            validate_scopes(&scopes)?;
            let (rec, token) = store.create(&name, scopes, rate, burst)?;
            eprintln!(
                "created key {} ({}) in {}",
                rec.id,
                rec.scopes.join(","),
                path.display()
            );
            println!("{token}");
        }
        KeysCmd::List => {
            println!(
                "{:<16} {:<24} {:<22} {:<8}",
                "ID", "NAME", "SCOPES", "STATE"
            );
            for k in store.list() {
                println!(
                    "{:<16} {:<24} {:<22} {:<8}",
                    k.id,
                    k.name,
                    k.scopes.join(","),
                    if k.revoked { "revoked" } else { "active" }
                );
            }
        }
        KeysCmd::Rotate { id } => {
            let (_, token) = store.rotate(&id)?;
            eprintln!("rotated key {id}; the old secret no longer works");
            println!("{token}");
        }
        KeysCmd::Revoke { id } => {
            store.revoke(&id)?;
            eprintln!("revoked key {id}");
        }
    }
    Ok(())
}

/// `up`: everything `serve` needs on a fresh host, then `serve`.
fn up(a: ServeArgs, sigs: libc::sigset_t) -> Result<(), String> {
    if a.backend != "local-process" {
        agent_sandbox::admin::image_build(&[], None)?;
        let cfg = admin_config(a.state_dir.clone());
        agent_sandbox::admin::snapshot_create(&cfg, &a.backend, &[], false)?;
    }
    serve(a, sigs)
}
