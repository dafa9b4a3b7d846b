//! Command answers for the API: buffered JSON and live streams (NDJSON /
//! SSE) of a running call from the operations layer ([`crate::ops::exec`]:
//! validation, the start, the typed events).

use super::errors::ApiError;
use super::http::{Reply, StreamWriter};
use super::Ctx;
pub use crate::ops::exec::{encoding, Encoding};
use crate::ops::exec::{outcome, usage_fields, ExecEvent, Running, Started, Stream};
use crate::ops::now_unix_ms;
use crate::ops::OpsError;
use crate::proto::{ExitStatus, Signal};
use crate::server::http::Shape;
use base64::Engine;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    pub fn chunk(&mut self, stream: Stream, bytes: &[u8]) -> Option<Value> {
        let data = match self.enc {
            Encoding::Base64 => base64::engine::general_purpose::STANDARD.encode(bytes),
            Encoding::Utf8 => match stream {
                Stream::Stderr => self.err.push(bytes),
                Stream::Stdout => self.out.push(bytes),
            },
        };
        if data.is_empty() {
            return None;
        }
        Some(entry(stream, data, self.enc))
    }

    pub fn flush(&mut self) -> Vec<Value> {
        let mut v = Vec::new();
        for (stream, c) in [
            (Stream::Stdout, &mut self.out),
            (Stream::Stderr, &mut self.err),
        ] {
            let s = c.flush();
            if !s.is_empty() {
                v.push(entry(stream, s, self.enc));
            }
        }
        v
    }
}

fn entry(stream: Stream, data: String, enc: Encoding) -> Value {
    let mut v = json!({"stream": stream.name(), "data": data, "ts": now_unix_ms()});
    if enc == Encoding::Base64 {
        v["encoding"] = json!("base64");
    }
    v
}

/// The result fields shared by the buffered answer and the stream's last
/// line. `duration` is the host's wall time of the call; `durationMs`,
/// `resourceUsage` and `oomKilled` are the command's own, as the guest
/// measured them ([`usage_fields`]).
pub fn result_fields(st: &ExitStatus, took: Duration) -> Value {
    let mut v = json!({
        "exitCode": crate::ops::exec::exit_code(st),
        "signal": st.signal.map(Signal::name_of),
        "timedOut": st.timed_out,
        "duration": took.as_millis() as u64,
    });
    for (k, x) in usage_fields(st) {
        v[k] = x;
    }
    v
}

/// Runs a started foreground call to completion and answers with all its
/// output (bounded).
pub fn buffered(ctx: Arc<Ctx>, started: Started) -> Reply {
    let Started {
        mut running,
        encoding,
        timeout,
        ..
    } = started;
    let t0 = Instant::now();
    let deadline = t0 + timeout + Duration::from_secs(30);
    let mut enc = OutputEncoder::new(encoding);
    let mut output = Vec::new();
    let mut size = 0usize;
    let mut truncated = false;
    let mut proc_id = None;
    let r = loop {
        match running.next(Some(deadline)) {
            Ok(ExecEvent::Output { stream, bytes }) => {
                if size + bytes.len() > ctx.cfg.max_output {
                    truncated = true;
                    continue;
                }
                size += bytes.len();
                if let Some(v) = enc.chunk(stream, &bytes) {
                    output.push(v);
                }
            }
            Ok(ExecEvent::Started { proc, .. }) => proc_id = Some(proc),
            Ok(ExecEvent::Exited(st)) => break Ok(st),
            Ok(ExecEvent::Background { proc, pid }) => {
                drop(running);
                return Reply::Json(202, json!({"procId": proc, "pid": pid}));
            }
            Ok(ExecEvent::Dropped { .. }) => {}
            Err(e) => break Err(ApiError::from(e)),
        }
    };
    drop(running);
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
    running: Running,
    w: &mut StreamWriter,
    fmt: StreamFormat,
    enc_kind: Encoding,
    timeout: Option<Duration>,
) {
    let shape = w.shape;
    relay_to(
        ctx,
        running,
        &mut |v| emit(w, fmt, v),
        shape,
        enc_kind,
        timeout,
    )
}

/// [`relay`] to any sink of events (`emit` returns false once its client
/// is gone): the NDJSON/SSE stream, a WebSocket. One set of event objects
/// for every transport.
pub fn relay_to(
    ctx: &Ctx,
    mut running: Running,
    emit: &mut dyn FnMut(&Value) -> bool,
    shape: Shape,
    enc_kind: Encoding,
    timeout: Option<Duration>,
) {
    let t0 = Instant::now();
    let deadline = timeout.map(|t| t0 + t + Duration::from_secs(30));
    let mut enc = OutputEncoder::new(enc_kind);
    loop {
        let ok = match running.next(deadline) {
            Ok(ExecEvent::Output { stream, bytes }) => match enc.chunk(stream, &bytes) {
                Some(mut v) => {
                    v["type"] = json!("stream");
                    emit(&v)
                }
                None => true,
            },
            Ok(ExecEvent::Started { proc, pid }) => {
                emit(&json!({"type": "started", "procId": proc, "pid": pid}))
            }
            Ok(ExecEvent::Dropped { bytes }) => emit(&json!({"type": "dropped", "bytes": bytes})),
            Ok(ExecEvent::Exited(st)) => {
                for mut v in enc.flush() {
                    v["type"] = json!("stream");
                    emit(&v);
                }
                ctx.metrics.exec_done(outcome(&st), t0.elapsed());
                let mut v = result_fields(&st, t0.elapsed());
                v["type"] = json!("result");
                emit(&v);
                return;
            }
            Ok(ExecEvent::Background { proc, pid }) => {
                emit(&json!({"type": "started", "procId": proc, "pid": pid}));
                return;
            }
            // An answer that fits no command ends the stream quietly.
            Err(OpsError::UnexpectedAnswer(_)) => return,
            Err(e) => {
                let e = ApiError::from(e);
                ctx.metrics.exec_done("error", t0.elapsed());
                let mut v = e.body_as(shape);
                v["type"] = json!("error");
                emit(&v);
                return;
            }
        };
        if !ok {
            log::debug!("stream client went away; cancelling call {}", running.id());
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
