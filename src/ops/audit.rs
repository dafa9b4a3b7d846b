//! Reading a session's audit log back (`GET /v1/sessions/:id/audit`):
//! its owner or an admin, also after the session is gone (the files stay
//! until retention removes them).

use super::{validate, Ops, OpsError, OpsResult, Principal};
use serde_json::{json, Map, Value};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A session's audit files, found for a caller.
pub struct AuditFiles {
    pub owner: String,
    pub session: String,
    /// Oldest first: rotated ones, then the current one.
    pub files: Vec<PathBuf>,
    /// The last record written when they were looked up: (seq, hash). A
    /// copy that ends before it was cut short.
    pub head: Option<(u64, String)>,
}

/// A request's parameters as the audit log keeps them (REST bodies and
/// MCP arguments alike): `secrets` and `env` reduced to their names, file
/// contents, stdin, process input (its own `pty_input`/`stdin` record has
/// it) and code to their size, anything named like a
/// credential (`value`, `token`, `password`, `apiKey`) masked; nested
/// objects the same way.
pub fn audited(params: &Map<String, Value>) -> Map<String, Value> {
    let mut out = Map::new();
    for (k, v) in params {
        let lk = k.to_ascii_lowercase();
        let v = match (lk.as_str(), v) {
            ("secrets" | "env", Value::Object(m)) => json!(m.keys().collect::<Vec<_>>()),
            ("secrets", Value::Array(a)) => json!(a
                .iter()
                .map(|s| match s {
                    Value::Object(m) => Value::Object(audited(m)),
                    _ => json!("****"),
                })
                .collect::<Vec<_>>()),
            ("secrets" | "env", _) => json!("****"),
            (
                "content" | "contentbase64" | "data" | "stdin" | "stdinbase64" | "code" | "input",
                v,
            ) => {
                json!({"leftOut": true, "bytes": v.as_str().map_or(0, str::len)})
            }
            (k, _)
                if ["value", "token", "password", "apikey", "secret"]
                    .iter()
                    .any(|w| k.contains(w)) =>
            {
                json!("****")
            }
            (_, Value::Object(m)) => Value::Object(audited(m)),
            (_, v) => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    out
}

/// A follow ends after this long at most.
const MAX_FOLLOW: Duration = Duration::from_secs(3600);

impl Ops {
    /// The audit files of session `id`: the caller's own, or with an admin
    /// key those of `owner` (or, without it, of the live session of that id).
    pub fn audit_files(
        &self,
        p: &Principal,
        owner: Option<&str>,
        id: &str,
    ) -> OpsResult<AuditFiles> {
        validate::session_id(id)?;
        let log = self.audit();
        if !log.is_enabled() {
            return Err(OpsError::NotSupported(
                "the audit log is off on this daemon (config audit.enabled)".into(),
            ));
        }
        let owner = match owner {
            Some(_) => self.owner_for(p, owner)?,
            None if p.is_admin() => self
                .mgr
                .list(None)
                .into_iter()
                .find(|s| s.id == id)
                .map_or(p.id.clone(), |s| s.owner.clone()),
            None => p.id.clone(),
        };
        // What was recorded until now is on disk (bounded wait).
        log.flush(Duration::from_secs(2));
        let files = log.files(&owner, id);
        if files.is_empty() {
            return Err(OpsError::SessionNotFound { id: id.to_string() });
        }
        let head = log.head(&owner, id);
        Ok(AuditFiles {
            owner,
            session: id.to_string(),
            files,
            head,
        })
    }

    /// Writes the files' bytes to `out` in order; with `follow`, then what
    /// is appended (across rotations) until `out` fails, the session has
    /// been gone a while, the daemon closes or an hour passed.
    pub fn audit_stream(&self, a: &AuditFiles, follow: bool, out: &mut dyn FnMut(&[u8]) -> bool) {
        let mut buf = vec![0u8; 64 << 10];
        let n = a.files.len();
        for (i, f) in a.files.iter().enumerate() {
            let Ok(mut file) = std::fs::File::open(f) else {
                continue;
            };
            if !copy(&mut file, &mut buf, out) {
                return;
            }
            if i + 1 == n && follow {
                self.follow(a, file, &mut buf, out);
            }
        }
    }

    fn follow(
        &self,
        a: &AuditFiles,
        mut file: std::fs::File,
        buf: &mut [u8],
        out: &mut dyn FnMut(&[u8]) -> bool,
    ) {
        let cur = a.files.last().cloned().unwrap_or_default();
        let t0 = Instant::now();
        let mut gone_since: Option<Instant> = None;
        while t0.elapsed() < MAX_FOLLOW && !self.mgr.is_closing() {
            std::thread::sleep(Duration::from_millis(250));
            if !copy(&mut file, buf, out) {
                return;
            }
            // Rotated: our handle is the renamed file (read to its end
            // above); the path names a new current file.
            let ino = file.metadata().map(|m| m.ino()).ok();
            let now = std::fs::metadata(&cur).map(|m| m.ino()).ok();
            if now.is_some() && now != ino {
                if !copy(&mut file, buf, out) {
                    return;
                }
                match std::fs::File::open(&cur) {
                    Ok(f) => file = f,
                    Err(_) => return,
                }
                let _ = file.seek(SeekFrom::Start(0));
            }
            if self.mgr.get(&a.owner, &a.session).is_none() {
                let since = *gone_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(3) {
                    self.audit().flush(Duration::from_secs(1));
                    let _ = copy(&mut file, buf, out);
                    return;
                }
            }
        }
    }
}

/// Whole lines only go out: a line being written is sent once complete.
fn copy(file: &mut std::fs::File, buf: &mut [u8], out: &mut dyn FnMut(&[u8]) -> bool) -> bool {
    loop {
        let n = match file.read(buf) {
            Ok(0) | Err(_) => return true,
            Ok(n) => n,
        };
        let end = buf[..n]
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |i| i + 1);
        if end < n {
            // Back to the start of the partial line.
            let _ = file.seek(SeekFrom::Current(end as i64 - n as i64));
        }
        if end == 0 {
            return true;
        }
        if !out(&buf[..end]) {
            return false;
        }
    }
}
