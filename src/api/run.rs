//! `POST /v1/run` and the MCP tool `run_code`: one program in a fresh
//! sandbox under limits, the sandbox destroyed after (the seed guide's
//! `executeScript(language, code, limits)`). Both share the validation
//! ([`RunRequest::parse`]) and the run ([`run`]), so they answer alike.

use super::errors::{ApiError, ApiResult};
use super::rest;
use crate::agent::{ClientError, Inbound};
use crate::ops::{EgressMode, EgressPolicy};
use crate::proto::{channel, limits::CPU_PERIOD_US, ExecRequest, Request, Response, Signal};
use crate::session::limits::{MEM_MIB, VCPUS};
use crate::session::{Manager, SessionOptions};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const DEFAULT_TIMEOUT_MS: u64 = 15_000;
pub const DEFAULT_MAX_MEMORY_MB: u64 = 512;
pub const DEFAULT_CPU_CORES: f64 = 1.0;
/// Smallest `maxMemoryMb`: below it no interpreter starts.
pub const MIN_MEMORY_MB: u64 = 16;
/// Smallest `cpuCores`: the kernel takes no `cpu.max` quota under 1 ms
/// per 100 ms period.
pub const MIN_CPU_CORES: f64 = 0.01;
/// Where the program is written in the sandbox: outside the workspace,
/// so the program finds its working directory empty.
const CODE_DIR: &str = "/tmp/run";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    Node,
    Bash,
}

