//! WebSocket (RFC 6455), server side, over a blocking socket: the
//! handshake check, a reader of the client's frames and a writer shared by
//! the threads that send (issue #26: processes over WebSocket).
//!
//! Bounded: a message (all its fragments) is at most [`MAX_MESSAGE`]
//! bytes, control frames at most 125; the client's frames must be masked,
//! text must be UTF-8, reserved bits clear. A violation closes the
//! connection with the RFC's code (1002 protocol, 1007 bad text, 1009 too
//! big). Pings are answered by the reader; the writer's lock keeps a pong
//! from landing inside another frame.

use super::httpd::Request;
use base64::Engine as _;
use sha1::{Digest, Sha1};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

/// The largest message a client may send (a paste into a terminal fits).
pub const MAX_MESSAGE: usize = 1 << 20;
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// `Sec-WebSocket-Accept` for a client's key.
pub fn accept_key(key: &str) -> String {
    let mut h = Sha1::new();
    h.update(key.trim().as_bytes());
    h.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// Whether `req` asks for a WebSocket; `Ok` carries the accept key, `Err`
/// says what is missing (a 400 for a plain GET of a WebSocket route).
pub fn check_upgrade(req: &Request) -> Result<String, String> {
    let has = |name: &str, token: &str| {
        req.header(name)
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    };
    if !has("upgrade", "websocket") || !has("connection", "upgrade") {
        return Err(
            "this is a WebSocket endpoint: send Upgrade: websocket and Connection: \
                    Upgrade"
                .into(),
        );
    }
    if req.header("sec-websocket-version").map(str::trim) != Some("13") {
        return Err("Sec-WebSocket-Version must be 13".into());
    }
    let key = req.header("sec-websocket-key").unwrap_or("").trim();
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(key)
        .map_err(|_| "Sec-WebSocket-Key is not base64".to_string())?;
    if decoded.len() != 16 {
        return Err("Sec-WebSocket-Key must be 16 bytes, base64".into());
    }
    Ok(accept_key(key))
}

/// Writes the 101 answer; the connection speaks WebSocket from then on.
pub fn accept(stream: TcpStream, leftover: Vec<u8>, key: &str) -> io::Result<(Reader, Writer)> {
    let mut s = &stream;
    write!(
        s,
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Accept: {key}\r\n\r\n"
    )?;
    s.flush()?;
    let read = stream.try_clone()?;
    let writer = Writer(Arc::new(Mutex::new(WriteSide {
        stream,
        closed: false,
    })));
    Ok((
        Reader {
            stream: read,
            leftover,
            pos: 0,
            writer: writer.clone(),
        },
        writer,
    ))
}

/// A whole message from the client.
#[derive(Debug, PartialEq)]
pub enum Message {
    Text(String),
    Binary(Vec<u8>),
    /// The client closed (or broke the protocol, already answered); no
    /// more messages follow.
    Close,
}

struct WriteSide {
    stream: TcpStream,
    /// A close frame went out: nothing follows it.
    closed: bool,
}

/// The sending half; clones share one socket and one lock.
#[derive(Clone)]
pub struct Writer(Arc<Mutex<WriteSide>>);

impl Writer {
    fn frame(&self, opcode: u8, payload: &[u8]) -> io::Result<()> {
        let mut w = crate::sync::lock(&self.0);
        if w.closed {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "websocket closed",
            ));
        }
        let mut head = Vec::with_capacity(10);
        head.push(0x80 | opcode);
        match payload.len() {
            n @ 0..=125 => head.push(n as u8),
            n @ 126..=0xffff => {
                head.push(126);
                head.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                head.push(127);
                head.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        if opcode == 0x8 {
            w.closed = true;
        }
        w.stream.write_all(&head)?;
        w.stream.write_all(payload)?;
        w.stream.flush()
    }

    pub fn text(&self, s: &str) -> io::Result<()> {
        self.frame(0x1, s.as_bytes())
    }

    pub fn binary(&self, b: &[u8]) -> io::Result<()> {
        self.frame(0x2, b)
    }

    /// Sends a close frame (`code`, a short reason); nothing after it.
    pub fn close(&self, code: u16, reason: &str) {
        let mut p = code.to_be_bytes().to_vec();
        p.extend(reason.bytes().take(120));
        let _ = self.frame(0x8, &p);
    }

    /// A client that stops reading is dropped after `t` (a write fails).
    pub fn set_write_timeout(&self, t: std::time::Duration) {
        let w = crate::sync::lock(&self.0);
        let _ = w.stream.set_write_timeout(Some(t));
    }

    /// Ends the connection both ways (the reader's read returns).
    pub fn shutdown(&self) {
        let w = crate::sync::lock(&self.0);
        let _ = w.stream.shutdown(Shutdown::Both);
    }
}

/// The receiving half.
pub struct Reader {
    stream: TcpStream,
    leftover: Vec<u8>,
    pos: usize,
    writer: Writer,
}

impl Reader {
    fn read_exact(&mut self, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        if self.pos < self.leftover.len() {
            let n = (self.leftover.len() - self.pos).min(out.len());
            out[..n].copy_from_slice(&self.leftover[self.pos..self.pos + n]);
            self.pos += n;
            done = n;
        }
        self.stream.read_exact(&mut out[done..])
    }

    /// Closes with `code` after a violation and reports the end.
    fn fail(&mut self, code: u16, why: &str) -> io::Result<Message> {
        log::debug!("websocket: {why}; closing with {code}");
        self.writer.close(code, why);
        self.writer.shutdown();
        Ok(Message::Close)
    }

    /// The next data message; pings are answered on the way. An error is
    /// the socket's (the client vanished).
    pub fn recv(&mut self) -> io::Result<Message> {
        let mut msg: Vec<u8> = Vec::new();
        let mut kind: Option<u8> = None;
        loop {
            let mut h = [0u8; 2];
            self.read_exact(&mut h)?;
            let fin = h[0] & 0x80 != 0;
            let opcode = h[0] & 0x0f;
            if h[0] & 0x70 != 0 {
                return self.fail(1002, "reserved bits set");
            }
            if h[1] & 0x80 == 0 {
                return self.fail(1002, "client frames must be masked");
            }
            let len = match h[1] & 0x7f {
                126 => {
                    let mut b = [0u8; 2];
                    self.read_exact(&mut b)?;
                    u16::from_be_bytes(b) as u64
                }
                127 => {
                    let mut b = [0u8; 8];
                    self.read_exact(&mut b)?;
                    u64::from_be_bytes(b)
                }
                n => n as u64,
            };
            let control = opcode & 0x8 != 0;
            if control && (len > 125 || !fin) {
                return self.fail(1002, "control frames are short and whole");
            }
            if !control && msg.len() as u64 + len > MAX_MESSAGE as u64 {
                return self.fail(1009, "message too big");
            }
            let mut mask = [0u8; 4];
            self.read_exact(&mut mask)?;
            let mut payload = vec![0u8; len as usize];
            self.read_exact(&mut payload)?;
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= mask[i % 4];
            }
            match opcode {
                0x8 => {
                    // Echo the close, as the RFC asks.
                    let code = payload
                        .get(..2)
                        .map_or(1000, |c| u16::from_be_bytes([c[0], c[1]]));
                    self.writer.close(code, "");
                    return Ok(Message::Close);
                }
                0x9 => {
                    let _ = self.writer.frame(0xA, &payload);
                    continue;
                }
                0xA => continue,
                0x0 if kind.is_none() => return self.fail(1002, "continuation of nothing"),
                0x0 => {}
                0x1 | 0x2 if kind.is_some() => {
                    return self.fail(1002, "a new message inside a fragmented one")
                }
                0x1 | 0x2 => kind = Some(opcode),
                _ => return self.fail(1002, "unknown opcode"),
            }
            msg.extend_from_slice(&payload);
            if fin {
                return match kind {
                    Some(0x1) => match String::from_utf8(msg) {
                        Ok(t) => Ok(Message::Text(t)),
                        Err(_) => self.fail(1007, "text is not UTF-8"),
                    },
                    _ => Ok(Message::Binary(msg)),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn the_rfc_example_key() {
        // RFC 6455 section 1.3.
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    fn masked(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mask = [1u8, 2, 3, 4];
        let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
        if payload.len() < 126 {
            f.push(0x80 | payload.len() as u8);
        } else {
            f.push(0x80 | 126);
            f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        }
        f.extend_from_slice(&mask);
        f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        f
    }

    /// A connected pair: our reader/writer and the client's socket.
    fn pair(leftover: Vec<u8>) -> (Reader, Writer, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        let (r, w) = accept(server, leftover, "x").unwrap();
        let mut c = &client;
        let mut head = [0u8; 256];
        let n = c.read(&mut head).unwrap();
        assert!(head[..n].starts_with(b"HTTP/1.1 101 "));
        (r, w, client)
    }

    #[test]
    fn messages_fragments_pings_and_limits() {
        let first = masked(0x1, true, b"early");
        let (mut r, w, mut c) = pair(first);
        assert_eq!(r.recv().unwrap(), Message::Text("early".into()));
        c.write_all(&masked(0x2, false, b"ab")).unwrap();
        c.write_all(&masked(0x9, true, b"hi")).unwrap();
        c.write_all(&masked(0x0, true, b"cd")).unwrap();
        assert_eq!(r.recv().unwrap(), Message::Binary(b"abcd".to_vec()));
        let mut pong = [0u8; 4];
        c.read_exact(&mut pong).unwrap();
        assert_eq!(pong, [0x8A, 2, b'h', b'i']);
        w.text(&"x".repeat(300)).unwrap();
        let mut h = [0u8; 4];
        c.read_exact(&mut h).unwrap();
        assert_eq!(h, [0x81, 126, 1, 44]);
        let mut body = vec![0u8; 300];
        c.read_exact(&mut body).unwrap();
        // Unmasked from a client: refused with 1002.
        c.write_all(&[0x81, 1, b'x']).unwrap();
        assert_eq!(r.recv().unwrap(), Message::Close);
        let mut close = [0u8; 4];
        c.read_exact(&mut close).unwrap();
        assert_eq!(&close, &[0x88, 30, 0x03, 0xea]);
        assert!(w.text("after").is_err(), "nothing after a close");
    }

    #[test]
    fn bad_text_and_big_messages_are_refused() {
        let (mut r, _w, mut c) = pair(Vec::new());
        c.write_all(&masked(0x1, true, &[0xff, 0xfe])).unwrap();
        assert_eq!(r.recv().unwrap(), Message::Close);
        let mut close = [0u8; 4];
        c.read_exact(&mut close).unwrap();
        assert_eq!(&close[2..], &1007u16.to_be_bytes());

        let (mut r, _w, mut c) = pair(Vec::new());
        let mut f = vec![0x82, 0x80 | 127];
        f.extend_from_slice(&((MAX_MESSAGE as u64) + 1).to_be_bytes());
        f.extend_from_slice(&[0, 0, 0, 0]);
        c.write_all(&f).unwrap();
        assert_eq!(r.recv().unwrap(), Message::Close);
        let mut close = [0u8; 4];
        c.read_exact(&mut close).unwrap();
        assert_eq!(&close[2..], &1009u16.to_be_bytes());
    }
}
