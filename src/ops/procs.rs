//! Processes of a session's sandbox: list, one process, attach (output
//! and stdin), signal, resize, kill all. Each takes the session an
//! ownership check resolved ([`Ops::target`]), so a front end may look it
//! up at once (an unknown session is a 404 up front) and run the call on a
//! thread of its own.

use super::exec::Running;
use super::{Ops, OpsError, OpsResult};
use crate::proto::{ProcInfo, Request, Response, Signal};
use crate::session::Session;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Keystrokes kept per `pty_input` audit record.
pub const AUDIT_PTY_BYTES: usize = 4096;

/// What `KillAll` found.
#[derive(Debug, Clone, Copy)]
pub struct Killed {
    pub processes: u64,
    /// Still there when the guest stopped waiting (normally 0).
    pub remaining: u64,
}

/// A process id as a client names it: a positive integer.
pub fn proc_id(s: &str) -> OpsResult<u64> {
    s.parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| OpsError::BadRequest(format!("invalid process id {s:?}")))
}

/// A PTY size a client may ask for.
pub fn check_size(rows: u16, cols: u16) -> OpsResult<()> {
    if rows == 0 || cols == 0 {
        return Err(OpsError::BadRequest(
            "rows and cols must be positive".into(),
        ));
    }
    Ok(())
}

/// One process as every front end shows it (an entry of the list).
pub fn proc_json(p: &ProcInfo) -> Value {
    json!({
        "procId": p.proc, "pid": p.pid, "argv": p.argv, "tag": p.tag,
        "background": p.background, "pty": p.pty,
        "startedAt": p.started_unix_ms,
        "running": p.exit.is_none(),
        "exitCode": p.exit.as_ref().and_then(|e| e.code),
        "signal": p.exit.as_ref().and_then(|e| e.signal).map(Signal::name_of),
    })
}

impl Ops {
    fn wait(&self) -> Duration {
        self.cfg.create_timeout
    }

    /// A small request answered by one response.
    fn simple(&self, s: &Arc<Session>, req: Request, what: &str) -> OpsResult<Response> {
        let _a = s.activity();
        s.call(req, self.wait())?
            .finish()
            .map_err(OpsError::agent(what))
    }

    /// The processes the session's agent knows (running and exited).
    pub fn procs(&self, s: &Arc<Session>) -> OpsResult<Vec<ProcInfo>> {
        match self.simple(s, Request::ListProcs, "list processes")? {
            Response::Procs { procs } => {
                self.audit_ends(s, &procs);
                Ok(procs)
            }
            other => Err(OpsError::UnexpectedAnswer(format!("{other:?}"))),
        }
    }

    /// Process `proc` of the session, or [`OpsError::ProcessNotFound`].
    pub fn proc_info(&self, s: &Arc<Session>, proc: u64) -> OpsResult<ProcInfo> {
        let _a = s.activity();
        let known = s
            .call(Request::ListProcs, self.wait())?
            .finish()
            .map_err(OpsError::agent("list processes"))?;
        let not_found = || OpsError::ProcessNotFound {
            proc,
            session: s.id.clone(),
        };
        match known {
            Response::Procs { procs } => {
                self.audit_ends(s, &procs);
                procs
                    .into_iter()
                    .find(|p| p.proc == proc)
                    .ok_or_else(not_found)
            }
            _ => Err(not_found()),
        }
    }

    /// SIGKILL every process in the sandbox (every exec and whatever it
    /// left running); files and the session stay.
    pub fn kill_all(&self, s: &Arc<Session>) -> OpsResult<Killed> {
        match self.simple(s, Request::KillAll, "kill all processes")? {
            Response::Killed {
                processes,
                remaining,
            } => Ok(Killed {
                processes,
                remaining,
            }),
            other => Err(OpsError::UnexpectedAnswer(format!("{other:?}"))),
        }
    }

    /// Sends `sig` to process `proc` and its process group.
    pub fn signal(&self, s: &Arc<Session>, proc: u64, sig: Signal) -> OpsResult<()> {
        let req = Request::Signal {
            proc,
            signal: sig.number(),
        };
        self.simple(s, req, "signal").map(drop)
    }

    /// A PTY process's new window size.
    pub fn resize(&self, s: &Arc<Session>, proc: u64, rows: u16, cols: u16) -> OpsResult<()> {
        check_size(rows, cols)?;
        self.simple(s, Request::Resize { proc, rows, cols }, "resize")
            .map(drop)
    }

