//! A session's network policy: the egress policy in force, and replacing
//! it on the running sandbox.

use super::{Ops, OpsResult};
use crate::net::{EgressPolicy, ProxyStats};
use std::time::Duration;

/// How long a GET waits for a busy session's worker to report counters.
const STATS_WAIT: Duration = Duration::from_millis(500);
use crate::session::Session;
use crate::sync::lock;
use serde::Serialize;

/// What `GET/PUT .../network` answer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkView {
    pub session_id: String,
    pub egress: EgressPolicy,
    /// Counters of the egress inspection proxy, while one runs (a domain
    /// allowlist in `allowlist` or `none` mode, or injected secrets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyStats>,
}

impl NetworkView {
    pub fn of(s: &Session) -> NetworkView {
        NetworkView {
            session_id: s.id.clone(),
            egress: lock(&s.egress).clone(),
            proxy: s.proxy_stats(STATS_WAIT).ok().flatten(),
        }
    }

    /// As JSON (the front ends' replies are `Value`s).
    pub fn json(&self) -> serde_json::Value {
        // A string and a policy of strings and numbers: cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }
}

impl Ops {
    /// Replaces the egress policy of a running session (checked with
    /// [`super::validate::egress`]). A session still starting gets it once it is
    /// up; answers once the new rules are installed and read back, and on
    /// failure the old policy stays.
    pub fn set_network(&self, s: &Session, policy: EgressPolicy) -> OpsResult<NetworkView> {
        self.ping(s)?;
        s.set_egress(policy, self.cfg.create_timeout)?;
        Ok(NetworkView::of(s))
    }

    /// Replaces the session's injected secrets (`[]`: none), live; a
    /// paused session gets them when it resumes. Answers what GETs show
    /// of them (never a value).
    pub fn set_secrets(
        &self,
        s: &Session,
        specs: Vec<crate::net::inject::SecretSpec>,
    ) -> OpsResult<Vec<crate::net::inject::SecretInfo>> {
        crate::net::inject::validate(&specs).map_err(super::OpsError::BadRequest)?;
        self.can_inject(&specs)?;
        if s.state() != crate::session::State::Paused {
            self.ping(s)?;
        }
        s.set_secrets(&specs, self.cfg.create_timeout)?;
        Ok(s.secrets_info())
    }
}
