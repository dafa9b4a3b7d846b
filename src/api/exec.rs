//! Running commands for the API: request validation, buffered answers and
//! live streams (NDJSON / SSE).

use super::errors::{ApiError, ApiResult};
use super::http::{Reply, StreamWriter};
use super::validate;
use super::Ctx;
use crate::agent::{Call, Inbound};
use crate::proto::{channel, Event, ExecRequest, ExitStatus, PtySize, Request, Response, Signal};
use crate::session::{now_unix_ms, Activity, Session};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Body of `POST /exec/:id/execute` and `POST /v1/sessions/:id/exec`.
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ExecBody {
    pub template: Option<String>,
    /// With `args`: the program. Alone: a `/bin/sh -c` command line.
    pub command: Option<String>,
    pub args: Option<Vec<String>>,
    /// Program and arguments, instead of `command`.
    pub argv: Option<Vec<String>>,
    pub cwd: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    /// Milliseconds; the process group is killed after it.
    pub timeout: Option<u64>,
    /// Text fed to stdin, then EOF.
    pub stdin: Option<String>,
    pub stdin_base64: Option<String>,
    pub pty: Option<PtySize>,
    pub background: Option<bool>,
    pub tag: Option<String>,
    /// `utf8` (default; invalid bytes replaced) or `base64`.
    pub encoding: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Utf8,
    Base64,
}

pub fn encoding(s: Option<&str>) -> ApiResult<Encoding> {
    match s {
        None | Some("utf8") | Some("utf-8") => Ok(Encoding::Utf8),
        Some("base64") => Ok(Encoding::Base64),
        Some(o) => Err(ApiError::bad_request(format!(
            "encoding {o:?}: want utf8 or base64"
        ))),
    }
}

pub struct Prepared {
    pub req: ExecRequest,
    pub stdin: Option<Vec<u8>>,
    pub encoding: Encoding,
    pub timeout: Duration,
}

impl ExecBody {
    pub fn prepare(self, ctx: &Ctx) -> ApiResult<Prepared> {
        let (argv, shell) = match (self.argv, self.command, self.args) {
            (Some(_), Some(_), _) => {
                return Err(ApiError::bad_request(
                    "give either argv or command, not both",
                ))
            }
            (Some(argv), None, None) => {
                if argv.is_empty() {
                    return Err(ApiError::bad_request("argv must not be empty"));
                }
                (argv, None)
            }
            (Some(_), None, Some(_)) => {
                return Err(ApiError::bad_request("args goes with command, not argv"))
            }
            (None, Some(cmd), Some(args)) => {
                let mut argv = vec![cmd];
                argv.extend(args);
                (argv, None)
            }
            (None, Some(cmd), None) => (Vec::new(), Some(cmd)),
            (None, None, _) => return Err(ApiError::bad_request("command (or argv) is required")),
        };
        if argv.first().is_some_and(|a| a.is_empty()) || shell.as_deref() == Some("") {
            return Err(ApiError::bad_request("command must not be empty"));
        }
        if argv.len() > crate::proto::limits::MAX_ARGS {
            return Err(ApiError::bad_request("too many arguments"));
        }
        for a in argv.iter().chain(shell.iter()) {
            if a.contains('\0') {
                return Err(ApiError::bad_request(
                    "arguments must not contain NUL bytes",
                ));
            }
        }
        let env = validate::env(self.env.unwrap_or_default())?;
        if let Some(cwd) = &self.cwd {
            validate::path(cwd, "cwd")?;
        }
        let timeout_ms = match self.timeout {
            Some(0) => return Err(ApiError::bad_request("timeout must be at least 1 ms")),
            Some(t) => t,
            None => ctx.cfg.default_exec_timeout.as_millis() as u64,
        };
        let max = ctx.cfg.max_exec_timeout.as_millis() as u64;
        if timeout_ms > max {
            return Err(ApiError::bad_request(format!(
                "timeout {timeout_ms} ms exceeds the maximum of {max} ms"
            )));
        }
        let stdin = match (self.stdin, self.stdin_base64) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request("give stdin or stdinBase64, not both"))
            }
            (Some(s), None) => Some(s.into_bytes()),
            (None, Some(b)) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(b.as_bytes())
                    .map_err(|e| ApiError::bad_request(format!("stdinBase64: {e}")))?,
            ),
            (None, None) => None,
        };
        if let Some(p) = &self.pty {
            if p.rows == 0 || p.cols == 0 {
                return Err(ApiError::bad_request("pty rows and cols must be positive"));
            }
        }
        if let Some(t) = &self.tag {
            if t.len() > 256 {
                return Err(ApiError::bad_request("tag longer than 256 bytes"));
            }
        }
        let background = self.background.unwrap_or(false);
        #[allow(clippy::needless_update)] // see `..Default::default()` below
        let req = ExecRequest {
            argv,
            shell,
            env,
            clear_env: false,
            cwd: self.cwd,
            uid: None,
            gid: None,
            stdin: stdin.is_some() || background,
            pty: self.pty,
            timeout_ms: if background && self.timeout.is_none() {
                None
            } else {
                Some(timeout_ms)
            },
            background,
            tag: self.tag,
            // Streams and answers report the process id.
            notify_start: true,
            memory_max: None,
            cpu_max_us: None,
        };
        Ok(Prepared {
            req,
            stdin,
            encoding: encoding(self.encoding.as_deref())?,
            timeout: Duration::from_millis(timeout_ms),
        })
    }
}

