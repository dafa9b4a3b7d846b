//! Session operations: create (explicit, and the lazy create of a
//! seed route's first use), find, list, delete, keepalive, and the wait
//! for a new session's sandbox. [`SessionSpec`] is what both front ends
//! parse a create request into; [`SessionView`] is what they show of a
//! session.

use super::{validate, Ops, OpsError, OpsResult, Principal};
use crate::config::parse_duration;
use crate::net::inject::{SecretInfo, SecretSpec};
use crate::net::EgressPolicy;
use crate::proto::Request;
pub use crate::session::OnIdle;
use crate::session::{now_unix_ms, Session, SessionOptions, State};
use crate::sync::lock;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A session to create, as a client asks for it (REST's body, MCP's
/// arguments). Absent fields take the configured defaults; the shape is
/// checked against the configured and host maxima by the session manager.
#[derive(Debug, Default)]
pub struct SessionSpec {
    /// Absent: generated (`s-` and 12 hex digits).
    pub id: Option<String>,
    pub template: Option<String>,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u32>,
    pub disk_mib: Option<u32>,
    /// Maximum lifetime.
    pub ttl: Option<Span>,
    pub idle_timeout: Option<Span>,
    pub env: BTreeMap<String, String>,
    pub egress: Option<EgressPolicy>,
    /// `destroy` (default) or `pause` when idle past `idle_timeout`.
    pub on_idle: Option<OnIdle>,
    /// How long the session may stay paused.
    pub paused_ttl: Option<Span>,
    /// Start from this checkpoint (`snap-...`) instead of the template:
    /// its template and shape are the checkpoint's (issue #21).
    pub from_snapshot: Option<String>,
    /// With `from_snapshot`: how many sessions ([`Ops::create_many`]).
    pub count: Option<u32>,
    /// Credentials the egress proxy injects (`net::inject`).
    pub secrets: Vec<SecretSpec>,
}

/// A duration as a client gives it: seconds, or text like `30m`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Span {
    Secs(f64),
    Text(String),
}

impl Span {
    /// The duration, positive; `what` names the field in the error.
    pub fn get(&self, what: &str) -> OpsResult<Duration> {
        let d = match self {
            Span::Secs(s) if s.is_finite() && *s > 0.0 && *s < 1e9 => Duration::from_secs_f64(*s),
            Span::Secs(s) => return Err(OpsError::BadRequest(format!("{what} {s} out of range"))),
            Span::Text(t) => parse_duration(t).map_err(OpsError::BadRequest)?,
        };
        if d.is_zero() {
            return Err(OpsError::BadRequest(format!("{what} must be positive")));
        }
        Ok(d)
    }
}

/// A session as the API shows it (`/v1` and, with fields added, the seed
/// routes; MCP shows a part). Times are ms since the epoch.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionView {
    pub id: String,
    pub session_id: String,
    pub owner: String,
    pub template: String,
    pub state: &'static str,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub env: BTreeMap<String, String>,
    pub egress: EgressPolicy,
    pub created_at: u64,
    pub last_used_at: u64,
    pub expires_at: u64,
    pub idle_timeout_ms: u64,
    pub on_idle: OnIdle,
    pub paused_ttl_ms: u64,
    /// While paused: its checkpoint's size on disk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_bytes: Option<u64>,
    /// While paused: when it was paused (ms since the epoch).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<u64>,
    /// While paused: when it is removed unless resumed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_expires_at: Option<u64>,
    pub busy: bool,
    /// Injected secrets: names, hosts, header and placeholder, never the
    /// value.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretInfo>,
    /// The session's state itself (the seed names it its own way).
    #[serde(skip)]
    pub phase: State,
}

impl SessionView {
    pub fn of(s: &Session) -> SessionView {
        let now = Instant::now();
        let unix_ms = |i: Instant| -> u64 {
            let delta = i.saturating_duration_since(now).as_millis() as u64;
            now_unix_ms() + delta
        };
        let phase = s.state();
        let paused = s.paused();
        SessionView {
            id: s.id.clone(),
            session_id: s.id.clone(),
            owner: s.owner.clone(),
            template: s.spec.template.clone(),
            state: state_name(&phase),
            vcpus: s.spec.vcpus,
            memory_mib: s.spec.mem_mib,
            disk_mib: s.spec.disk_mib,
            env: s.spec.env.clone(),
            egress: lock(&s.egress).clone(),
            created_at: s.created_unix_ms,
            last_used_at: now_unix_ms().saturating_sub(s.idle_for().as_millis() as u64),
            expires_at: unix_ms(s.expires()),
            idle_timeout_ms: s.idle_timeout.as_millis() as u64,
            on_idle: s.on_idle,
            paused_ttl_ms: s.paused_ttl.as_millis() as u64,
            snapshot_bytes: paused.as_ref().map(|p| p.bytes),
            paused_at: paused.as_ref().map(|p| p.since_unix_ms),
            paused_expires_at: paused.as_ref().map(|p| p.expires_unix_ms),
            busy: s.busy(),
            secrets: s.secrets_info(),
            phase,
        }
    }

