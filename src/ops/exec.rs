//! Running commands: the one validation of a command (argv or shell line,
//! env, cwd, timeout against the configured maximum, stdin, PTY, tag), its
//! start on a session, and the typed stream of the running call
//! ([`Running`], [`ExecEvent`]) that every front end consumes: REST as a
//! buffered answer or NDJSON/SSE, MCP as progress and a result.

use super::mask::Masker;
use super::secrets::{SecretFiles, Secrets};
use super::{validate, Ops, OpsError, OpsResult, Principal};
use crate::agent::{Call, CallSender, ClientError, Inbound};
use crate::config::Config;
use crate::proto::{channel, Event, ExecRequest, ExitStatus, PtySize, Request, Response};
use crate::session::{Activity, Session};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A command as a client asks for it (the body of `POST
/// /exec/:id/execute` and `POST /v1/sessions/:id/exec`; MCP fills the
/// fields its arguments name).
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ExecSpec {
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
    /// Files `/run/secrets/NAME` for this command only; their values are
    /// masked in its output (see [`super::secrets`]).
    pub secrets: Option<Secrets>,
}

/// How output (and file content) is handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Utf8,
    Base64,
}

pub fn encoding(s: Option<&str>) -> OpsResult<Encoding> {
    match s {
        None | Some("utf8") | Some("utf-8") => Ok(Encoding::Utf8),
        Some("base64") => Ok(Encoding::Base64),
        Some(o) => Err(OpsError::BadRequest(format!(
            "encoding {o:?}: want utf8 or base64"
        ))),
    }
}

/// A validated command, ready to start.
pub struct Prepared {
    pub req: ExecRequest,
    pub stdin: Option<Vec<u8>>,
    pub encoding: Encoding,
    pub timeout: Duration,
    /// Validated; placed by [`Ops::exec_in`] just before the start.
    pub secrets: Secrets,
}

fn bad(m: impl Into<String>) -> OpsError {
    OpsError::BadRequest(m.into())
}

impl ExecSpec {
    /// Checks the command against the protocol's and the daemon's limits.
    pub fn prepare(self, cfg: &Config) -> OpsResult<Prepared> {
        let (argv, shell) = match (self.argv, self.command, self.args) {
            (Some(_), Some(_), _) => return Err(bad("give either argv or command, not both")),
            (Some(argv), None, None) => {
                if argv.is_empty() {
                    return Err(bad("argv must not be empty"));
                }
                (argv, None)
            }
            (Some(_), None, Some(_)) => return Err(bad("args goes with command, not argv")),
            (None, Some(cmd), Some(args)) => {
                let mut argv = vec![cmd];
                argv.extend(args);
                (argv, None)
            }
            (None, Some(cmd), None) => (Vec::new(), Some(cmd)),
            (None, None, _) => return Err(bad("command (or argv) is required")),
        };
        if argv.first().is_some_and(|a| a.is_empty()) || shell.as_deref() == Some("") {
            return Err(bad("command must not be empty"));
        }
        if argv.len() > crate::proto::limits::MAX_ARGS {
            return Err(bad("too many arguments"));
        }
        for a in argv.iter().chain(shell.iter()) {
            if a.contains('\0') {
                return Err(bad("arguments must not contain NUL bytes"));
            }
        }
        let env = validate::env(self.env.unwrap_or_default())?;
        if let Some(cwd) = &self.cwd {
            validate::path(cwd, "cwd")?;
        }
        let timeout_ms = match self.timeout {
            Some(0) => return Err(bad("timeout must be at least 1 ms")),
            Some(t) => t,
            None => cfg.default_exec_timeout.as_millis() as u64,
        };
        let max = cfg.max_exec_timeout.as_millis() as u64;
        if timeout_ms > max {
            return Err(OpsError::TimeoutTooLong {
                ms: timeout_ms,
                max,
            });
        }
        let stdin = match (self.stdin, self.stdin_base64) {
            (Some(_), Some(_)) => return Err(bad("give stdin or stdinBase64, not both")),
            (Some(s), None) => Some(s.into_bytes()),
            (None, Some(b)) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(b.as_bytes())
                    .map_err(|e| bad(format!("stdinBase64: {e}")))?,
            ),
            (None, None) => None,
        };
        if let Some(p) = &self.pty {
            if p.rows == 0 || p.cols == 0 {
                return Err(bad("pty rows and cols must be positive"));
            }
        }
        if let Some(t) = &self.tag {
            if t.len() > 256 {
                return Err(bad("tag longer than 256 bytes"));
            }
        }
        let background = self.background.unwrap_or(false);
        let secrets = self.secrets.unwrap_or_default();
        validate::secrets(&secrets.0)?;
        if background && !secrets.is_empty() {
            // The daemon removes the files when the call ends, and a
            // background call ends at the start; no watcher outlives it.
            return Err(bad(
                "secrets are for foreground commands only: a background command \
                 would outlive the removal of its secret files",
            ));
        }
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
            // Set by the caller on `Prepared::req` for an audited exec
            // (the record comes back in the exit status's `audit`).
            audit: false,
        };
        Ok(Prepared {
            req,
            stdin,
            encoding: encoding(self.encoding.as_deref())?,
            timeout: Duration::from_millis(timeout_ms),
            secrets,
        })
    }
}

