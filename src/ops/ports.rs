//! Guest ports reachable from outside: preview URLs (issue #26).
//!
//! `POST /v1/sessions/:id/ports {port, ttl?, public?}` grants the port a
//! token (128 random bits), the secret part of its URLs: the path form
//! `<preview>/ports/<token>/...` needs no DNS; the host form
//! `<port>-<session>.<preview_domain>` serves apps that use absolute
//! paths, its token in a host-only cookie (`?asbx_token=` on the URL the
//! API gives sets it) or an `X-Asbx-Token` header. A
//! `public` port is reached by whoever has the URL; one that is not also
//! needs the owner's API key (`Authorization: Bearer`, never passed on to
//! the guest). Grants end with their TTL, the session, or a DELETE; while
//! the session is paused its ports answer 503 and they work again after
//! the resume. The preview listener that serves them is
//! `server::preview`; the daemon dials the guest (`net::connect`), never
//! the other way round.

use super::{Ops, OpsError, OpsResult};
use crate::session::{now_unix_ms, PortGrant, Session, State};
use crate::sync::lock;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Ports one session may have open at once.
pub const MAX_PORTS: usize = 16;
/// A grant's lifetime unless the request names one, and its most.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// The relay the preview listener copies bytes with (one definition, the
/// egress proxy's).
pub use crate::net::proxy::splice;

/// What the API shows of an open port.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PortView {
    pub session_id: String,
    pub port: u16,
    /// Path form: works wherever the preview listener is reached.
    pub url: String,
    /// Host form (`<port>-<session>.<preview_domain>/?asbx_token=<token>`),
    /// with a preview domain and a session id that is a DNS label.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_url: Option<String>,
    pub public: bool,
    pub created_at: u64,
    pub expires_at: u64,
}