    /// As JSON (the front ends' replies are `Value`s).
    pub fn json(&self) -> serde_json::Value {
        // A struct of strings, numbers and maps of strings: cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }
}

fn state_name(s: &State) -> &'static str {
    match s {
        State::Starting => "starting",
        State::Ready => "ready",
        State::Failed(_) => "failed",
        State::Paused => "paused",
        State::Closing => "closing",
    }
}

/// The ranges any session's shape is within, and the share of the host's
/// RAM one may take: for the front ends' schemas and argument checks.
pub use crate::session::limits::{DISK_MIB, HOST_MEM_PERCENT, MEM_MIB, VCPUS};

/// `v` of shape field `field` within `range` (the session manager's own
/// check; out of range is `invalid_shape`, naming the field and range).
pub fn check_range(field: &str, v: u64, range: &RangeInclusive<u32>) -> OpsResult<u32> {
    Ok(crate::session::limits::check_range(field, v, range)?)
}

/// What the session manager takes of `spec`: its durations and env
/// checked (ttl, idleTimeout, env, pausedTtl, in that order).
pub(super) fn options(spec: SessionSpec) -> OpsResult<SessionOptions> {
    Ok(SessionOptions {
        template: spec.template,
        vcpus: spec.vcpus,
        mem_mib: spec.memory_mib,
        disk_mib: spec.disk_mib,
        ttl: spec.ttl.map(|d| d.get("ttl")).transpose()?,
        idle_timeout: spec
            .idle_timeout
            .map(|d| d.get("idleTimeout"))
            .transpose()?,
        env: validate::env(spec.env)?,
        egress: spec.egress,
        on_idle: spec.on_idle,
        paused_ttl: spec.paused_ttl.map(|d| d.get("pausedTtl")).transpose()?,
        secrets: {
            crate::net::inject::validate(&spec.secrets).map_err(OpsError::BadRequest)?;
            spec.secrets
        },
        secrets_from: None,
    })
}

/// A new session id: `s-` and 12 hex digits, `s-<host>-...` on a host
/// with an id (`router::tagged`).
pub fn new_id() -> OpsResult<String> {
    let r = crate::agent::random_u64()
        .map_err(|e| OpsError::Internal(format!("making a session id: {e}")))?;
    Ok(crate::router::tagged(
        crate::router::SESSION,
        &format!("{:012x}", r & 0xffff_ffff_ffff),
    ))
}

impl Ops {
    /// Session `id` of the owner a request acts for ([`Ops::owner_for`]).
    pub fn find(&self, p: &Principal, owner: Option<&str>, id: &str) -> OpsResult<Arc<Session>> {
        validate::session_id(id)?;
        let owner = self.owner_for(p, owner)?;
        self.session(&owner, id)
    }

    /// Creates the session `spec` names for the caller; an id that exists
    /// is a conflict. Checked in the order REST always did: id, egress,
    /// template, ttl, idle timeout, env; the shape (against the configured
    /// and host maxima, defaults filled in) by the session manager. The sandbox starts in the background: [`Ops::ready`]
    /// waits for it.
    pub fn create(&self, p: &Principal, mut spec: SessionSpec) -> OpsResult<Arc<Session>> {
        let id = match spec.id.take() {
            Some(id) => id,
            None => new_id()?,
        };
        validate::session_id(&id)?;
        if let Some(e) = &spec.egress {
            validate::egress(e, &self.cfg)?;
        }
        if let Some(t) = &spec.template {
            if t.is_empty() || t.len() > 64 {
                return Err(OpsError::BadRequest(
                    "template name must be 1-64 characters".into(),
                ));
            }
        }
        self.can_inject(&spec.secrets)?;
        let opts = options(spec)?;
        let (s, _) = self.mgr.get_or_create(&p.id, &id, opts, true)?;
        Ok(s)
    }

