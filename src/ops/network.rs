//! A session's network policy: the egress policy in force, and replacing
//! it on the running sandbox.

use super::{Ops, OpsResult};
use crate::net::EgressPolicy;
use crate::session::Session;
use crate::sync::lock;
use serde::Serialize;

/// What `GET/PUT .../network` answer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkView {
    pub session_id: String,
    pub egress: EgressPolicy,
}

impl NetworkView {
    pub fn of(s: &Session) -> NetworkView {
        NetworkView {
            session_id: s.id.clone(),
            egress: lock(&s.egress).clone(),
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
}
