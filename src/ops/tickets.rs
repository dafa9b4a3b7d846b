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
/// Tickets not yet used, over all keys (the oldest go first past it).
pub const MAX_TICKETS: usize = 1024;

struct Held {
    principal: Principal,
    session: String,
    until: Instant,
}

#[derive(Default)]
pub struct Tickets(Mutex<HashMap<String, Held>>);

/// A ticket as the API shows it.
pub struct Ticket {
    pub token: String,
    pub expires_at: u64,
}

impl Ops {
    /// A ticket for one WebSocket connection to session `s`, acting as `p`.
    pub fn ws_ticket(&self, p: &Principal, s: &Session) -> OpsResult<Ticket> {
        let mut b = [0u8; 16];
        crate::harden::random::secure_random(&mut b)
            .map_err(|e| OpsError::Internal(format!("making a ticket: {e}")))?;
        let token: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let now = Instant::now();
        let mut m = lock(&self.tickets.0);
        m.retain(|_, h| h.until > now);
        if m.len() >= MAX_TICKETS {
            if let Some(oldest) = m
                .iter()
                .min_by_key(|(_, h)| h.until)
                .map(|(k, _)| k.clone())
            {
                m.remove(&oldest);
            }
        }
        m.insert(
            token.clone(),
            Held {
                principal: p.clone(),
                session: s.id.clone(),
                until: now + TTL,
            },
        );
        Ok(Ticket {
            token,
            expires_at: now_unix_ms() + TTL.as_millis() as u64,
        })
    }

    /// Uses up `token` for session `session`: whom it acts for, or `None`
    /// (unknown, expired, used, or another session's).
    pub fn redeem_ws_ticket(&self, session: &str, token: &str) -> Option<Principal> {
        let mut m = lock(&self.tickets.0);
        let h = m.remove(token)?;
        (h.session == session && h.until > Instant::now()).then_some(h.principal)
    }
}