/// Starts the command and feeds its stdin.
pub fn start(ctx: &Ctx, session: &Arc<Session>, p: &Prepared) -> ApiResult<Call> {
    let call = session.call(Request::Exec(p.req.clone()), ctx.cfg.create_timeout)?;
    if let Some(data) = &p.stdin {
        let tx = call.sender();
        let data = data.clone();
        // Fed from its own thread: a process that does not read its stdin
        // must not stop us from reading its output.
        let _ = std::thread::Builder::new()
            .name("exec-stdin".into())
            .spawn(move || {
                if tx.send_all(&data).is_ok() {
                    let _ = tx.send_eof();
                }
            });
    }
    Ok(call)
}

/// Turns chunks into text without splitting a UTF-8 sequence across
/// chunk boundaries.
#[derive(Default)]
pub struct Utf8Carry {
    carry: Vec<u8>,
}

impl Utf8Carry {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(bytes);
        let keep = match std::str::from_utf8(&buf) {
            Ok(_) => 0,
            // An incomplete sequence at the very end: hold it back.
            Err(e) if e.error_len().is_none() => buf.len() - e.valid_up_to(),
            Err(_) => {
                // Invalid bytes inside: find an incomplete tail, if any.
                let tail_start = buf.len().saturating_sub(3);
                (tail_start..buf.len())
                    .find(|&i| {
                        matches!(std::str::from_utf8(&buf[i..]), Err(e) if e.error_len().is_none() && e.valid_up_to() == 0)
                    })
                    .map_or(0, |i| buf.len() - i)
            }
        };
        self.carry = buf.split_off(buf.len() - keep);
        String::from_utf8_lossy(&buf).into_owned()
    }

    pub fn flush(&mut self) -> String {
        let b = std::mem::take(&mut self.carry);
        String::from_utf8_lossy(&b).into_owned()
    }
}

fn stream_name(ch: u16) -> &'static str {
    if ch == channel::STDERR {
        "stderr"
    } else {
        "stdout"
    }
}

/// Encodes output chunks per stream.
pub struct OutputEncoder {
    enc: Encoding,
    out: Utf8Carry,
    err: Utf8Carry,
}

impl OutputEncoder {
    pub fn new(enc: Encoding) -> Self {
        OutputEncoder {
            enc,
            out: Utf8Carry::default(),
            err: Utf8Carry::default(),
        }
    }

    /// `(stream, data)` ready to put into JSON; `None` if nothing to show yet.
    pub fn chunk(&mut self, ch: u16, bytes: &[u8]) -> Option<Value> {
        let data = match self.enc {
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
            Encoding::Utf8 => {
                let c = if ch == channel::STDERR {
                    &mut self.err
                } else {
                    &mut self.out
                };
                c.push(bytes)
            }
        };
        if data.is_empty() {
            return None;
        }
        Some(entry(ch, data, self.enc))
    }

    pub fn flush(&mut self) -> Vec<Value> {
        let mut v = Vec::new();
        for (ch, c) in [
            (channel::STDOUT, &mut self.out),
            (channel::STDERR, &mut self.err),
        ] {
            let s = c.flush();
            if !s.is_empty() {
                v.push(entry(ch, s, self.enc));
            }
        }
        v
    }
}