impl PortView {
    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// A 128-bit token, lower-case hex (also a DNS label); `p-<host>-<hex>`
/// on a host with an id, so the router finds the host from the URL.
fn new_token() -> OpsResult<String> {
    let mut b = [0u8; 16];
    crate::harden::random::secure_random(&mut b)
        .map_err(|e| OpsError::Internal(format!("making a port token: {e}")))?;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(crate::router::tagged_or_bare(
        crate::router::PORT_TOKEN,
        hex,
    ))
}

/// Whether a (lower-cased) session id can stand in a host-form preview
/// name: `<port>-<session>` must be one DNS label (letters, digits and
/// hyphens, at most 63 bytes with the port).
pub fn host_label_session(id: &str) -> bool {
    !id.is_empty()
        && id.len() + 6 <= 63
        && !id.ends_with('-')
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Whether `t` looks like a token (checked before any lookup).
pub fn is_token(t: &str) -> bool {
    let hex = |t: &str| {
        t.len() == 32
            && t.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    hex(t) || crate::router::is_made_id(t, crate::router::PORT_TOKEN, 32)
}

impl Ops {
    /// Where clients reach the preview listener (`None`: none runs).
    pub fn preview_base(&self) -> Option<String> {
        lock(&self.preview).clone()
    }

    /// The preview listener is up at `base` (its bound address, or the
    /// configured `preview_url`).
    pub fn set_preview_base(&self, base: String) {
        *lock(&self.preview) = Some(base.trim_end_matches('/').to_string());
    }

    fn port_view(&self, s: &Session, g: &PortGrant) -> PortView {
        let base = self.preview_base().unwrap_or_default();
        let host_url = self
            .cfg
            .preview_domain
            .as_ref()
            .filter(|_| host_label_session(&s.id.to_ascii_lowercase()))
            .map(|d| {
                // The base's scheme and port, `<port>-<session>` as the host.
                let (scheme, rest) = base.split_once("://").unwrap_or(("http", &base));
                let hp = rest
                    .split('/')
                    .next()
                    .and_then(|hp| hp.rsplit_once(':'))
                    .map(|(_, p)| format!(":{p}"))
                    .unwrap_or_default();
                format!(
                    "{scheme}://{}-{}.{d}{hp}/?asbx_token={}",
                    g.port,
                    s.id.to_ascii_lowercase(),
                    g.token
                )
            });
        PortView {
            session_id: s.id.clone(),
            port: g.port,
            url: format!("{base}/ports/{}/", g.token),
            host_url,
            public: g.public,
            created_at: g.created_unix_ms,
            expires_at: g.expires_unix_ms,
        }
    }

    /// Opens guest `port` of `s` to the outside for `ttl` (default
    /// [`DEFAULT_TTL`], at most [`MAX_TTL`] and the session's life). A
    /// port already open gets a new token (the old URL stops working).
    pub fn expose_port(
        &self,
        s: &Session,
        port: u32,
        ttl: Option<Duration>,
        public: bool,
    ) -> OpsResult<PortView> {
        if self.preview_base().is_none() {
            return Err(OpsError::NotSupported(
                "this daemon has no preview listener: start it with --preview-listen ADDR \
                 (config preview_listen)"
                    .into(),
            ));
        }
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| OpsError::BadRequest(format!("port {port}: 1 to 65535")))?;
        let ttl = ttl.unwrap_or(DEFAULT_TTL);
        if ttl > MAX_TTL {
            return Err(OpsError::BadRequest(format!(
                "ttl {ttl:?}: at most {MAX_TTL:?}"
            )));
        }
        let now = now_unix_ms();
        let left = s
            .expires()
            .saturating_duration_since(std::time::Instant::now());
        let g = PortGrant {
            port,
            token: new_token()?,
            public,
            created_unix_ms: now,
            expires_unix_ms: now + ttl.min(left).as_millis() as u64,
        };
        let mut ports = lock(&s.ports);
        ports.retain(|_, g| g.expires_unix_ms > now);
        if !ports.contains_key(&port) && ports.len() >= MAX_PORTS {
            return Err(OpsError::BadRequest(format!(
                "session {} has {MAX_PORTS} ports open, the most: close one first",
                s.id
            )));
        }
        ports.insert(port, g.clone());
        drop(ports);
        log::info!(
            "session {}/{}: port {port} open to the outside ({}) until {}",
            s.owner,
            s.id,
            if public { "public" } else { "with the key" },
            g.expires_unix_ms
        );
        Ok(self.port_view(s, &g))
    }

    /// The session's open ports (expired ones dropped).
    pub fn ports(&self, s: &Session) -> Vec<PortView> {
        let now = now_unix_ms();
        let mut ports = lock(&s.ports);
        ports.retain(|_, g| g.expires_unix_ms > now);
        let list: Vec<PortGrant> = ports.values().cloned().collect();
        drop(ports);
        list.iter().map(|g| self.port_view(s, g)).collect()
    }

    /// Closes `port`; false when it was not open.
    pub fn close_port(&self, s: &Session, port: u32) -> OpsResult<bool> {
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| OpsError::BadRequest(format!("port {port}: 1 to 65535")))?;
        Ok(lock(&s.ports).remove(&port).is_some())
    }

    /// The session and grant a preview `token` names, if it is open.
    pub fn preview_target(&self, token: &str) -> Option<(Arc<Session>, PortGrant)> {
        if !is_token(token) {
            return None;
        }
        let now = now_unix_ms();
        for s in self.mgr.list(None) {
            if matches!(s.state(), State::Closing | State::Failed(_)) {
                continue;
            }
            let hit = lock(&s.ports)
                .values()
                .find(|g| g.token == token && g.expires_unix_ms > now)
                .cloned();
            if let Some(g) = hit {
                return Some((s, g));
            }
        }
        None
    }

    /// A connection to `s`'s guest `port`.
    pub fn dial_guest(&self, s: &Session, port: u16) -> Result<std::net::TcpStream, DialError> {
        if s.state() == State::Paused {
            return Err(DialError::Paused);
        }
        let c = s
            .guest_connector(Duration::from_secs(5))
            .map_err(|e| DialError::Gone(e.to_string()))?
            .ok_or(DialError::NoNetwork)?;
        c.connect(port, Duration::from_secs(3))
            .map_err(|e| DialError::Unreachable(e.to_string()))
    }
}

/// Why a preview request could not reach the guest.
#[derive(Debug)]
pub enum DialError {
    /// The session is paused (its ports work again after a resume).
    Paused,
    /// No per-session networking: nothing leads to the guest.
    NoNetwork,
    /// Nothing answers on the port (or the connect failed).
    Unreachable(String),
    /// The session ended or failed meanwhile.
    Gone(String),
}
