//! Daemon configuration: every tunable of `serve`, with defaults that suit a
//! single host. The CLI (`main.rs`) fills it; tests build it directly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    pub default_template: String,
    /// Threads answering ordinary (non-streaming) requests.
    pub http_workers: usize,
    /// Streaming responses in flight at once; each holds one thread.
    pub max_streams: usize,
    /// Largest JSON request body.
    pub max_body: usize,
    /// Largest raw file upload / download.
    pub max_file: usize,
    /// Output kept for a buffered (non-streaming) exec answer.
    pub max_output: usize,
    pub default_exec_timeout: Duration,
    pub max_exec_timeout: Duration,
    /// Socket write timeout: a client that stops reading is dropped.
    pub write_timeout: Duration,
    /// How long an API thread waits for a session to start.
    pub create_timeout: Duration,
    /// Per-key token bucket: sustained requests per second and burst.
    pub rate_per_sec: f64,
    pub rate_burst: f64,
    pub reap_interval: Duration,
    pub default_vcpus: u32,
    pub default_mem_mib: u32,
    pub default_disk_mib: u32,
    /// `Origin` values the MCP endpoint accepts (browsers); empty = none.
    pub mcp_allowed_origins: Vec<String>,
    /// Per-session networking (namespace, veth, TAP, NAT, egress policy);
    /// `None`: VMs boot without a network device.
    pub network: Option<crate::net::NetConfig>,
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
            default_template: "default".into(),
            http_workers: 16,
            max_streams: 256,
            max_body: 1 << 20,
            max_file: 64 << 20,
            max_output: 16 << 20,
            default_exec_timeout: Duration::from_secs(600),
            max_exec_timeout: Duration::from_secs(24 * 3600),
            write_timeout: Duration::from_secs(60),
            create_timeout: Duration::from_secs(60),
            rate_per_sec: 50.0,
            rate_burst: 100.0,
            reap_interval: Duration::from_secs(5),
            default_vcpus: 1,
            default_mem_mib: 256,
            default_disk_mib: 1024,
            mcp_allowed_origins: Vec::new(),
            network: None,
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
