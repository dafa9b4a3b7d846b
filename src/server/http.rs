//! Transport pieces both front ends use: request headers, chunked
//! streaming straight to the socket; the error shape a target's API
//! answers in (`shape`, re-exported; `httpd` also writes it).

use super::httpd::Request;
/// Here for the front ends, which name it `server::http::Shape`.
pub use super::shape::Shape;
use std::io::Write;

pub fn header<'a>(req: &'a Request, name: &str) -> Option<&'a str> {
    req.header(name)
}

/// Chunked transfer encoding over the raw connection, flushed per write so
/// output reaches the client as soon as the guest produced it.
pub struct StreamWriter {
    out: Box<dyn Write + Send>,
    chunked: bool,
    pub failed: bool,
    /// The error shape of the API the stream answers (for its error line).
    pub shape: Shape,
}

impl StreamWriter {
    pub fn start(req: Request, content_type: &str) -> StreamWriter {
        Self::start_with(req, content_type, &[])
    }

    /// [`StreamWriter::start`] with extra headers (names and values from
    /// the daemon, never from a client).
    pub fn start_with(
        req: Request,
        content_type: &str,
        headers: &[(&str, String)],
    ) -> StreamWriter {
        let extra: String = headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}\r\n"))
            .collect();
        let chunked = !req.is_http10();
        let shape = Shape::for_target(req.url());
        let mut out = req.into_writer();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\n\
             X-Accel-Buffering: no\r\nConnection: close\r\n{extra}{}{}\r\n",
            crate::router::host_header_line(),
            if chunked {
                "Transfer-Encoding: chunked\r\n"
            } else {
                ""
            }
        );
        let failed = out
            .write_all(head.as_bytes())
            .and_then(|_| out.flush())
            .is_err();
        StreamWriter {
            out,
            chunked,
            failed,
            shape,
        }
    }

    /// Writes one piece; returns false once the client is gone.
    pub fn send(&mut self, data: &[u8]) -> bool {
        if self.failed || data.is_empty() {
            return !self.failed;
        }
        let r = if self.chunked {
            write!(self.out, "{:x}\r\n", data.len())
                .and_then(|_| self.out.write_all(data))
                .and_then(|_| self.out.write_all(b"\r\n"))
        } else {
            self.out.write_all(data)
        }
        .and_then(|_| self.out.flush());
        self.failed = r.is_err();
        !self.failed
    }

    pub fn finish(mut self) {
        if !self.failed && self.chunked {
            let _ = self.out.write_all(b"0\r\n\r\n");
        }
        let _ = self.out.flush();
    }
}
