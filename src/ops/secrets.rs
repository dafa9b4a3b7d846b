//! Episodic secret files: `exec {secrets: {NAME: value}}` puts each value
//! in `/run/secrets/NAME` (a tmpfs in the guest) for that one command, and
//! the daemon removes them once it ends, however it ends (see
//! [`SecretFiles`], held by the command's [`super::exec::Running`]). The
//! values are kept out of every `Debug` form, error and log line: only
//! names are ever shown.

use super::{files, validate, OpsError, OpsResult};
use crate::proto::{FileType, Request, Response};
use crate::session::Session;
use crate::sync::lock;
use serde::{Deserialize, Deserializer};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Where the files go: `/run` is a tmpfs in the guest (never on the
/// rootfs or workspace disk).
pub const DIR: &str = "/run/secrets";

/// An exec's secrets, name to value. Its `Debug` shows names only, and
/// its parse errors never quote the value a client sent.
#[derive(Default, Clone, PartialEq, Eq)]
pub struct Secrets(pub BTreeMap<String, String>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Secrets {
    /// A validated set from JSON (MCP's arguments; REST goes through
    /// `Deserialize`): an object of names to strings.
    pub fn from_json(v: serde_json::Value) -> Result<Secrets, String> {
        let m = match v {
            serde_json::Value::Null => return Ok(Secrets::default()),
            serde_json::Value::Object(m) => m,
            _ => return Err("secrets must be an object of names to strings".into()),
        };
        let mut out = BTreeMap::new();
        for (k, v) in m {
            match v {
                serde_json::Value::String(s) => {
                    out.insert(k, s);
                }
                _ => {
                    let k: String = k.chars().take(80).collect();
                    return Err(format!("secret {k:?} must be a string"));
                }
            }
        }
        Ok(Secrets(out))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'de> Deserialize<'de> for Secrets {
    /// Read as any JSON first: serde's own type errors would quote a
    /// string value (`invalid type: string "hunter2"`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secrets, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        Secrets::from_json(v).map_err(serde::de::Error::custom)
    }
}

/// How many process ids of secret commands a session remembers; far
/// more than the exited processes a guest agent keeps a record of.
const MAX_SECRET_PROCS: usize = 4096;

fn path_of(name: &str) -> String {
    format!("{DIR}/{name}")
}

/// The secret files of one running command. Its names are reserved on
/// the session while it lives (no checkpoint, fork or pause meanwhile; no
/// other command with the same name); [`SecretFiles::remove`] (or its
/// drop) deletes the files in the guest and frees the names.
pub struct SecretFiles {
    session: Arc<Session>,
    /// Every name reserved on the session.
    reserved: Vec<String>,
    /// How many of them (in order) were written, or tried.
    written: usize,
    wait: Duration,
    done: bool,
}

impl SecretFiles {
    /// Writes each secret (mode 0400, owned by root, the uid commands run
    /// as) into [`DIR`] (made 0700 if missing) before the command starts.
    /// Nothing is left behind when one write fails.
    pub fn place(session: &Arc<Session>, s: &Secrets, wait: Duration) -> OpsResult<SecretFiles> {
        validate::secrets(&s.0)?;
        {
            let mut held = lock(&session.secret_files);
            if let Some(n) = s.0.keys().find(|n| held.contains(*n)) {
                return Err(OpsError::SessionBusy {
                    id: session.id.clone(),
                    why: format!(
                        "another running command has the secret file {}; \
                         use another name or wait for it to end",
                        path_of(n)
                    ),
                });
            }
            held.extend(s.0.keys().cloned());
        }
        // From here on the drop frees the names (and removes what was
        // written).
        let mut files = SecretFiles {
            session: session.clone(),
            reserved: s.0.keys().cloned().collect(),
            written: 0,
            wait,
            done: false,
        };
        files.make_dir()?;
        for (name, value) in &s.0 {
            files.written += 1;
            files::write(session, &path_of(name), value.as_bytes(), Some(0o400), wait)?;
        }
        Ok(files)
    }

    /// `/run/secrets`, 0700; an existing one must be a directory (not a
    /// symlink a guest process planted to send the files elsewhere).
    fn make_dir(&self) -> OpsResult<()> {
        let mkdir = Request::Mkdir {
            path: DIR.into(),
            parents: false,
            mode: Some(0o700),
        };
        // It may exist already (an earlier command's): checked just below.
        let _ = self
            .session
            .call(mkdir, self.wait)
            .map(|mut c| c.finish().map(|_| ()));
        let st = Request::Stat { path: DIR.into() };
        match self.session.call(st, self.wait)?.finish() {
            Ok(Response::Stat(st)) if st.file_type == FileType::Dir => Ok(()),
            Ok(Response::Stat(_)) => Err(OpsError::BadRequest(format!(
                "{DIR} in the guest is not a directory; secret files cannot be placed"
            ))),
            Ok(other) => Err(OpsError::unexpected(other)),
            Err(e) => Err(OpsError::agent(format!("stat {DIR}"))(e)),
        }
    }

    /// Deletes the files and frees their names; once only. A file that
    /// cannot be removed is logged by name and its name stays reserved, so
    /// the session is never checkpointed with it (a guest that does not
    /// answer is in no state for one anyway).
    pub fn remove(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let mut kept = Vec::new();
        for name in &self.reserved[..self.written] {
            let path = path_of(name);
            if let Err(e) = files::remove(&self.session, &path, false, self.wait) {
                if !is_not_found(&e) {
                    log::warn!(
                        "session {}: secret file {path} not removed: {e}",
                        self.session.id
                    );
                    kept.push(name.clone());
                }
            }
        }
        let mut held = lock(&self.session.secret_files);
        for name in self.reserved.drain(..) {
            if !kept.contains(&name) {
                held.remove(&name);
            }
        }
    }

    /// The command runs as process `proc`: attaches to it are refused
    /// from now on (see `Ops::attach`).
    pub fn started(&self, proc: u64) {
        let mut procs = lock(&self.session.secret_procs);
        procs.insert(proc);
        while procs.len() > MAX_SECRET_PROCS {
            procs.pop_first();
        }
    }

    /// The files' names (for tests and logs).
    pub fn names(&self) -> &[String] {
        &self.reserved
    }
}

fn is_not_found(e: &OpsError) -> bool {
    matches!(
        e,
        OpsError::Agent {
            source: crate::agent::ClientError::Agent(b),
            ..
        } if b.code == crate::proto::ErrorCode::NotFound
    )
}

impl Drop for SecretFiles {
    fn drop(&mut self) {
        self.remove();
    }
}
