//! Draining a host (issue #28): it takes no new sessions (nor forks) and
//! keeps serving its own, paused ones included, until they end; then it
//! reports `drained`. Set by `POST /v1/admin/drain`, `agent-sandbox
//! drain` or SIGUSR1; `DELETE /v1/admin/drain` serves again. Not kept
//! across a restart. Behind the router, `/ready` failing takes the host
//! out of the create rotation while its sessions stay routed to it.

use super::Ops;
use serde::Serialize;

/// What `GET /v1/admin/drain` (and `/health`) show.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainView {
    /// `serving`, `draining` (sessions left) or `drained` (none).
    pub state: &'static str,
    pub draining: bool,
    /// Sessions still on this host (running, starting or paused).
    pub sessions: usize,
    /// This host's id (`host_id`), if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<&'static str>,
}

impl Ops {
    /// Starts (`true`) or ends a drain; the state after.
    pub fn drain(&self, on: bool) -> DrainView {
        if on != self.mgr.is_draining() {
            log::info!(
                "{}",
                if on {
                    "draining: no new sessions; the ones here run until they end"
                } else {
                    "drain ended: taking new sessions again"
                }
            );
        }
        self.mgr.set_draining(on);
        self.drain_state()
    }

    pub fn drain_state(&self) -> DrainView {
        let sessions = self.mgr.count();
        let draining = self.mgr.is_draining();
        DrainView {
            state: match (draining, sessions) {
                (false, _) => "serving",
                (true, 0) => "drained",
                (true, _) => "draining",
            },
            draining,
            sessions,
            host: crate::router::host(),
        }
    }
}
