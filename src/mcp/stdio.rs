//! `agent-sandbox mcp`: MCP over stdin/stdout (one JSON-RPC message per
//! line). Runs the whole host in-process (sessions live as long as the
//! process), or with `--url` forwards every message to a running daemon's
//! `/mcp` ([`super::forward`]). Logs go to stderr only: stdout carries
//! protocol messages and nothing else.

use super::jsonrpc::{self, Incoming, RpcError};
use super::server::{Conn, Engine, Sink};
use super::{Host, MAX_MESSAGE};
use crate::config::{default_state_dir, parse_duration, Config};
use crate::ops::{Ops, Principal};
use crossbeam_channel::{Receiver, Sender};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

fn dur(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

#[derive(clap::Args, Debug)]
pub struct McpArgs {
    /// Forward to a running daemon (`http://127.0.0.1:3000`) instead of
    /// running sandboxes in this process. The key comes from --key-file,
    /// AGENT_SANDBOX_API_KEY or the file AGENT_SANDBOX_KEY_FILE names.
    #[arg(long)]
    pub url: Option<String>,
    /// File holding the API key for --url.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// Sandbox backend when running in-process: local-process (no
    /// isolation, development only), qemu, firecracker.
    #[arg(long, default_value = "qemu")]
    pub backend: String,
    /// Guest agent binary for --backend local-process.
    #[arg(long)]
    pub agent_bin: Option<PathBuf>,
    /// State directory (runtime dirs of this process's sandboxes).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    #[arg(long, default_value = "default")]
    pub default_template: String,
    #[arg(long, default_value_t = 16)]
    pub max_sessions: usize,
    #[arg(long, value_parser = dur, default_value = "30m")]
    pub idle_timeout: Duration,
    #[arg(long, value_parser = dur, default_value = "10m")]
    pub exec_timeout: Duration,
}

/// The in-process host's configuration: a private runtime dir under the
/// state dir (never touching what a daemon sharing it is running), no
/// auth (stdio is the caller's own process).
pub fn in_process_config(a: &McpArgs) -> Config {
    let base = a.state_dir.clone().unwrap_or_else(default_state_dir);
    let state_dir = base.join(format!("mcp-{}", std::process::id()));
    Config {
        state_dir,
        key_file: base.join("keys.json"),
        auth: false,
        idle_timeout: a.idle_timeout,
        max_sessions: a.max_sessions,
        default_template: a.default_template.clone(),
        default_exec_timeout: a.exec_timeout,
        ..Config::default()
    }
}

/// Serves MCP on stdio with sessions hosted in this process by `ops`
/// (started with [`Ops::start`], configured by [`in_process_config`]; the
/// composition root builds its sandbox factory from `--backend`, and
/// handles `--url` with [`super::forward`]). Ends at EOF or
/// SIGTERM/SIGINT, destroying every session and the runtime dir.
pub fn main(a: McpArgs, ops: Arc<Ops>) -> Result<(), String> {
    let state_dir = ops.cfg.state_dir.clone();
    let engine = Engine::new(Host::new(ops.clone()));
    // The local user: every scope, as before keys existed.
    let caller = Principal {
        id: "local".into(),
        ..Principal::anonymous()
    };
    // SIGTERM/SIGINT (blocked in every thread by main) end us like EOF.
    let ops2 = ops.clone();
    let dir2 = state_dir.clone();
    let _ = std::thread::Builder::new()
        .name("mcp-signals".into())
        .spawn(move || {
            let sig = wait_signal();
            log::info!("mcp: signal {sig}: destroying sessions");
            ops2.shutdown();
            let _ = std::fs::remove_dir_all(&dir2);
            std::process::exit(0);
        });
    log::info!("mcp: serving on stdio (backend {})", a.backend);
    let r = serve(engine, caller, std::io::stdin(), std::io::stdout());
    ops.shutdown();
    let _ = std::fs::remove_dir_all(&state_dir);
    log::info!("mcp: stdin closed; all sessions destroyed");
    r.map_err(|e| format!("stdio: {e}"))
}

/// Waits for SIGTERM or SIGINT (blocked in every thread by `main`).
pub fn wait_signal() -> i32 {
    // SAFETY: plain libc signal-set manipulation on a local set; sigwait
    // with a valid set and out pointer.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        let mut sig: libc::c_int = 0;
        loop {
            if libc::sigwait(&set, &mut sig) == 0 {
                return sig;
            }
        }
    }
}

/// Messages for the writer thread: one JSON value per line.
struct LineSink {
    tx: Sender<Value>,
    gone: Arc<AtomicBool>,
}

impl Sink for LineSink {
    fn send(&self, msg: &Value) -> bool {
        !self.gone.load(Ordering::Acquire) && self.tx.send(msg.clone()).is_ok()
    }
    fn alive(&self) -> bool {
        !self.gone.load(Ordering::Acquire)
    }
}

