//! One host connection: a reader thread that decodes frames and routes them
//! to per-request mailboxes, and a shared writer every handler sends on.
//!
//! Deadlock rule: the host's reader never writes and always drains, so a
//! blocking write here always completes eventually; handlers may block on
//! the writer, the reader thread only for short error frames.

use super::exec::Running;
use super::mailbox::{ConnShared, Mailbox, Msg, Req, Writer};
use super::Agent;
use crate::proto::{
    self, ErrorBody, ErrorCode, Frame, FrameReader, Hello, Kind, Request, Response,
};
use std::fs::File;
use std::io::{self, BufReader};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

/// Most requests one connection may have in flight.
pub const MAX_INFLIGHT: usize = 4096;

/// Runs one stream until the host goes away. `reader` and `writer` are two
/// handles on the same stream. A hello on an established connection
/// starts a new one on the same stream: virtio-serial has no reliable
/// reset (a restored guest still holds the connection of the host that
/// was attached at snapshot time), so the hello is the reset.
pub fn serve(agent: &Arc<Agent>, reader: File, writer: File) {
    let out = Arc::new(Mutex::new(writer));
    let stream_fd = reader.as_raw_fd();
    let mut frames = FrameReader::new(BufReader::with_capacity(256 * 1024, reader));
    let mut conn = ConnShared::new(Writer::on(out.clone()));
    // Set by a restore hello that asks for a warm-up (see `warm_up_if_idle`).
    let mut warm_up = match handshake(&mut frames, &conn.writer) {
        Ok(w) => w,
        Err(e) => {
            log::info!("connection closed during hello: {e}");
            conn.writer.mark_broken();
            return;
        }
    };
    // One foreground exec is pumped by this thread between frames: the
    // process is spawned and its exit seen here, with no hop to a worker
    // thread on the exec round trip (the hot path).
    let mut inline: Option<Running> = None;
    loop {
        if warm_up && inline.is_none() && frames.get_mut().buffer().is_empty() {
            warm_up = !super::exec::warm_up_if_idle(agent, stream_fd);
        }
        if let Some(run) = inline.as_mut() {
            // Frames already buffered come first; else wait for either.
            let stream_ready = !frames.get_mut().buffer().is_empty() || run.step(Some(stream_fd));
            if run.done() {
                if let Some(r) = inline.take() {
                    r.finish();
                }
            }
            if !stream_ready {
                continue;
            }
        }
        let frame = match frames.read_frame() {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                log::info!("closing connection: {e}");
                if !matches!(e, proto::DecodeError::Io(_) | proto::DecodeError::Truncated) {
                    conn.writer.error(
                        proto::CONNECTION_ID,
                        &ErrorBody::new(ErrorCode::Protocol, e.to_string()),
                    );
                }
                break;
            }
        };
        if frame.kind() == Some(Kind::Hello) {
            log::info!("hello on an established connection: starting a new one");
            offload(agent, &mut inline);
            conn.close();
            conn = ConnShared::new(Writer::on(out.clone()));
            match answer_hello(&frame, &conn.writer) {
                Ok(w) => warm_up = w,
                Err(e) => {
                    log::info!("connection closed during hello: {e}");
                    break;
                }
            }
            continue;
        }
        // A ping (the daemon's "is it up" after creating a session) does
        // not count as the host being busy; any other request does.
        warm_up &= is_ping(&frame);
        if let Some(run) = dispatch(agent, &conn, frame, inline.is_none()) {
            inline = Some(run);
        }
    }
    offload(agent, &mut inline);
    conn.close();
}

fn is_ping(f: &Frame) -> bool {
    f.kind() == Some(Kind::Request)
        && f.payload.len() < 64
        && serde_json::from_slice::<proto::Request>(&f.payload)
            .is_ok_and(|r| matches!(r, proto::Request::Ping))
}

/// Hands the exec this thread pumps to a worker (the connection is ending;
/// the worker sees the close and answers or kills accordingly).
fn offload(agent: &Arc<Agent>, inline: &mut Option<Running>) {
    if let Some(run) = inline.take() {
        agent.pool.execute(Box::new(move || run.run_to_end()));
    }
}

