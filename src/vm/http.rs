//! A minimal blocking HTTP/1.1 client over a Unix socket, enough to drive
//! Firecracker's API: one request per connection, JSON bodies with
//! `Content-Length`, bounded response size, and a single deadline that covers
//! connect, write and read.
//!
//! A full HTTP crate would pull in an async runtime or a large dependency tree
//! for what is, here, a dozen lines of framing.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Largest response head (status line + headers) accepted.
const MAX_HEAD: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("timed out talking to {path}")]
    Timeout { path: PathBuf },
    #[error("bad HTTP response from {path}: {msg}")]
    Protocol { path: PathBuf, msg: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Send one request and read its response.
///
/// `path` is the request target (e.g. `/boot-source`); `body` is sent as
/// `application/json`. The response body is capped at `max_body` bytes.
pub fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    deadline: Instant,
    max_body: usize,
) -> Result<Response, HttpError> {
    let io_err = |what: &'static str, source: io::Error| {
        if matches!(
            source.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            HttpError::Timeout {
                path: sock.to_path_buf(),
            }
        } else {
            HttpError::Io {
                what,
                path: sock.to_path_buf(),
                source,
            }
        }
    };
    let mut stream = UnixStream::connect(sock).map_err(|e| io_err("connect", e))?;

    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n");
    match body {
        Some(b) => {
            req.push_str("Content-Type: application/json\r\n");
            req.push_str(&format!("Content-Length: {}\r\n\r\n", b.len()));
        }
        None => req.push_str("\r\n"),
    }
    let mut out = req.into_bytes();
    if let Some(b) = body {
        out.extend_from_slice(b);
    }
    set_timeouts(&stream, deadline).map_err(|e| io_err("set timeout on", e))?;
    stream.write_all(&out).map_err(|e| io_err("write to", e))?;

    read_response(&mut stream, deadline, max_body).map_err(|e| match e {
        ReadErr::Io(source) => io_err("read from", source),
        ReadErr::Protocol(msg) => HttpError::Protocol {
            path: sock.to_path_buf(),
            msg,
        },
    })
}

fn set_timeouts(stream: &UnixStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::from(io::ErrorKind::TimedOut));
    }
    // A zero Duration is rejected by set_read_timeout; `left` is non-zero here.
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

enum ReadErr {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for ReadErr {
    fn from(e: io::Error) -> Self {
        ReadErr::Io(e)
    }
}

/// Read a response head and body. Each read re-arms the socket timeout to the
/// time left before `deadline`, so a peer trickling bytes cannot stretch it.
fn read_response(
    stream: &mut UnixStream,
    deadline: Instant,
    max_body: usize,
) -> Result<Response, ReadErr> {
    let mut buf: Vec<u8> = Vec::with_capacity(512);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = find(&buf, b"\r\n\r\n") {
            break pos;
        }
        if buf.len() > MAX_HEAD {
            return Err(ReadErr::Protocol(format!(
                "response head longer than {MAX_HEAD} bytes"
            )));
        }
        set_timeouts(stream, deadline)?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(ReadErr::Protocol(if buf.is_empty() {
                "connection closed before any response".into()
            } else {
                "connection closed inside the response head".into()
            }));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| ReadErr::Protocol("response head is not UTF-8".into()))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = parse_status(status_line)
        .ok_or_else(|| ReadErr::Protocol(format!("bad status line {status_line:?}")))?;
    let mut content_length: Option<usize> = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(ReadErr::Protocol(format!("bad header line {line:?}")));
        };
        let name = name.trim();
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse::<usize>()
                .map_err(|_| ReadErr::Protocol(format!("bad Content-Length {value:?}")))?;
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && !value.eq_ignore_ascii_case("identity")
        {
            return Err(ReadErr::Protocol(format!(
                "unsupported Transfer-Encoding {value:?}"
            )));
        }
    }
    let mut body = buf.split_off(head_end + 4);
    let no_body = status == 204 || status == 304 || (100..200).contains(&status);
    let want = match (no_body, content_length) {
        (true, _) => 0,
        (false, Some(n)) => n,
        // Without a length the body runs to EOF; still bounded by max_body.
        (false, None) => usize::MAX,
    };
    if want != usize::MAX && want > max_body {
        return Err(ReadErr::Protocol(format!(
            "response body of {want} bytes exceeds the {max_body}-byte limit"
        )));
    }
    while body.len() < want {
        if body.len() > max_body {
            return Err(ReadErr::Protocol(format!(
                "response body exceeds the {max_body}-byte limit"
            )));
        }
        set_timeouts(stream, deadline)?;
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            if want == usize::MAX {
                break;
            }
            return Err(ReadErr::Protocol(format!(
                "connection closed after {} of {want} body bytes",
                body.len()
            )));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    if want != usize::MAX {
        body.truncate(want);
    } else if body.len() > max_body {
        return Err(ReadErr::Protocol(format!(
            "response body exceeds the {max_body}-byte limit"
        )));
    }
    Ok(Response { status, body })
}

fn parse_status(line: &str) -> Option<u16> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    code.parse().ok()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Convenience for callers that want a `Duration` budget instead of a deadline.
pub fn deadline_in(d: Duration) -> Instant {
    Instant::now() + d
}
