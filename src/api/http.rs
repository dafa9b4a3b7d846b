//! REST plumbing over our server (`httpd`): URL and query parsing, bounded
//! bodies, replies. Chunked streaming and headers are the server's
//! ([`crate::server::http`]), re-exported here for the handlers.

use super::errors::{ApiError, ApiResult, Shape};
use super::httpd::Request;
use crate::budget::{self, Lease};
use std::collections::HashMap;
use std::io::Read;

pub use crate::server::http::{header, StreamWriter};

/// Captured path parameters and the query.
pub struct Params {
    pub path: HashMap<&'static str, String>,
    pub query: HashMap<String, String>,
}

impl Params {
    pub fn get(&self, name: &str) -> &str {
        self.path.get(name).map_or("", String::as_str)
    }
    pub fn query(&self, name: &str) -> Option<&str> {
        self.query.get(name).map(String::as_str)
    }
    /// A boolean query flag (`true/1/yes`, `false/0/no`).
    pub fn flag(&self, name: &str, default: bool) -> ApiResult<bool> {
        match self.query(name) {
            None => Ok(default),
            Some("true" | "1" | "yes" | "") => Ok(true),
            Some("false" | "0" | "no") => Ok(false),
            Some(v) => Err(ApiError::bad_request(format!(
                "query parameter {name}={v:?}: want true or false"
            ))),
        }
    }
}

/// What a handler answers.
pub enum Reply {
    Json(u16, serde_json::Value),
    /// Rendered when sent, in the shape of the API the request addressed
    /// ([`super::errors::Shape`]).
    Error(ApiError),
    Bytes(u16, String, Vec<u8>),
    Empty(u16),
    /// Computed on a separate (bounded) thread, so a long command never
    /// holds one of the API worker threads.
    Later(Box<dyn FnOnce() -> Reply + Send>),
    /// A live stream: the head is written at once, then the job writes
    /// chunks as they come.
    Stream {
        content_type: &'static str,
        /// Extra response headers (name, value).
        headers: Vec<(&'static str, String)>,
        job: Box<dyn FnOnce(&mut StreamWriter) + Send>,
    },
    /// A WebSocket: the 101 (with `accept`, the handshake's key) is
    /// written, then the job speaks the protocol on its own thread.
    Upgrade {
        accept: String,
        job: Box<dyn FnOnce(crate::server::ws::Reader, crate::server::ws::Writer) + Send>,
    },
}

impl From<ApiError> for Reply {
    fn from(e: ApiError) -> Reply {
        Reply::Error(e)
    }
}

impl Reply {
    /// The status of a finished reply (500 for one not yet computed).
    pub fn status(&self) -> u16 {
        match self {
            Reply::Json(s, _) | Reply::Bytes(s, _, _) | Reply::Empty(s) => *s,
            Reply::Error(e) => e.status,
            Reply::Later(_) | Reply::Stream { .. } => 500,
            Reply::Upgrade { .. } => 101,
        }
    }
}

pub fn ok_json(v: serde_json::Value) -> ApiResult<Reply> {
    Ok(Reply::Json(200, v))
}

/// Decodes `%XX` escapes (and `+` as space in queries).
pub fn percent_decode(s: &str, plus_is_space: bool) -> ApiResult<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz");
                let v = u8::from_str_radix(hex, 16)
                    .map_err(|_| ApiError::bad_request(format!("bad %-escape in {s:?}")))?;
                out.push(v);
                i += 3;
            }
            b'%' => return Err(ApiError::bad_request(format!("bad %-escape in {s:?}"))),
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| ApiError::bad_request(format!("{s:?} is not UTF-8")))
}

/// Splits a request target into decoded path segments and query pairs.
pub struct Target {
    pub path: String,
    pub segments: Vec<String>,
    pub query: HashMap<String, String>,
}