/// Reads and answers the hello; true when it carried a restore fixup that
/// asked for a warm-up.
fn handshake<R: io::Read>(frames: &mut FrameReader<R>, writer: &Writer) -> Result<bool, String> {
    let f = match frames.read_frame() {
        Ok(Some(f)) => f,
        Ok(None) => return Err("closed before hello".into()),
        Err(e) => {
            if !matches!(e, proto::DecodeError::Io(_) | proto::DecodeError::Truncated) {
                writer.error(
                    proto::CONNECTION_ID,
                    &ErrorBody::new(ErrorCode::Protocol, format!("expected hello: {e}")),
                );
            }
            return Err(e.to_string());
        }
    };
    if f.kind() != Some(Kind::Hello) {
        writer.error(
            proto::CONNECTION_ID,
            &ErrorBody::new(ErrorCode::Protocol, "expected hello as the first frame"),
        );
        return Err("first frame was not hello".into());
    }
    answer_hello(&f, writer)
}

/// Negotiates the version, applies a restore fixup the hello carries, and
/// answers (true: the fixup asked for a warm-up). On error the host got an
/// error frame and the connection ends.
fn answer_hello(f: &Frame, writer: &Writer) -> Result<bool, String> {
    let h: Hello = match serde_json::from_slice(&f.payload) {
        Ok(h) => h,
        Err(e) => {
            writer.error(
                proto::CONNECTION_ID,
                &ErrorBody::new(ErrorCode::Protocol, format!("bad hello: {e}")),
            );
            return Err(format!("bad hello: {e}"));
        }
    };
    let version = h.version.min(proto::PROTOCOL_VERSION);
    if version < h.min_version || version < proto::MIN_PROTOCOL_VERSION {
        writer.error(
            proto::CONNECTION_ID,
            &ErrorBody::new(
                ErrorCode::Protocol,
                format!(
                    "no common protocol version: host speaks {}..={}, agent {}..={}",
                    h.min_version,
                    h.version,
                    proto::MIN_PROTOCOL_VERSION,
                    proto::PROTOCOL_VERSION
                ),
            ),
        );
        return Err("version mismatch".into());
    }
    // Before the answer: once the host has it, the guest must already run
    // on the host's clock with a reseeded RNG.
    if let Some(fix) = &h.restored {
        if let Err(mut e) = super::init::restored(fix.unix_time_ns, &fix.entropy_hex) {
            e.message = format!("restore fixup in hello: {}", e.message);
            writer.error(proto::CONNECTION_ID, &e);
            return Err(e.message);
        }
    }
    let reply = Hello {
        version,
        min_version: proto::MIN_PROTOCOL_VERSION,
        nonce: h.nonce,
        software: format!("sandbox-agent/{}", env!("CARGO_PKG_VERSION")),
        capabilities: proto::CAPABILITIES.iter().map(|s| s.to_string()).collect(),
        max_payload: proto::MAX_PAYLOAD as u32,
        restored: None,
    };
    if !writer.json(Kind::Hello, proto::CONNECTION_ID, &reply) {
        return Err("write failed".into());
    }
    Ok(h.restored.is_some_and(|r| r.warm_up))
}

fn conn_error(conn: &ConnShared, code: ErrorCode, msg: String, id: u64) {
    let mut e = ErrorBody::new(code, msg);
    e.id = Some(id);
    conn.writer.error(proto::CONNECTION_ID, &e);
}

