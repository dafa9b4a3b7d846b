//! Short-lived tickets for WebSocket connections from browsers, which
//! cannot set an `Authorization` header on a WebSocket (issue #26).
//!
//! `POST /v1/sessions/:id/ws-token` (with the API key) gives a ticket
//! bound to that key and session, good for one connection within
//! [`TTL`]; the WebSocket routes take it as `?token=`. A ticket is 128
//! random bits, kept only in memory, used up by its first connection.

use super::{Ops, OpsError, OpsResult, Principal};
use crate::session::{now_unix_ms, Session};
use crate::sync::lock;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const TTL: Duration = Duration::from_secs(60);
/// Tickets not yet used, over all keys (the oldest go first past it) ...
pub const MAX_TICKETS: usize = 1024;
/// ... and per key.
pub const MAX_PER_KEY: usize = 16;

struct Held {
    /// Issue order: the oldest goes first.
    n: u64,
    principal: Principal,
    session: String,
    until: Instant,
}

#[derive(Default)]
pub struct Tickets(Mutex<HashMap<String, Held>>, std::sync::atomic::AtomicU64);

/// A ticket as the API shows it.
pub struct Ticket {
    pub token: String,
    pub expires_at: u64,
}

impl Tickets {
    /// A new ticket for `p` on session `session`. A key holds at most
    /// [`MAX_PER_KEY`] (its oldest goes), so no key can push out others'.
    fn issue(&self, p: &Principal, session: &str) -> OpsResult<Ticket> {
        let mut b = [0u8; 16];
        crate::harden::random::secure_random(&mut b)
            .map_err(|e| OpsError::Internal(format!("making a ticket: {e}")))?;
        let token: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let now = Instant::now();
        let mut m = lock(&self.0);
        m.retain(|_, h| h.until > now);
        let oldest = |m: &HashMap<String, Held>, key: Option<&str>| {
            m.iter()
                .filter(|(_, h)| key.is_none_or(|k| h.principal.id == k))
                .min_by_key(|(_, h)| h.n)
                .map(|(k, _)| k.clone())
        };
        if m.values().filter(|h| h.principal.id == p.id).count() >= MAX_PER_KEY {
            if let Some(k) = oldest(&m, Some(&p.id)) {
                m.remove(&k);
            }
        }
        if m.len() >= MAX_TICKETS {
            if let Some(k) = oldest(&m, None) {
                m.remove(&k);
            }
        }
        m.insert(
            token.clone(),
            Held {
                n: self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                principal: p.clone(),
                session: session.to_string(),
                until: now + TTL,
            },
        );
        Ok(Ticket {
            token,
            expires_at: now_unix_ms() + TTL.as_millis() as u64,
        })
    }

    fn redeem(&self, session: &str, token: &str) -> Option<Principal> {
        let mut m = lock(&self.0);
        let h = m.remove(token)?;
        (h.session == session && h.until > Instant::now()).then_some(h.principal)
    }
}

impl Ops {
    /// A ticket for one WebSocket connection to session `s`, acting as `p`.
    pub fn ws_ticket(&self, p: &Principal, s: &Session) -> OpsResult<Ticket> {
        self.tickets.issue(p, &s.id)
    }

    /// Uses up `token` for session `session`: whom it acts for, or `None`
    /// (unknown, expired, used, or another session's).
    pub fn redeem_ws_ticket(&self, session: &str, token: &str) -> Option<Principal> {
        self.tickets.redeem(session, token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> Principal {
        Principal {
            id: id.into(),
            scopes: vec![],
        }
    }

    #[test]
    fn one_use_own_session_and_bounded_per_key() {
        let t = Tickets::default();
        let a = t.issue(&key("a"), "s1").unwrap();
        assert!(t.redeem("s2", &a.token).is_none(), "another session's");
        assert!(t.redeem("s1", &a.token).is_none(), "used up by the try");
        let a = t.issue(&key("a"), "s1").unwrap();
        assert_eq!(t.redeem("s1", &a.token).map(|p| p.id), Some("a".into()));
        assert!(t.redeem("s1", &a.token).is_none(), "one use");
        // One key's flood pushes out only its own.
        let b = t.issue(&key("b"), "s1").unwrap();
        let many: Vec<Ticket> = (0..MAX_PER_KEY + 5)
            .map(|_| t.issue(&key("a"), "s1").unwrap())
            .collect();
        assert_eq!(lock(&t.0).len(), MAX_PER_KEY + 1);
        assert!(t.redeem("s1", &many[0].token).is_none(), "a's oldest went");
        assert!(t.redeem("s1", &many[MAX_PER_KEY + 4].token).is_some());
        assert_eq!(t.redeem("s1", &b.token).map(|p| p.id), Some("b".into()));
    }
}
