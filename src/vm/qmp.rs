//! A small blocking QMP client: greeting, `qmp_capabilities`, then one
//! command at a time with a bounded wait. Asynchronous events that arrive
//! between commands are skipped.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{Result, VmError};

const BACKEND: &str = super::BackendKind::Qemu.as_str();
/// A QMP line longer than this is not something we asked for.
const MAX_LINE: usize = 1 << 20;

pub struct Qmp {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    path: String,
}

fn io_err(what: String, source: io::Error) -> VmError {
    VmError::Io {
        backend: BACKEND,
        what,
        source,
    }
}

impl Qmp {
    /// Connect to QEMU's QMP socket, retrying while it does not exist yet
    /// and `alive()` says the VMM still runs, then negotiate capabilities.
    pub fn connect(path: &Path, deadline: Instant, alive: &dyn Fn() -> bool) -> Result<Qmp> {
        let started = Instant::now();
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) =>
                {
                    if !alive() {
                        return Err(VmError::Api {
                            backend: BACKEND,
                            msg: format!(
                                "VMM exited before its QMP socket {} was up",
                                path.display()
                            ),
                        });
                    }
                    if Instant::now() >= deadline {
                        return Err(VmError::Timeout {
                            backend: BACKEND,
                            what: format!("QMP socket {}", path.display()),
                            ms: started.elapsed().as_millis() as u64,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(io_err(format!("connect {}", path.display()), e)),
            }
        };
        let reader = BufReader::new(
            stream
                .try_clone()
                .map_err(|e| io_err("clone QMP socket".into(), e))?,
        );
        let mut q = Qmp {
            stream,
            reader,
            path: path.display().to_string(),
        };
        let greeting = q.read_message(deadline)?;
        if greeting.get("QMP").is_none() {
            return Err(VmError::Api {
                backend: BACKEND,
                msg: format!("{}: not a QMP greeting: {greeting}", q.path),
            });
        }
        q.execute_until("qmp_capabilities", None, deadline)?;
        Ok(q)
    }

    fn read_message(&mut self, deadline: Instant) -> Result<Value> {
        let started = Instant::now();
        let mut line = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(VmError::Timeout {
                    backend: BACKEND,
                    what: format!("QMP answer on {}", self.path),
                    ms: started.elapsed().as_millis() as u64,
                });
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| io_err("set QMP read timeout".into(), e))?;
            let before = line.len();
            match Read::by_ref(&mut self.reader)
                .take((MAX_LINE - before) as u64 + 1)
                .read_until(b'\n', &mut line)
            {
                Ok(0) => {
                    return Err(VmError::Api {
                        backend: BACKEND,
                        msg: format!("QMP connection {} closed (VMM gone?)", self.path),
                    })
                }
                Ok(_) if line.ends_with(b"\n") => break,
                Ok(_) if line.len() > MAX_LINE => {
                    return Err(VmError::Api {
                        backend: BACKEND,
                        msg: format!("QMP message on {} longer than {MAX_LINE} bytes", self.path),
                    })
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(format!("read QMP {}", self.path), e)),
            }
        }
        serde_json::from_slice(&line).map_err(|e| VmError::Api {
            backend: BACKEND,
            msg: format!(
                "QMP {}: bad JSON ({e}): {}",
                self.path,
                String::from_utf8_lossy(&line).trim()
            ),
        })
    }

    fn send(&mut self, cmd: &str, args: Option<&Value>, fd: Option<RawFd>) -> Result<()> {
        let msg = match args {
            Some(a) => json!({ "execute": cmd, "arguments": a }),
            None => json!({ "execute": cmd }),
        };
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(b'\n');
        match fd {
            None => self
                .stream
                .write_all(&bytes)
                .map_err(|e| io_err(format!("QMP {cmd} on {}", self.path), e)),
            Some(fd) => send_with_fd(&self.stream, &bytes, fd)
                .map_err(|e| io_err(format!("QMP {cmd} (with fd) on {}", self.path), e)),
        }
    }

    fn execute_until(
        &mut self,
        cmd: &str,
        args: Option<&Value>,
        deadline: Instant,
    ) -> Result<Value> {
        self.send(cmd, args, None)?;
        self.answer(cmd, deadline)
    }

    fn answer(&mut self, cmd: &str, deadline: Instant) -> Result<Value> {
        loop {
            let mut m = self.read_message(deadline)?;
            if let Some(r) = m.get_mut("return") {
                return Ok(r.take());
            }
            if let Some(e) = m.get("error") {
                let desc = e
                    .get("desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no description");
                return Err(VmError::Api {
                    backend: BACKEND,
                    msg: format!("QMP {cmd}: {desc}"),
                });
            }
            // An event ({"event": ...}): not our answer.
        }
    }

    /// Run `cmd` and return its `return` value, waiting at most `timeout`.
    pub fn execute(&mut self, cmd: &str, args: Option<Value>, timeout: Duration) -> Result<Value> {
        self.execute_until(cmd, args.as_ref(), Instant::now() + timeout)
    }

    /// `getfd`: hand QEMU a file descriptor under `name` (SCM_RIGHTS).
    pub fn getfd(&mut self, name: &str, fd: &impl AsRawFd, timeout: Duration) -> Result<()> {
        let args = json!({ "fdname": name });
        self.send("getfd", Some(&args), Some(fd.as_raw_fd()))?;
        self.answer("getfd", Instant::now() + timeout).map(|_| ())
    }

    /// Poll `query-migrate` until the migration is `completed`; errors on
    /// `failed`/`cancelled` or when `deadline` passes.
    pub fn wait_migration(&mut self, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let info = self.execute("query-migrate", None, left.max(Duration::from_millis(1)))?;
            let status = info.get("status").and_then(Value::as_str).unwrap_or("");
            match status {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    let why = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    return Err(VmError::Api {
                        backend: BACKEND,
                        msg: format!("migration {status}: {why}"),
                    });
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(VmError::Timeout {
                    backend: BACKEND,
                    what: format!("migration (last status {status:?})"),
                    ms: started.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

fn send_with_fd(sock: &UnixStream, bytes: &[u8], fd: RawFd) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut cbuf = vec![0u8; space];
    // SAFETY: msghdr is plain data; all pointers set below outlive sendmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer is CMSG_SPACE bytes for one fd, so the
    // first header and its data fit.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
    }
    // SAFETY: msg points at live buffers.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = n as usize;
    if n < bytes.len() {
        // The fd went with the first byte; the rest is ordinary data.
        (&*sock).write_all(&bytes[n..])?;
    }
    Ok(())
}