/// Handles one frame. A foreground exec started inline (allowed when
/// `inline_free`) is returned for the caller to pump.
fn dispatch(
    agent: &Arc<Agent>,
    conn: &Arc<ConnShared>,
    f: Frame,
    inline_free: bool,
) -> Option<Running> {
    let id = f.header.id;
    let Some(kind) = f.kind() else {
        conn_error(
            conn,
            ErrorCode::UnknownKind,
            format!("unknown frame kind {}", f.header.kind),
            id,
        );
        return None;
    };
    let channel = f.header.channel;
    match kind {
        Kind::Request => return start_request(agent, conn, id, &f.payload, inline_free),
        Kind::Data | Kind::Eof | Kind::Window | Kind::Cancel => {
            let msg = match kind {
                Kind::Data => Msg::Data {
                    channel,
                    bytes: f.payload,
                },
                Kind::Eof => Msg::Eof { channel },
                Kind::Window => {
                    let Ok(b) = <[u8; 4]>::try_from(f.payload.as_slice()) else {
                        conn_error(
                            conn,
                            ErrorCode::Protocol,
                            "window frame payload must be 4 bytes".into(),
                            id,
                        );
                        return None;
                    };
                    Msg::Window {
                        channel,
                        credit: u32::from_le_bytes(b),
                    }
                }
                _ => Msg::Cancel,
            };
            // Frames for finished requests are normal (they crossed the
            // answer on the wire) and are dropped.
            let mb = conn.routes().get(&id).cloned();
            if let Some(mb) = mb {
                mb.send(msg);
            }
        }
        // `serve` handles it: a hello restarts the connection.
        Kind::Hello => {}
        Kind::Response | Kind::Event | Kind::Error => conn_error(
            conn,
            ErrorCode::Protocol,
            format!("{kind:?} frames are sent by the agent, not to it"),
            id,
        ),
    }
    None
}

fn start_request(
    agent: &Arc<Agent>,
    conn: &Arc<ConnShared>,
    id: u64,
    payload: &[u8],
    inline_free: bool,
) -> Option<Running> {
    if id == proto::CONNECTION_ID {
        conn_error(
            conn,
            ErrorCode::Invalid,
            "request id 0 is reserved".into(),
            id,
        );
        return None;
    }
    let req: Request = match serde_json::from_slice(payload) {
        Ok(r) => r,
        Err(e) => {
            // The id is not routed yet, so answering on it cannot confuse
            // another request.
            if !conn.routes().contains_key(&id) {
                conn.writer.error(
                    id,
                    &ErrorBody::new(ErrorCode::Protocol, format!("bad request: {e}")),
                );
            } else {
                conn_error(
                    conn,
                    ErrorCode::DuplicateId,
                    format!("request id {id} is already in flight"),
                    id,
                );
            }
            return None;
        }
    };
    if conn.routes().contains_key(&id) {
        conn_error(
            conn,
            ErrorCode::DuplicateId,
            format!("request id {id} is already in flight"),
            id,
        );
        return None;
    }
    // Requests that only touch in-memory state are answered inline.
    match &req {
        Request::Ping => {
            conn.writer.json(
                Kind::Response,
                id,
                &Response::Pong {
                    uptime_ms: agent.started.elapsed().as_millis() as u64,
                },
            );
            return None;
        }
        Request::ListProcs => {
            conn.writer.json(
                Kind::Response,
                id,
                &Response::Procs {
                    procs: agent.procs.list(),
                },
            );
            return None;
        }
        _ => {}
    }
    let waker = if matches!(req, Request::Exec(_)) {
        match super::sys::Waker::new() {
            Ok(w) => Some(Arc::new(w)),
            Err(e) => {
                conn.writer.error(id, &ErrorBody::from_io(&e, "exec"));
                return None;
            }
        }
    } else {
        None
    };
    let (mailbox, rx) = Mailbox::new(waker.clone());
    {
        let mut routes = conn.routes();
        if routes.contains_key(&id) {
            drop(routes);
            conn_error(
                conn,
                ErrorCode::DuplicateId,
                format!("request id {id} is already in flight"),
                id,
            );
            return None;
        }
        if routes.len() >= MAX_INFLIGHT {
            drop(routes);
            conn.writer.error(
                id,
                &ErrorBody::new(
                    ErrorCode::Unavailable,
                    format!("more than {MAX_INFLIGHT} requests in flight on this connection"),
                ),
            );
            return None;
        }
        routes.insert(id, mailbox.clone());
    }
    let r = Req::new(id, conn.clone(), rx);
    let (req, waker) = match (req, waker) {
        (Request::Exec(e), Some(w)) if inline_free && !e.background => {
            return super::exec::start(agent, r, mailbox, w, e);
        }
        other => other,
    };
    let agent2 = agent.clone();
    agent.pool.execute(Box::new(move || {
        super::handle(&agent2, r, req, mailbox, waker);
    }));
    None
}