fn entry(ch: u16, data: String, enc: Encoding) -> Value {
    let mut v = json!({"stream": stream_name(ch), "data": data, "ts": now_unix_ms()});
    if enc == Encoding::Base64 {
        v["encoding"] = json!("base64");
    }
    v
}

pub fn outcome(st: &ExitStatus) -> &'static str {
    if st.timed_out {
        "timeout"
    } else if st.signal.is_some() {
        "signal"
    } else if st.code == Some(0) {
        "ok"
    } else {
        "nonzero"
    }
}

/// The exit code a shell would show: 128 + the signal for a killed command.
pub fn exit_code(st: &ExitStatus) -> i32 {
    st.code.or(st.signal.map(|s| 128 + s)).unwrap_or(-1)
}

/// The result fields shared by the buffered answer and the stream's last
/// line. `duration` is the host's wall time of the call; `durationMs`,
/// `resourceUsage` and `oomKilled` are the command's own, as the guest
/// measured them ([`usage_fields`]).
pub fn result_fields(st: &ExitStatus, took: Duration) -> Value {
    let mut v = json!({
        "exitCode": exit_code(st),
        "signal": st.signal.map(Signal::name_of),
        "timedOut": st.timed_out,
        "duration": took.as_millis() as u64,
    });
    for (k, x) in usage_fields(st) {
        v[k] = x;
    }
    v
}