    /// Whether this daemon can inject `secrets` (valid ones: else 400): a
    /// VM backend (501) with per-session networking (409, as a network
    /// change there).
    pub(super) fn can_inject(&self, secrets: &[SecretSpec]) -> OpsResult<()> {
        if secrets.is_empty() {
            return Ok(());
        }
        crate::net::inject::validate(secrets).map_err(OpsError::BadRequest)?;
        if self.mgr.factory.backend() == "local-process" {
            return Err(OpsError::NotSupported(
                "injected secrets need a VM backend with per-session networking".into(),
            ));
        }
        if self.cfg.network.is_none() {
            return Err(OpsError::Session(
                crate::session::SessionError::EgressNotApplied(
                    "injected secrets need per-session networking: this daemon runs with \
                     --network off"
                        .into(),
                ),
            ));
        }
        Ok(())
    }

    /// The caller's session `id`, created with `template` (default: the
    /// configured one) on first use, as the seed's routes do. Also says
    /// whether it was created now.
    pub fn open(
        &self,
        p: &Principal,
        id: &str,
        template: Option<String>,
    ) -> OpsResult<(Arc<Session>, bool)> {
        validate::session_id(id)?;
        let opts = SessionOptions {
            template,
            ..Default::default()
        };
        Ok(self.mgr.get_or_create(&p.id, id, opts, false)?)
    }

    /// Waits until a new session's sandbox answers, so a start failure is
    /// the creator's answer; a session that fails is removed.
    pub fn ready(&self, s: &Session) -> OpsResult<()> {
        let r = self.ping(s);
        if r.is_err() {
            self.mgr.remove(&s.owner, &s.id, "failed to start", false);
        }
        r
    }

    /// One round trip to the session's agent (waiting for it to start).
    pub fn ping(&self, s: &Session) -> OpsResult<()> {
        s.call(Request::Ping, self.cfg.create_timeout)?
            .finish()
            .map_err(OpsError::agent("ping"))?;
        Ok(())
    }

    /// The caller's sessions; with `every_owner`, an admin key sees every
    /// key's (REST does, MCP lists the caller's own).
    pub fn list(&self, p: &Principal, every_owner: bool) -> Vec<SessionView> {
        let owner = (!(every_owner && p.is_admin())).then_some(p.id.as_str());
        self.mgr
            .list(owner)
            .iter()
            .map(|s| SessionView::of(s))
            .collect()
    }

    /// Ends session `id` of `owner`, waiting until its sandbox is gone;
    /// false if there was none. `why` goes to the log.
    pub fn delete(&self, owner: &str, id: &str, why: &str) -> bool {
        self.mgr.remove(owner, id, why, true)
    }

    /// Destroys `old`'s sandbox and creates the session again with the
    /// same id and settings (the lifetime it had left, at least a second).
    /// `why` goes to the log. [`Ops::ready`] waits for the new sandbox.
    pub fn reset(&self, old: Arc<Session>, why: &str) -> OpsResult<Arc<Session>> {
        let opts = SessionOptions {
            template: Some(old.spec.template.clone()),
            vcpus: Some(old.spec.vcpus),
            mem_mib: Some(old.spec.mem_mib),
            disk_mib: Some(old.spec.disk_mib),
            ttl: Some(
                old.expires()
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            ),
            idle_timeout: Some(old.idle_timeout),
            env: old.spec.env.clone(),
            egress: Some(old.spec.egress.clone()),
            on_idle: Some(old.on_idle),
            paused_ttl: Some(old.paused_ttl),
            secrets: Vec::new(),
            // Same placeholders (the caller's code holds them), a new CA.
            secrets_from: old.injection(),
        };
        let (owner, id) = (old.owner.clone(), old.id.clone());
        drop(old);
        self.mgr.remove(&owner, &id, why, true);
        let (s, _) = self.mgr.get_or_create(&owner, &id, opts, true)?;
        Ok(s)
    }

    /// Counts as activity: the idle timeout starts again.
    pub fn keepalive(&self, s: &Session) -> SessionView {
        s.touch();
        SessionView::of(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_positive_seconds_or_text() {
        let get = |v: serde_json::Value| {
            serde_json::from_value::<Span>(v)
                .map_err(|e| e.to_string())
                .and_then(|s| s.get("ttl").map_err(|e| e.to_string()))
        };
        assert_eq!(get(serde_json::json!(90)), Ok(Duration::from_secs(90)));
        assert_eq!(get(serde_json::json!(0.5)), Ok(Duration::from_millis(500)));
        assert_eq!(get(serde_json::json!("2h")), Ok(Duration::from_secs(7200)));
        assert_eq!(get(serde_json::json!(0)), Err("ttl 0 out of range".into()));
        assert_eq!(
            get(serde_json::json!(-1)),
            Err("ttl -1 out of range".into())
        );
        assert_eq!(
            get(serde_json::json!(1e-12)),
            Err("ttl must be positive".into())
        );
        assert!(get(serde_json::json!("soon")).is_err());
        assert!(get(serde_json::json!(true)).is_err());
    }
}