impl Language {
    pub const NAMES: [&'static str; 3] = ["python", "node", "bash"];

    fn parse(s: &str) -> Option<Language> {
        Some(match s {
            "python" => Language::Python,
            "node" => Language::Node,
            "bash" => Language::Bash,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Node => "node",
            Language::Bash => "bash",
        }
    }

    /// The template a language's run boots from: the one place this is
    /// decided. The developer image carries all three (the seed's guide:
    /// one base snapshot with Python, Node.js and the usual tools); named
    /// as such rather than through `default_template`, which an operator
    /// may point at an image without them.
    pub fn template(self) -> &'static str {
        match self {
            Language::Python | Language::Node | Language::Bash => {
                crate::sandbox::DEVELOPER_TEMPLATE
            }
        }
    }

    /// The interpreter and the file name it runs the code from.
    fn program(self) -> (&'static str, &'static str) {
        match self {
            Language::Python => ("python3", "main.py"),
            Language::Node => ("node", "main.js"),
            Language::Bash => ("bash", "main.sh"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunLimits {
    pub timeout_ms: u64,
    pub max_memory_mb: u64,
    pub cpu_cores: f64,
    pub allow_network: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunRequest {
    pub language: Language,
    pub code: String,
    pub limits: RunLimits,
}

fn field_error(field: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("{field}: {why}"))
}

/// Keys of `m` outside `known` are an error naming the first.
fn known_keys(m: &Map<String, Value>, known: &[&str], prefix: &str) -> ApiResult<()> {
    match m.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(field_error(
            &format!("{prefix}{k}"),
            format!("unknown field (known: {})", known.join(", ")),
        )),
        None => Ok(()),
    }
}

/// The largest `code`: the daemon's request body limit (`max_body`). The
/// body itself may be larger (it is read like a file upload), so a long
/// program is a 400 naming `code`, not a bare 413.
pub fn max_code(cfg: &crate::config::Config) -> usize {
    cfg.max_body
}

impl RunRequest {
    /// Validates a request body (REST) or tool arguments (MCP); every
    /// error is a 400 naming its field.
    pub fn parse(v: &Value, cfg: &crate::config::Config) -> ApiResult<RunRequest> {
        let Some(m) = v.as_object() else {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        };
        known_keys(m, &["language", "code", "limits"], "")?;
        let language = match m.get("language") {
            Some(Value::String(s)) => Language::parse(s).ok_or_else(|| {
                field_error(
                    "language",
                    format!(
                        "unknown language {s:?} (want {})",
                        Language::NAMES.join(", ")
                    ),
                )
            })?,
            None | Some(Value::Null) => return Err(field_error("language", "is required")),
            Some(_) => return Err(field_error("language", "must be a string")),
        };
        let code = match m.get("code") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) => return Err(field_error("code", "is required")),
            Some(_) => return Err(field_error("code", "must be a string")),
        };
        let max = max_code(cfg);
        if code.len() > max {
            return Err(field_error(
                "code",
                format!("{} bytes exceeds the limit of {max} bytes", code.len()),
            ));
        }
        let empty = Map::new();
        let l = match m.get("limits") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(l)) => l,
            Some(_) => return Err(field_error("limits", "must be an object")),
        };
        known_keys(
            l,
            &["timeoutMs", "maxMemoryMb", "cpuCores", "allowNetwork"],
            "limits.",
        )?;
        let int = |k: &str, default: u64, min: u64, max: u64| -> ApiResult<u64> {
            let name = format!("limits.{k}");
            match l.get(k) {
                None | Some(Value::Null) => Ok(default),
                // An integral float counts, as JSON Schema's integer does.
                Some(x) => match x.as_u64().or_else(|| {
                    x.as_f64()
                        .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19)
                        .map(|f| f as u64)
                }) {
                    Some(n) if (min..=max).contains(&n) => Ok(n),
                    _ => Err(field_error(
                        &name,
                        format!("want an integer from {min} to {max}, got {x}"),
                    )),
                },
            }
        };
        let max_timeout = cfg.max_exec_timeout.as_millis() as u64;
        let timeout_ms = int(
            "timeoutMs",
            DEFAULT_TIMEOUT_MS.min(max_timeout),
            1,
            max_timeout,
        )?;
        let max_memory_mb = int(
            "maxMemoryMb",
            DEFAULT_MAX_MEMORY_MB,
            MIN_MEMORY_MB,
            u64::from(*MEM_MIB.end()),
        )?;
        let max_cores = f64::from(*VCPUS.end());
        let cpu_cores = match l.get("cpuCores") {
            None | Some(Value::Null) => DEFAULT_CPU_CORES,
            Some(x) => match x.as_f64() {
                Some(c) if (MIN_CPU_CORES..=max_cores).contains(&c) => c,
                _ => {
                    return Err(field_error(
                        "limits.cpuCores",
                        format!("want a number from {MIN_CPU_CORES} to {max_cores}, got {x}"),
                    ))
                }
            },
        };
        let allow_network = match l.get("allowNetwork") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(field_error(
                    "limits.allowNetwork",
                    format!("want true or false, got {x}"),
                ))
            }
        };
        Ok(RunRequest {
            language,
            code,
            limits: RunLimits {
                timeout_ms,
                max_memory_mb,
                cpu_cores,
                allow_network,
            },
        })
    }
}

/// Removes the run's session however the run ends (error, timeout, a
/// client that went away): the registry drops it at once, its sandbox is
/// destroyed by the session's thread.
struct Destroy<'a> {
    mgr: &'a Manager,
    owner: &'a str,
    id: String,
}

impl Drop for Destroy<'_> {
    fn drop(&mut self) {
        self.mgr.remove(self.owner, &self.id, "run finished", false);
    }
}