impl Ops {
    /// Starts a prepared command in `session` (its session-wide env under
    /// the command's own) and feeds its stdin; see [`Running`].
    pub fn exec_in(&self, session: &Arc<Session>, mut p: Prepared) -> OpsResult<Started> {
        p.req.env = session.env_for(&p.req.env);
        let activity = session.activity();
        // Files first: the command may read them at once. Dropped (so
        // removed) if the start fails.
        let files = if p.secrets.is_empty() {
            None
        } else if self.mgr.factory.backend() == "local-process" {
            // Its agent runs on the host: /run/secrets would be the host's.
            return Err(OpsError::NotSupported(
                "secret files need a VM backend: a local-process sandbox's /run is the host's"
                    .into(),
            ));
        } else {
            Some(SecretFiles::place(
                session,
                &p.secrets,
                self.cfg.create_timeout,
            )?)
        };
        let injected = session.secret_values();
        let masker = Masker::new(
            p.secrets
                .0
                .values()
                .map(|v| v.as_bytes())
                .chain(injected.iter().map(|v| v.as_bytes())),
        );
        if files.is_some() {
            // Its process id is what attaches are refused by.
            p.req.notify_start = true;
        }
        // What the command did in the guest comes back with its exit; a
        // background command's exit is not this call's, so not for it.
        if self.audit().is_enabled() && self.cfg.audit.guest && !p.req.background {
            p.req.audit = true;
        }
        let call = session.call(Request::Exec(p.req.clone()), self.cfg.create_timeout)?;
        if let Some(data) = &p.stdin {
            let tx = call.sender();
            let data = data.clone();
            // Fed from its own thread: a process that does not read its
            // stdin must not stop us from reading its output.
            let _ = std::thread::Builder::new()
                .name("exec-stdin".into())
                .spawn(move || {
                    if tx.send_all(&data).is_ok() {
                        let _ = tx.send_eof();
                    }
                });
        }
        let mut running = Running::new(call, "exec", Some(activity));
        // The record's command line passes the same mask as the output:
        // a secret value typed into argv stays out of the log too.
        let mut shown = p.req.clone();
        let mut m = Masker::new(
            p.secrets
                .0
                .values()
                .map(|v| v.as_bytes())
                .chain(injected.iter().map(|v| v.as_bytes())),
        );
        shown.argv = shown.argv.iter().map(|a| m.mask_str(a)).collect();
        shown.shell = shown.shell.as_deref().map(|a| m.mask_str(a));
        shown.cwd = shown.cwd.as_deref().map(|a| m.mask_str(a));
        running.audit_as(
            session,
            self.audit(),
            &shown,
            json!({
                "secretNames": p.secrets.0.keys().collect::<Vec<_>>(),
                "stdinBytes": p.stdin.as_ref().map(Vec::len),
            }),
        );
        if let Some(a) = &mut running.audit {
            a.seen = Some(session.clone());
        }
        running.masker = masker;
        running.secrets = files;
        Ok(Started {
            running,
            encoding: p.encoding,
            timeout: p.timeout,
            background: p.req.background,
        })
    }

    /// [`Ops::exec_in`] on the caller's existing session `id`.
    pub fn exec(
        &self,
        p: &Principal,
        owner: Option<&str>,
        id: &str,
        prepared: Prepared,
    ) -> OpsResult<Started> {
        let s = self.find(p, owner, id)?;
        self.exec_in(&s, prepared)
    }
}

/// A command that runs, and what its answer needs of its request.
pub struct Started {
    pub running: Running,
    pub encoding: Encoding,
    /// The command's timeout (the default when it named none).
    pub timeout: Duration,
    pub background: bool,
}

