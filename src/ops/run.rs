//! `POST /v1/run` and the MCP tool `run_code`: one program in a fresh
//! sandbox under limits, the sandbox destroyed after (the seed guide's
//! `executeScript(language, code, limits)`). Both share the validation
//! ([`RunRequest::parse`]) and the run ([`Ops::run`]), so they answer alike.

use super::exec::{self, Captured, ExecEvent};
use super::{EgressMode, EgressPolicy};
use super::{Ops, OpsError, OpsResult, Principal};
use crate::proto::{limits::CPU_PERIOD_US, ExecRequest, ExitStatus, Request, Response, Signal};
use crate::session::limits::{MEM_MIB, VCPUS};
use crate::session::{Manager, SessionOptions};
use serde_json::{json, Map, Value};
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

fn field_error(field: &str, why: impl std::fmt::Display) -> OpsError {
    OpsError::BadRequest(format!("{field}: {why}"))
}

/// Keys of `m` outside `known` are an error naming the first.
fn known_keys(m: &Map<String, Value>, known: &[&str], prefix: &str) -> OpsResult<()> {
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
    pub fn parse(v: &Value, cfg: &crate::config::Config) -> OpsResult<RunRequest> {
        let Some(m) = v.as_object() else {
            return Err(OpsError::BadRequest(
                "the body must be a JSON object".into(),
            ));
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
        let int = |k: &str, default: u64, min: u64, max: u64| -> OpsResult<u64> {
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

/// What a run answers (the same JSON on every front end, [`RunResult::json`]).
pub struct RunResult {
    /// The session made for the run (already destroyed).
    pub sandbox_id: String,
    pub language: Language,
    pub template: String,
    pub status: ExitStatus,
    pub output: Captured,
}

impl RunResult {
    pub fn json(&self) -> Value {
        let st = &self.status;
        let mut v = json!({
            "sandboxId": self.sandbox_id,
            "language": self.language.name(),
            "template": self.template,
            "exitCode": exec::exit_code(st),
            "signal": st.signal.map(Signal::name_of),
            "stdout": String::from_utf8_lossy(&self.output.stdout),
            "stderr": String::from_utf8_lossy(&self.output.stderr),
            "truncated": self.output.truncated,
            "timedOut": st.timed_out,
        });
        for (k, x) in exec::usage_fields(st) {
            v[k] = x;
        }
        v
    }
}

impl Ops {
    /// Runs `r` in a new session of the caller and answers with its
    /// result. Output is kept up to `max_output` bytes (both streams
    /// together; more is dropped and `truncated` set). `stop` is polled
    /// while the program runs: true cancels it (an MCP client's cancel).
    pub fn run(
        &self,
        p: &Principal,
        r: RunRequest,
        max_output: usize,
        stop: &dyn Fn() -> bool,
    ) -> OpsResult<RunResult> {
        let owner = self.owner_for(p, None)?;
        let mgr = &self.mgr;
        let rnd = crate::agent::random_u64()
            .map_err(|e| OpsError::Internal(format!("making a session id: {e}")))?;
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
        let (session, _) = mgr.get_or_create(&owner, &id, opts, true)?;
        let _destroy = Destroy {
            mgr,
            owner: &owner,
            id: id.clone(),
        };
        let _activity = session.activity();
        let wait = self.cfg.create_timeout;
        session
            .call(Request::Ping, wait)?
            .finish()
            .map_err(OpsError::agent("start the sandbox"))?;
        let (interp, file) = r.language.program();
        let path = format!("{CODE_DIR}/{file}");
        super::files::write(&session, &path, r.code.as_bytes(), Some(0o644), wait)?;
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
        let call = session.call(Request::Exec(req.clone()), wait)?;
        let mut running = exec::Running::new(call, "run", None);
        running.audit_as(
            &session,
            self.audit(),
            &req,
            serde_json::json!({"via": "run", "language": r.language.name()}),
        );
        // The guest kills the program at its timeout; this only guards
        // against a guest that never answers.
        let deadline = t0 + Duration::from_millis(r.limits.timeout_ms) + Duration::from_secs(30);
        let mut output = Captured::new(max_output);
        let status = loop {
            if stop() {
                running.cancel();
                mgr.metrics.exec_done("cancelled", t0.elapsed());
                return Err(OpsError::Cancelled("the run was cancelled".into()));
            }
            if Instant::now() > deadline {
                return Err(OpsError::Timeout(format!(
                    "no answer from the sandbox {:?} after the program's timeout",
                    id
                )));
            }
            match running.poll(Duration::from_millis(100)) {
                Ok(Some(ExecEvent::Output { stream, bytes })) => output.push(stream, &bytes),
                Ok(Some(ExecEvent::Exited(st))) => break st,
                Ok(Some(ExecEvent::Background { proc, pid })) => {
                    return Err(OpsError::UnexpectedAnswer(format!(
                        "{:?}",
                        Response::Started { proc, pid }
                    )))
                }
                Ok(_) => {}
                Err(e @ OpsError::Agent { .. }) => {
                    mgr.metrics.exec_done("error", t0.elapsed());
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        };
        mgr.metrics.exec_done(exec::outcome(&status), t0.elapsed());
        Ok(RunResult {
            sandbox_id: id,
            language: r.language,
            template: session.spec.template.clone(),
            status,
            output,
        })
    }
}