/// Runs `r` in a new session of `owner` and answers with its result.
/// Output is kept up to `max_output` bytes (both streams together; more is
/// dropped and `truncated` set). `stop` is polled while the program runs:
/// true cancels it (an MCP client's cancel).
pub fn run(
    mgr: &Arc<Manager>,
    owner: &str,
    r: RunRequest,
    max_output: usize,
    stop: &dyn Fn() -> bool,
) -> ApiResult<Value> {
    let cfg = mgr.cfg.clone();
    let rnd = crate::agent::random_u64()
        .map_err(|e| ApiError::internal(format!("making a session id: {e}")))?;
    let id = format!("run-{:012x}", rnd & 0xffff_ffff_ffff);
    // No network: mode none. Allowed: the daemon's default policy.
    let egress = (!r.limits.allow_network).then(|| EgressPolicy {
        mode: EgressMode::None,
        ..Default::default()
    });
    let opts = SessionOptions {
        template: Some(r.language.template().to_string()),
        egress,
        ..Default::default()
    };
    let (session, _) = mgr.get_or_create(owner, &id, opts, true)?;
    let _destroy = Destroy {
        mgr,
        owner,
        id: id.clone(),
    };
    let _activity = session.activity();
    let wait = cfg.create_timeout;
    session
        .call(Request::Ping, wait)?
        .finish()
        .map_err(|e| ApiError::from_agent(e, "start the sandbox"))?;
    let (interp, file) = r.language.program();
    let path = format!("{CODE_DIR}/{file}");
    rest::write_file(&session, &path, r.code.as_bytes(), Some(0o644), wait)?;
    let req = ExecRequest {
        argv: vec![interp.to_string(), path],
        env: session.env_for(&Default::default()),
        cwd: None,
        timeout_ms: Some(r.limits.timeout_ms),
        memory_max: Some(r.limits.max_memory_mb << 20),
        cpu_max_us: Some((r.limits.cpu_cores * CPU_PERIOD_US as f64).round() as u64),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut call = session.call(Request::Exec(req), wait)?;
    // The guest kills the program at its timeout; this only guards
    // against a guest that never answers.
    let deadline = t0 + Duration::from_millis(r.limits.timeout_ms) + Duration::from_secs(30);
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut truncated = false;
    let status = loop {
        if stop() {
            let _ = call.cancel();
            mgr.metrics.exec_done("cancelled", t0.elapsed());
            return Err(ApiError::new(409, "cancelled", "the run was cancelled"));
        }
        if Instant::now() > deadline {
            return Err(ApiError::new(
                504,
                "timeout",
                format!(
                    "no answer from the sandbox {:?} after the program's timeout",
                    id
                ),
            ));
        }
        match call.recv_timeout(Duration::from_millis(100)) {
            Ok(None) => {}
            Ok(Some(Inbound::Data { channel: ch, bytes })) => {
                let room = max_output.saturating_sub(stdout.len() + stderr.len());
                let buf = if ch == channel::STDERR {
                    &mut stderr
                } else {
                    &mut stdout
                };
                if bytes.len() > room {
                    truncated = true;
                }
                buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
            }
            Ok(Some(Inbound::Response(Response::Exited(st)))) => break st,
            Ok(Some(Inbound::Response(other))) => {
                return Err(ApiError::new(
                    502,
                    "agent_error",
                    format!("unexpected answer {other:?}"),
                ))
            }
            Ok(Some(Inbound::Error(e))) => {
                mgr.metrics.exec_done("error", t0.elapsed());
                return Err(ApiError::from_agent(ClientError::Agent(e), "run"));
            }
            Ok(Some(_)) => {}
            Err(e) => {
                mgr.metrics.exec_done("error", t0.elapsed());
                return Err(ApiError::from_agent(e, "run"));
            }
        }
    };
    mgr.metrics
        .exec_done(super::exec::outcome(&status), t0.elapsed());
    let mut v = json!({
        "sandboxId": id,
        "language": r.language.name(),
        "template": session.spec.template,
        "exitCode": super::exec::exit_code(&status),
        "signal": status.signal.map(Signal::name_of),
        "stdout": String::from_utf8_lossy(&stdout),
        "stderr": String::from_utf8_lossy(&stderr),
        "truncated": truncated,
        "timedOut": status.timed_out,
    });
    for (k, x) in super::exec::usage_fields(&status) {
        v[k] = x;
    }
    Ok(v)
}