/// Which output stream (its value indexes the masker's tails).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout = 0,
    Stderr = 1,
}

impl Stream {
    fn of(ch: u16) -> Stream {
        if ch == channel::STDERR {
            Stream::Stderr
        } else {
            Stream::Stdout
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// What a running call (a command, or an attach to a process) reports.
#[derive(Debug)]
pub enum ExecEvent {
    Output {
        stream: Stream,
        bytes: Vec<u8>,
    },
    /// The process is up (commands prepared here ask for it).
    Started {
        proc: u64,
        pid: i32,
    },
    /// Output the guest's buffer lost before it was read.
    Dropped {
        bytes: u64,
    },
    /// Final: the command ended.
    Exited(ExitStatus),
    /// Final: a background command started and runs on.
    Background {
        proc: u64,
        pid: i32,
    },
}

/// A call in flight. Dropping it cancels it in the guest (a foreground
/// command dies with its client); an attach only detaches.
///
/// Its output passes its [`Masker`] (every front end reads output only
/// from here), and its secret files are removed as soon as the command's
/// end is seen, or at the drop (timeout, client gone, an error).
pub struct Running {
    call: Call,
    /// Names the call in its errors (`exec: ...`).
    what: String,
    pub(super) masker: Masker,
    secrets: Option<SecretFiles>,
    /// Events due before the next one read (held output flushed before
    /// the exit).
    queue: VecDeque<ExecEvent>,
    /// The command's `exec`/`exit` audit records (`None`: an attach).
    audit: Option<ExecAudit>,
    // Last: the session counts as busy until the files are gone.
    _activity: Option<Activity>,
}

/// What a command's audit records need.
struct ExecAudit {
    log: crate::audit::Log,
    owner: String,
    session: String,
    /// Where ends already recorded are noted (each process's once).
    seen: Option<Arc<Session>>,
    /// An attach: it records the end it sees, never a start or a cancel.
    attach: bool,
    /// The `exec` record, until it is written (at the start event).
    start: Option<Value>,
    proc: Option<u64>,
    t0: Instant,
    done: bool,
}

impl ExecAudit {
    fn started(&mut self, proc: Option<u64>, pid: Option<i32>) {
        if let Some(mut r) = self.start.take() {
            self.proc = proc;
            if let Some(m) = r.as_object_mut() {
                m.insert("proc".into(), json!(proc));
                m.insert("pid".into(), json!(pid));
            }
            self.log.record(&self.owner, &self.session, "exec", r);
        }
    }

    fn exited(&mut self, st: &ExitStatus) {
        self.started(None, None);
        self.done = true;
        if let (Some(s), Some(p)) = (&self.seen, self.proc) {
            if !first_end(s, p) {
                return;
            }
        }
        let mut r = exit_fields(self.proc, st);
        if let (true, Some(m)) = (self.attach, r.as_object_mut()) {
            m.insert("seenBy".into(), json!("attach"));
        }
        if let (Some(g), Some(m)) = (&st.audit, r.as_object_mut()) {
            // What the guest's record left out, beside the exit.
            m.insert(
                "guest".into(),
                json!({
                    "procsTracked": g.procs_tracked, "procs": g.procs.len(),
                    "procsDropped": g.procs_dropped,
                    "filesTracked": g.files_tracked, "files": g.files.len(),
                    "filesDropped": g.files_dropped, "notes": g.notes,
                }),
            );
        }
        self.log.record(&self.owner, &self.session, "exit", r);
    }

    /// One record of what the guest says the command did (`proc`, `file`):
    /// the exec's process id added; the kind's rate limit applies.
    fn guest(&self, kind: &'static str, mut fields: Value) {
        if let Some(m) = fields.as_object_mut() {
            m.insert("exec".into(), json!(self.proc));
            m.insert("reportedBy".into(), json!("guest"));
        }
        self.log.record(&self.owner, &self.session, kind, fields);
    }

    /// The call ended without an exit seen: an error, a background start,
    /// or its client went away (a foreground command is killed then).
    fn ended(&mut self, outcome: &str, error: Option<String>) {
        if self.attach {
            self.done = true;
            return;
        }
        self.started(None, None);
        if !std::mem::replace(&mut self.done, true) {
            let r = json!({
                "proc": self.proc, "outcome": outcome, "error": error,
                "durationMs": self.t0.elapsed().as_millis() as u64,
            });
            self.log.record(&self.owner, &self.session, "exit", r);
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(a) = &mut self.audit {
            if !a.done {
                a.ended("cancelled", None);
            }
        }
        if let Some(mut f) = self.secrets.take() {
            // Kill the command before its files go.
            let _ = self.call.cancel();
            f.remove();
        }
    }
}

impl Running {
    pub(super) fn new(call: Call, what: impl Into<String>, activity: Option<Activity>) -> Running {
        Running {
            call,
            what: what.into(),
            masker: Masker::default(),
            secrets: None,
            queue: VecDeque::new(),
            audit: None,
            _activity: activity,
        }
    }

    /// Audits this attach to process `proc`: the end it sees is recorded
    /// (once per process, whoever sees it first).
    pub(super) fn audit_attach(
        &mut self,
        session: &Arc<Session>,
        log: &crate::audit::Log,
        proc: u64,
    ) {
        if !log.is_enabled() {
            return;
        }
        self.audit = Some(ExecAudit {
            log: log.clone(),
            owner: session.owner.clone(),
            session: session.id.clone(),
            seen: Some(session.clone()),
            attach: true,
            start: None,
            proc: Some(proc),
            t0: Instant::now(),
            done: false,
        });
    }

    /// Audits this call as the command `req` of `session`: an `exec`
    /// record once it runs (with its process id), an `exit` one at its end.
    pub(super) fn audit_as(
        &mut self,
        session: &Session,
        log: &crate::audit::Log,
        req: &ExecRequest,
        extra: Value,
    ) {
        if !log.is_enabled() {
            return;
        }
        let mut start = json!({
            "argv": req.argv, "shell": req.shell, "cwd": req.cwd,
            "envNames": req.env.keys().collect::<Vec<_>>(),
            "uid": req.uid, "gid": req.gid,
            "pty": req.pty.is_some(), "background": req.background, "tag": req.tag,
            "timeoutMs": req.timeout_ms, "call": self.call.id,
        });
        if let (Some(m), Value::Object(x)) = (start.as_object_mut(), extra) {
            m.extend(x);
        }
        self.audit = Some(ExecAudit {
            log: log.clone(),
            owner: session.owner.clone(),
            session: session.id.clone(),
            seen: None,
            attach: false,
            start: Some(start),
            proc: None,
            t0: Instant::now(),
            done: false,
        });
    }

    /// Records one guest-reported event of this command in the session's
    /// audit log: `kind` `"proc"` (a process of the tree it grew) or
    /// `"file"` (a file it changed), `fields` the event's JSON object. The
    /// record gets `exec` (this command's process id) and `reportedBy:
    /// "guest"`; both kinds are rate-limited per session (summarised when
    /// over). Does nothing for a call that is not an audited command.
    pub fn audit_guest(&self, kind: &'static str, fields: Value) {
        if let Some(a) = &self.audit {
            a.guest(kind, fields);
        }
    }

    /// Renames the call for the errors that follow.
    pub fn set_what(&mut self, what: impl Into<String>) {
        self.what = what.into();
    }

    /// The call's id on the agent connection (for logs).
    pub fn id(&self) -> u64 {
        self.call.id
    }

    fn err(&self, source: ClientError) -> OpsError {
        OpsError::Agent {
            what: self.what.clone(),
            source,
        }
    }

    /// The command ended (or its call failed): its files go now, before
    /// its answer reaches the client (who may look for them next).
    fn ended(&mut self) {
        if let Some(mut f) = self.secrets.take() {
            f.remove();
        }
    }

    /// `None` for what no front end shows (EOF marks, other events).
    fn event(&mut self, m: Inbound) -> OpsResult<Option<ExecEvent>> {
        let r = self.convert(m);
        if let Some(a) = &mut self.audit {
            match &r {
                Ok(Some(ExecEvent::Started { proc, pid })) => a.started(Some(*proc), Some(*pid)),
                Ok(Some(ExecEvent::Exited(st))) => {
                    if let Some(g) = &st.audit {
                        for ev in &g.procs {
                            // The record's `kind` is `proc`; the event's
                            // (fork, exec, uid, exit) is its `event`.
                            let mut v = json!(ev);
                            if let Some(m) = v.as_object_mut() {
                                if let Some(k) = m.remove("kind") {
                                    m.insert("event".into(), k);
                                }
                            }
                            a.guest("proc", v);
                        }
                        for f in &g.files {
                            let mut v = json!(f);
                            // A secret copied into a file must not reach
                            // the log through its diff or name.
                            for k in ["path", "diff"] {
                                if let Some(t) = v[k].as_str() {
                                    v[k] = json!(self.masker.mask_text(t));
                                }
                            }
                            a.guest("file", v);
                        }
                    }
                    a.exited(st)
                }
                Ok(Some(ExecEvent::Background { proc, pid })) => {
                    a.started(Some(*proc), Some(*pid));
                    // It runs on; its exit is not this call's.
                    a.done = true;
                }
                Err(e) => a.ended("error", Some(e.to_string())),
                _ => {}
            }
        }
        if matches!(r, Ok(Some(ExecEvent::Exited(_))) | Err(_)) {
            self.ended();
        }
        if let (Ok(Some(ExecEvent::Started { proc, .. })), Some(f)) = (&r, &self.secrets) {
            f.started(*proc);
        }
        match r {
            Ok(Some(ExecEvent::Output { stream, bytes })) => {
                let bytes = self.masker.push(stream as usize, &bytes);
                Ok((!bytes.is_empty()).then_some(ExecEvent::Output { stream, bytes }))
            }
            Ok(Some(ev @ ExecEvent::Exited(_))) if !self.masker.is_empty() => {
                // What the masker held of each stream, before the end.
                for stream in [Stream::Stdout, Stream::Stderr] {
                    let bytes = self.masker.flush(stream as usize);
                    if !bytes.is_empty() {
                        self.queue.push_back(ExecEvent::Output { stream, bytes });
                    }
                }
                self.queue.push_back(ev);
                Ok(self.queue.pop_front())
            }
            other => other,
        }
    }

    fn convert(&self, m: Inbound) -> OpsResult<Option<ExecEvent>> {
        Ok(Some(match m {
            Inbound::Data { channel, bytes } => ExecEvent::Output {
                stream: Stream::of(channel),
                bytes,
            },
            Inbound::Event(Event::Started { proc, pid }) => ExecEvent::Started { proc, pid },
            Inbound::Event(Event::Dropped { bytes }) => ExecEvent::Dropped { bytes },
            Inbound::Response(Response::Exited(st)) => ExecEvent::Exited(st),
            Inbound::Response(Response::Started { proc, pid }) => {
                ExecEvent::Background { proc, pid }
            }
            Inbound::Response(r) => return Err(OpsError::UnexpectedAnswer(format!("{r:?}"))),
            Inbound::Error(e) => return Err(self.err(ClientError::Agent(e))),
            _ => return Ok(None),
        }))
    }

    /// The next event, waiting until `deadline` (none: for ever); past it,
    /// an agent timeout error.
    pub fn next(&mut self, deadline: Option<Instant>) -> OpsResult<ExecEvent> {
        if let Some(ev) = self.queue.pop_front() {
            return Ok(ev);
        }
        loop {
            let m = match deadline {
                Some(d) => self.call.recv_deadline(d),
                None => self.call.recv(),
            };
            let m = m.map_err(|e| self.err(e))?;
            if let Some(ev) = self.event(m)? {
                return Ok(ev);
            }
        }
    }

    /// Whatever arrives within `t`: `None` when nothing (worth showing)
    /// did, so a caller can look at its own stop conditions in between.
    pub fn poll(&mut self, t: Duration) -> OpsResult<Option<ExecEvent>> {
        if let Some(ev) = self.queue.pop_front() {
            return Ok(Some(ev));
        }
        match self.call.recv_timeout(t) {
            Ok(Some(m)) => self.event(m),
            Ok(None) => Ok(None),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Input for the process (an attach with stdin), then EOF if `eof`.
    pub fn send_input(&self, data: &[u8], eof: bool) -> OpsResult<()> {
        self.call
            .send_all(data)
            .and_then(|_| if eof { self.call.send_eof() } else { Ok(()) })
            .map_err(|e| self.err(e))
    }

    /// Asks the guest to end the call (the command is killed); events up
    /// to its end still arrive.
    pub fn cancel(&self) {
        let _ = self.call.cancel();
    }
}

/// The input side of a call, for a thread other than the one reading its
/// events (a WebSocket's reader): stdin, EOF, cancel.
pub struct Input {
    tx: CallSender,
    what: String,
}

impl Input {
    fn err(&self, source: ClientError) -> OpsError {
        OpsError::Agent {
            what: self.what.clone(),
            source,
        }
    }

    pub fn send(&self, data: &[u8]) -> OpsResult<()> {
        self.tx.send_all(data).map_err(|e| self.err(e))
    }

    pub fn eof(&self) -> OpsResult<()> {
        self.tx.send_eof().map_err(|e| self.err(e))
    }

    /// As [`Running::cancel`]: a foreground command is killed, an attach
    /// detaches; the reading side then sees the end.
    pub fn cancel(&self) {
        let _ = self.tx.cancel();
    }
}

impl Running {
    /// The call's input side ([`Input`]).
    pub fn input(&self) -> Input {
        Input {
            tx: self.call.sender(),
            what: self.what.clone(),
        }
    }
}

/// Output kept up to `max` bytes, both streams together; what goes over
/// is dropped and `truncated` set.
pub struct Captured {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub truncated: bool,
    max: usize,
}

impl Captured {
    pub fn new(max: usize) -> Captured {
        Captured {
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: false,
            max,
        }
    }

    pub fn push(&mut self, stream: Stream, bytes: &[u8]) {
        let room = self
            .max
            .saturating_sub(self.stdout.len() + self.stderr.len());
        let buf = match stream {
            Stream::Stderr => &mut self.stderr,
            Stream::Stdout => &mut self.stdout,
        };
        if bytes.len() > room {
            self.truncated = true;
        }
        buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }
}

/// The metrics' name for how a command ended.
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

/// Ends seen per session: the oldest are forgotten past this.
const MAX_AUDITED_EXITS: usize = 4096;

/// Notes that `proc`'s end is recorded now; false if it was already.
pub(super) fn first_end(s: &Session, proc: u64) -> bool {
    let mut seen = crate::sync::lock(&s.audited_exits);
    let new = seen.insert(proc);
    while seen.len() > MAX_AUDITED_EXITS {
        seen.pop_first();
    }
    new
}

/// An `exit` audit record's fields: code, signal, how it ended, usage.
pub(super) fn exit_fields(proc: Option<u64>, st: &ExitStatus) -> Value {
    let outcome = if st.timed_out {
        "timeout"
    } else if st.signal.is_some() {
        "killed"
    } else {
        "exited"
    };
    let mut r = json!({
        "proc": proc, "exitCode": st.code,
        "signal": st.signal.map(crate::proto::Signal::name_of),
        "outcome": outcome,
    });
    if let Some(m) = r.as_object_mut() {
        for (k, v) in usage_fields(st) {
            m.insert(k.into(), v);
        }
    }
    r
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: Value) -> ExecSpec {
        serde_json::from_value(v).unwrap()
    }

    /// REST's bodies and MCP's arguments (command + args) meet in one
    /// request; the limits are the config's.
    #[test]
    fn one_validation_for_every_front_end() {
        let cfg = Config::default();
        let a = spec(json!({"argv": ["ls", "-l"]})).prepare(&cfg).unwrap();
        let b = spec(json!({"command": "ls", "args": ["-l"]}))
            .prepare(&cfg)
            .unwrap();
        assert_eq!((&a.req.argv, &a.req.shell), (&b.req.argv, &b.req.shell));
        let max = cfg.max_exec_timeout.as_millis() as u64;
        assert!(matches!(
            spec(json!({"command": "x", "timeout": max + 1})).prepare(&cfg),
            Err(OpsError::TimeoutTooLong { ms, max: m }) if ms == max + 1 && m == max
        ));
        let bg = spec(json!({"command": "x", "background": true}))
            .prepare(&cfg)
            .unwrap();
        assert_eq!((bg.req.timeout_ms, bg.req.stdin), (None, true));
        let fg = spec(json!({"command": "x"})).prepare(&cfg).unwrap();
        assert_eq!(
            fg.req.timeout_ms,
            Some(cfg.default_exec_timeout.as_millis() as u64)
        );
        for bad in [
            json!({}),
            json!({"command": ""}),
            json!({"argv": []}),
            json!({"command": "x", "timeout": 0}),
            json!({"command": "x", "env": {"A=B": "c"}}),
            json!({"command": "x", "cwd": ""}),
            json!({"command": "x", "tag": "t".repeat(257)}),
        ] {
            assert!(spec(bad.clone()).prepare(&cfg).is_err(), "{bad}");
        }
    }

    #[test]
    fn captured_caps_both_streams_together() {
        let mut c = Captured::new(5);
        c.push(Stream::Stdout, b"abc");
        c.push(Stream::Stderr, b"defg");
        assert_eq!(
            (&c.stdout[..], &c.stderr[..], c.truncated),
            (&b"abc"[..], &b"de"[..], true)
        );
    }
}
