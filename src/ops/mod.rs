//! Operations: what a client may ask of the daemon, typed and
//! transport-neutral. REST (seed routes and `/v1`) and MCP (stdio, HTTP,
//! forwarding) parse a request, call one operation here and map its
//! answer and [`OpsError`] at their edge; validation, limits and
//! ownership checks live here once.

pub mod error;
pub mod validate;

/// The one egress policy type, for the front ends (which do not import
/// `net`).
pub use crate::net::{EgressMode, EgressPolicy};
pub use error::{OpsError, OpsResult};

use crate::config::Config;
use crate::session::{Manager, Session};
use std::sync::Arc;

/// Who calls: the API key's id owns the sessions it creates (REST and MCP
/// alike), its scopes say what it may do.
#[derive(Debug, Clone)]
pub struct Principal {
    /// Key id, or `anonymous` when auth is off.
    pub id: String,
    pub scopes: Vec<String>,
}

impl Principal {
    pub fn has(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }
    pub fn is_admin(&self) -> bool {
        self.has("admin")
    }
}

/// What the operations run against.
pub struct Ops {
    pub mgr: Arc<Manager>,
    pub cfg: Arc<Config>,
}

impl Ops {
    pub fn new(mgr: Arc<Manager>, cfg: Arc<Config>) -> Arc<Ops> {
        Arc::new(Ops { mgr, cfg })
    }

    /// The owner a request acts for: the caller, or with an admin key the
    /// `owner` it names.
    pub fn owner_for(&self, p: &Principal, owner: Option<&str>) -> OpsResult<String> {
        match owner {
            Some(o) if p.is_admin() => Ok(o.to_string()),
            Some(_) => Err(OpsError::Forbidden("owner= needs an admin key".into())),
            None => Ok(p.id.clone()),
        }
    }

    /// Session `id` of `owner` (see [`Ops::owner_for`]).
    pub fn session(&self, owner: &str, id: &str) -> OpsResult<Arc<Session>> {
        validate::session_id(id)?;
        self.mgr
            .get(owner, id)
            .ok_or_else(|| OpsError::SessionNotFound { id: id.to_string() })
    }
}
