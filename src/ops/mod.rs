//! Operations: what a client may ask of the daemon, typed and
//! transport-neutral. REST (seed routes and `/v1`) and MCP (stdio, HTTP,
//! forwarding) parse a request, call one operation here and map its
//! answer and [`OpsError`] at their edge; validation, limits and
//! ownership checks live here once.

pub mod auth;
pub mod error;
pub mod exec;
pub mod files;
pub mod keys;
pub mod network;
pub mod procs;
pub mod run;
pub mod sessions;
pub mod validate;

/// The one egress policy type, for the front ends (which do not import
/// `net`).
pub use crate::net::{EgressMode, EgressPolicy};
pub use auth::Scope;
pub use error::{OpsError, OpsResult};
pub use sessions::{SessionSpec, SessionView};

use crate::config::Config;
use crate::session::{Manager, Session};
use std::sync::Arc;

/// Who calls: the API key's id owns the sessions it creates (REST and MCP
/// alike), its scopes say what it may do.
#[derive(Debug, Clone)]
pub struct Principal {
    /// Key id, or `anonymous` when auth is off.
    pub id: String,
    pub scopes: Vec<Scope>,
}

impl Principal {
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }
    pub fn is_admin(&self) -> bool {
        self.has(Scope::Admin)
    }
    /// Whether it may do what `scope` allows: admin keys may do everything.
    pub fn may(&self, scope: Scope) -> bool {
        self.has(scope) || self.is_admin()
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