pub fn parse_target(url: &str) -> ApiResult<Target> {
    if url.len() > 8192 {
        return Err(ApiError::new(
            414,
            "uri_too_long",
            "request target too long",
        ));
    }
    let (path, q) = url.split_once('?').unwrap_or((url, ""));
    let mut segments = Vec::new();
    for seg in path.split('/').skip(1) {
        segments.push(percent_decode(seg, false)?);
    }
    // `/exec/` and `/exec` are the same route.
    if segments.len() > 1 && segments.last().is_some_and(|s| s.is_empty()) {
        segments.pop();
    }
    let mut query = HashMap::new();
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        query.insert(percent_decode(k, true)?, percent_decode(v, true)?);
    }
    Ok(Target {
        path: path.to_string(),
        segments,
        query,
    })
}

/// Reads the whole body, refusing more than `max` bytes (413).
pub fn read_body(req: &mut Request, max: usize) -> ApiResult<Vec<u8>> {
    if req.body_length().is_some_and(|n| n > max) {
        return Err(too_large(max));
    }
    let mut buf = Vec::new();
    req.as_reader()
        .take(max as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(body_error)?;
    if buf.len() > max {
        return Err(too_large(max));
    }
    Ok(buf)
}

/// A body read failure: a stalled client is a timeout (408).
pub fn body_error(e: std::io::Error) -> ApiError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ApiError::new(
            408,
            "request_timeout",
            "the request body did not arrive in time",
        ),
        _ => ApiError::bad_request(format!("reading request body: {e}")),
    }
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(
        413,
        "body_too_large",
        format!("request body exceeds {max} bytes"),
    )
}

/// Parses a JSON body into `T`. An empty body reads as `{}`.
pub fn json_body<T: serde::de::DeserializeOwned>(req: &mut Request, max: usize) -> ApiResult<T> {
    let body = read_body(req, max)?;
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &body
    };
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

/// Sends a finished reply (`allow`: the `Allow` header of a 405, else
/// the error's own). Write errors mean the client left: nothing to do.
pub fn respond(req: Request, reply: Reply, retry_after: Option<u64>, allow: Option<&str>) {
    let shape = Shape::for_target(req.url());
    let own_allow = match &reply {
        Reply::Error(e) => e.allow.clone(),
        _ => None,
    };
    let allow = allow.or(own_allow.as_deref());
    let (status, ct, body) = match reply {
        Reply::Error(e) => (
            e.status,
            "application/json".to_string(),
            serde_json::to_vec(&e.body_as(shape)).unwrap_or_default(),
        ),
        Reply::Json(s, v) => (
            s,
            "application/json".to_string(),
            serde_json::to_vec(&v).unwrap_or_default(),
        ),
        Reply::Bytes(s, ct, b) => (s, ct, b),
        Reply::Empty(s) => (s, String::new(), Vec::new()),
        // Callers resolve these before calling `respond`.
        Reply::Later(_) | Reply::Stream { .. } | Reply::Upgrade { .. } => {
            let e = ApiError::internal("unresolved deferred reply");
            (
                e.status,
                "application/json".into(),
                serde_json::to_vec(&e.body_as(shape)).unwrap_or_default(),
            )
        }
    };
    let retry = retry_after.map(|s| s.to_string());
    let mut headers = Vec::with_capacity(3);
    if !ct.is_empty() {
        headers.push(("Content-Type", ct.as_str()));
    }
    if let Some(r) = &retry {
        headers.push(("Retry-After", r.as_str()));
    }
    if let Some(a) = allow {
        headers.push(("Allow", a));
    }
    req.respond(status, &headers, &body);
}

/// Serializes `v` as the JSON body of a reply: refused (413) beyond `max`
/// bytes, its bytes leased from `lease` before they are allocated.
pub fn json_reply<T: serde::Serialize + ?Sized>(
    lease: &mut Lease,
    status: u16,
    v: &T,
    max: usize,
    hint: &str,
) -> ApiResult<Reply> {
    let len = budget::lease_json(lease, v, max, hint)?;
    let mut body = Vec::with_capacity(len);
    serde_json::to_writer(&mut body, v)
        .map_err(|e| ApiError::internal(format!("serialize reply: {e}")))?;
    Ok(Reply::Bytes(status, "application/json".into(), body))
}