/// `durationMs` (the command's run time in the guest, spawn to exit),
/// `resourceUsage: {memoryMb, cpuPercent}` (null from an agent that does
/// not measure) and `oomKilled`: every API's exec result carries these.
/// `memoryMb` is the peak in MiB; `cpuPercent` is CPU time over run time
/// (above 100 for a command using more than one core).
pub fn usage_fields(st: &ExitStatus) -> [(&'static str, Value); 3] {
    let usage = st.usage.map(|u| {
        let mb = u.memory_peak_bytes as f64 / (1024.0 * 1024.0);
        let pct = u.cpu_usec as f64 * 100.0 / st.duration_us.max(1) as f64;
        json!({
            "memoryMb": (mb * 10.0).round() / 10.0,
            "cpuPercent": (pct * 10.0).round() / 10.0,
            "source": u.source,
        })
    });
    [
        ("durationMs", json!(st.duration_us / 1000)),
        ("resourceUsage", usage.unwrap_or(Value::Null)),
        ("oomKilled", json!(st.oom_killed)),
    ]
}

/// Runs a started foreground call to completion and answers with all its
/// output (bounded).
pub fn buffered(ctx: Arc<Ctx>, mut call: Call, p: Prepared, activity: Activity) -> Reply {
    let t0 = Instant::now();
    let deadline = t0 + p.timeout + Duration::from_secs(30);
    let mut enc = OutputEncoder::new(p.encoding);
    let mut output = Vec::new();
    let mut size = 0usize;
    let mut truncated = false;
    let mut proc_id = None;
    let r = loop {
        match call.recv_deadline(deadline) {
            Ok(Inbound::Data { channel, bytes }) => {
                if size + bytes.len() > ctx.cfg.max_output {
                    truncated = true;
                    continue;
                }
                size += bytes.len();
                if let Some(v) = enc.chunk(channel, &bytes) {
                    output.push(v);
                }
            }
            Ok(Inbound::Event(Event::Started { proc, .. })) => proc_id = Some(proc),
            Ok(Inbound::Response(Response::Exited(st))) => break Ok(st),
            Ok(Inbound::Response(Response::Started { proc, pid })) => {
                drop(activity);
                return Reply::Json(202, json!({"procId": proc, "pid": pid}));
            }
            Ok(Inbound::Response(r)) => {
                break Err(ApiError::new(
                    502,
                    "agent_error",
                    format!("unexpected answer {r:?}"),
                ))
            }
            Ok(Inbound::Error(e)) => {
                break Err(ApiError::from_agent(
                    crate::agent::ClientError::Agent(e),
                    "exec",
                ))
            }
            Ok(_) => {}
            Err(e) => break Err(ApiError::from_agent(e, "exec")),
        }
    };
    drop(activity);
    match r {
        Ok(st) => {
            output.extend(enc.flush());
            ctx.metrics.exec_done(outcome(&st), t0.elapsed());
            let mut v = result_fields(&st, t0.elapsed());
            v["output"] = Value::Array(output);
            v["truncated"] = json!(truncated);
            if let Some(p) = proc_id {
                v["procId"] = json!(p);
            }
            Reply::Json(200, v)
        }
        Err(e) => {
            ctx.metrics.exec_done("error", t0.elapsed());
            ctx.metrics.error("exec");
            e.into()
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum StreamFormat {
    Ndjson,
    Sse,
}

impl StreamFormat {
    pub fn content_type(self) -> &'static str {
        match self {
            StreamFormat::Ndjson => "application/x-ndjson",
            StreamFormat::Sse => "text/event-stream",
        }
    }
}

/// Writes one event in the stream's format.
pub fn emit(w: &mut StreamWriter, fmt: StreamFormat, v: &Value) -> bool {
    let line = serde_json::to_string(v).unwrap_or_default();
    match fmt {
        StreamFormat::Ndjson => w.send(format!("{line}\n").as_bytes()),
        StreamFormat::Sse => {
            let ty = v.get("type").and_then(Value::as_str).unwrap_or("message");
            w.send(format!("event: {ty}\ndata: {line}\n\n").as_bytes())
        }
    }
}

/// Relays a call (exec or attach) live. Returning early drops the call,
/// which cancels it in the guest (a client that goes away kills its
/// foreground command).
pub fn relay(
    ctx: &Ctx,
    mut call: Call,
    w: &mut StreamWriter,
    fmt: StreamFormat,
    enc_kind: Encoding,
    timeout: Option<Duration>,
) {
    let t0 = Instant::now();
    let deadline = timeout.map(|t| t0 + t + Duration::from_secs(30));
    let mut enc = OutputEncoder::new(enc_kind);
    loop {
        let m = match deadline {
            Some(d) => call.recv_deadline(d),
            None => call.recv(),
        };
        let ok = match m {
            Ok(Inbound::Data { channel, bytes }) => match enc.chunk(channel, &bytes) {
                Some(mut v) => {
                    v["type"] = json!("stream");
                    emit(w, fmt, &v)
                }
                None => true,
            },
            Ok(Inbound::Event(Event::Started { proc, pid })) => emit(
                w,
                fmt,
                &json!({"type": "started", "procId": proc, "pid": pid}),
            ),
            Ok(Inbound::Event(Event::Dropped { bytes })) => {
                emit(w, fmt, &json!({"type": "dropped", "bytes": bytes}))
            }
            Ok(Inbound::Response(Response::Exited(st))) => {
                for mut v in enc.flush() {
                    v["type"] = json!("stream");
                    emit(w, fmt, &v);
                }
                ctx.metrics.exec_done(outcome(&st), t0.elapsed());
                let mut v = result_fields(&st, t0.elapsed());
                v["type"] = json!("result");
                emit(w, fmt, &v);
                return;
            }
            Ok(Inbound::Response(Response::Started { proc, pid })) => {
                emit(
                    w,
                    fmt,
                    &json!({"type": "started", "procId": proc, "pid": pid}),
                );
                return;
            }
            Ok(Inbound::Response(_)) => return,
            Ok(Inbound::Error(e)) => {
                let e = ApiError::from_agent(crate::agent::ClientError::Agent(e), "exec");
                ctx.metrics.exec_done("error", t0.elapsed());
                let mut v = e.body_as(w.shape);
                v["type"] = json!("error");
                emit(w, fmt, &v);
                return;
            }
            Ok(_) => true,
            Err(e) => {
                let e = ApiError::from_agent(e, "exec");
                ctx.metrics.exec_done("error", t0.elapsed());
                let mut v = e.body_as(w.shape);
                v["type"] = json!("error");
                emit(w, fmt, &v);
                return;
            }
        };
        if !ok {
            log::debug!("stream client went away; cancelling call {}", call.id);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_chunks() {
        let mut c = Utf8Carry::default();
        let s = "héllo €".as_bytes();
        let mut out = String::new();
        for b in s {
            out.push_str(&c.push(&[*b]));
        }
        out.push_str(&c.flush());
        assert_eq!(out, "héllo €");
        let mut c = Utf8Carry::default();
        assert_eq!(c.push(&[0xff, b'a']), "\u{fffd}a");
    }
}