    /// Attaches to process `proc`: its output (from its start with
    /// `replay`), and with `stdin` its input. The guest refuses an unknown
    /// process on the stream; see [`Ops::proc_info`] to refuse it first.
    pub fn attach(
        &self,
        s: &Arc<Session>,
        proc: u64,
        stdin: bool,
        replay: bool,
    ) -> OpsResult<Running> {
        // Its output passed a masker only in its own exec's answer.
        if crate::sync::lock(&s.secret_procs).contains(&proc) {
            return Err(OpsError::Forbidden(format!(
                "process {proc} ran with secret files: its output (and stdin) is only \
                 its own exec's"
            )));
        }
        let activity = s.activity();
        let call = s.call(
            Request::Attach {
                proc,
                stdin,
                replay,
            },
            self.wait(),
        )?;
        let mut r = Running::new(call, "exec", Some(activity));
        r.audit_attach(s, self.audit(), proc);
        let injected = s.secret_values();
        r.masker = super::mask::Masker::new(injected.iter().map(|v| v.as_bytes()));
        Ok(r)
    }

    /// Background processes a listing shows ended: their `exit` records
    /// (each once; their own exec call ended at their start).
    fn audit_ends(&self, s: &Session, procs: &[ProcInfo]) {
        let log = self.audit();
        if !log.is_enabled() {
            return;
        }
        for p in procs {
            if let Some(st) = p.exit.as_ref().filter(|_| p.background) {
                if super::exec::first_end(s, p.proc) {
                    let mut r = super::exec::exit_fields(Some(p.proc), st);
                    if let Some(m) = r.as_object_mut() {
                        m.insert("seenBy".into(), json!("list"));
                    }
                    log.record(&s.owner, &s.id, "exit", r);
                }
            }
        }
    }

    /// [`Ops::stdin`]'s audit record for input a front end wrote through
    /// an attach of its own (MCP `write_process`): looks the process up
    /// (PTY or not) only when the log is on.
    pub fn audit_input(&self, s: &Arc<Session>, proc: u64, data: &[u8], eof: bool) {
        if !self.audit().is_enabled() {
            return;
        }
        if let Ok(info) = self.proc_info(s, proc) {
            self.record_input(s, info.proc, info.pty, data, eof);
        }
    }

    /// A PTY's keystrokes (masked like output, at most
    /// [`AUDIT_PTY_BYTES`] per record) or a plain process's input size.
    /// Every path input reaches a process by (the stdin op, a WebSocket)
    /// records it here.
    pub fn record_input(&self, s: &Session, proc: u64, pty: bool, data: &[u8], eof: bool) {
        let log = self.audit();
        if !log.is_enabled() {
            return;
        }
        if pty {
            let injected = s.secret_values();
            let mut m = super::mask::Masker::new(injected.iter().map(|v| v.as_bytes()));
            let masked = m.mask_all(data);
            let kept = &masked[..masked.len().min(AUDIT_PTY_BYTES)];
            log.record(
                &s.owner,
                &s.id,
                "pty_input",
                json!({
                    "proc": proc, "data": String::from_utf8_lossy(kept),
                    "bytes": data.len(), "truncated": kept.len() < masked.len(), "eof": eof,
                }),
            );
        } else {
            log.record(
                &s.owner,
                &s.id,
                "stdin",
                json!({"proc": proc, "bytes": data.len(), "eof": eof}),
            );
        }
    }

    /// Writes `data` (then EOF if `eof`) to process `proc`'s stdin; an
    /// unknown process is refused first.
    pub fn stdin(&self, s: &Arc<Session>, proc: u64, data: &[u8], eof: bool) -> OpsResult<()> {
        let _a = s.activity();
        let info = self.proc_info(s, proc)?;
        let mut r = self.attach(s, proc, true, false)?;
        r.set_what("stdin");
        r.send_input(data, eof)?;
        self.record_input(s, info.proc, info.pty, data, eof);
        // A quick look for an immediate failure (unknown process).
        match r.poll(Duration::from_millis(20)) {
            Err(e @ OpsError::Agent { .. }) => Err(e),
            _ => Ok(()),
        }
        // Dropping the call detaches; the process keeps running.
    }
}