fn writer<W: Write>(mut out: W, rx: Receiver<Value>, gone: Arc<AtomicBool>) {
    for v in rx {
        let mut line = serde_json::to_vec(&v).unwrap_or_default();
        line.push(b'\n');
        if out.write_all(&line).and_then(|_| out.flush()).is_err() {
            gone.store(true, Ordering::Release);
            return;
        }
    }
}

/// One line of at most `max` bytes (without the newline). `Ok(None)` at
/// EOF; `Err(n)` for an oversized line, which is skipped whole.
pub fn read_line<R: BufRead>(
    r: &mut R,
    max: usize,
) -> std::io::Result<Option<Result<Vec<u8>, usize>>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(max as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        return Ok(Some(Ok(buf)));
    }
    if buf.len() <= max {
        return Ok(Some(Ok(buf))); // last line without newline
    }
    // Too long: drop everything up to the next newline.
    let mut skipped = buf.len();
    loop {
        let (done, used) = {
            let avail = r.fill_buf()?;
            if avail.is_empty() {
                break;
            }
            match avail.iter().position(|&b| b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, avail.len()),
            }
        };
        r.consume(used);
        skipped += used;
        if done {
            break;
        }
    }
    Ok(Some(Err(skipped)))
}

/// Serves one client on a byte stream pair until its input ends; then
/// stops the calls still running and ends the sessions it created.
pub fn serve<R: Read, W: Write + Send + 'static>(
    engine: Arc<Engine>,
    caller: Principal,
    input: R,
    output: W,
) -> std::io::Result<()> {
    let (tx, rx) = crossbeam_channel::bounded::<Value>(1024);
    let gone = Arc::new(AtomicBool::new(false));
    let g2 = gone.clone();
    let wt = std::thread::Builder::new()
        .name("mcp-stdout".into())
        .spawn(move || writer(output, rx, g2))?;
    let sink = Arc::new(LineSink { tx, gone });
    let conn = Arc::new(Conn::new("stdio", caller));
    let mut calls: Vec<JoinHandle<()>> = Vec::new();
    let mut input = BufReader::with_capacity(64 * 1024, input);
    let result = loop {
        let line = match read_line(&mut input, MAX_MESSAGE) {
            Ok(None) => break Ok(()),
            Ok(Some(l)) => l,
            Err(e) => break Err(e),
        };
        let line = match line {
            Ok(l) => l,
            Err(n) => {
                log::warn!("mcp: dropped a {n}-byte message (limit {MAX_MESSAGE})");
                sink.send(&jsonrpc::error(
                    None,
                    &RpcError::invalid_request(format!(
                        "message exceeds the {MAX_MESSAGE}-byte limit"
                    )),
                ));
                continue;
            }
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let msg = match jsonrpc::parse(&line) {
            Ok(m) => m,
            Err((id, e)) => {
                sink.send(&jsonrpc::error(id.as_ref(), &e));
                continue;
            }
        };
        calls.retain(|h| !h.is_finished());
        match msg {
            // Tool calls can take long: each on its own thread, so that
            // other requests and cancellations keep flowing.
            Incoming::Request { id, method, .. }
                if method == "tools/call" && engine.running() >= super::MAX_INFLIGHT =>
            {
                sink.send(&jsonrpc::error(Some(&id), &Engine::busy_error()));
            }
            Incoming::Request { id, method, params } if method == "tools/call" => {
                let (e, c, s) = (engine.clone(), conn.clone(), sink.clone());
                let h = std::thread::Builder::new()
                    .name("mcp-call".into())
                    .spawn(move || {
                        if let Some(r) = e.request(&c, &id, &method, &params, &*s) {
                            s.send(&r);
                        }
                    });
                match h {
                    Ok(h) => calls.push(h),
                    Err(err) => log::error!("mcp: cannot start a call thread: {err}"),
                }
            }
            m => {
                if let Some(r) = engine.handle(&conn, m, &*sink) {
                    sink.send(&r);
                }
            }
        }
    };
    // The client is gone: nothing it started may outlive it.
    engine.close(&conn, true, true);
    let end = Instant::now() + Duration::from_secs(10);
    for h in calls {
        while !h.is_finished() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
    drop(sink);
    let _ = wt.join();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lines() {
        let data = b"short\r\n0123456789abc\nok\nlast".to_vec();
        let mut r = BufReader::with_capacity(4, &data[..]);
        assert_eq!(read_line(&mut r, 8).unwrap(), Some(Ok(b"short".to_vec())));
        // Too long: skipped whole, reported with its size.
        assert_eq!(read_line(&mut r, 8).unwrap(), Some(Err(14)));
        assert_eq!(read_line(&mut r, 8).unwrap(), Some(Ok(b"ok".to_vec())));
        assert_eq!(read_line(&mut r, 8).unwrap(), Some(Ok(b"last".to_vec())));
        assert_eq!(read_line(&mut r, 8).unwrap(), None);
    }
}
