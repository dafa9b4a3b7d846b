//! Operations: what a client may ask of the daemon, typed and
//! transport-neutral. REST (seed routes and `/v1`) and MCP (stdio, HTTP,
//! forwarding) parse a request, call one operation here and map its
//! answer and [`OpsError`] at their edge; validation, limits and
//! ownership checks live here once.

pub mod audit;
pub mod auth;
pub mod drain;
pub mod error;
pub mod exec;
pub mod files;
pub mod keys;
pub mod mask;
pub mod network;
pub mod ports;
pub mod procs;
pub mod run;
pub mod secrets;
pub mod sessions;
pub mod state;
pub mod templates;
pub mod tickets;
pub mod validate;

/// The one egress policy type, for the front ends (which do not import
/// `net`).
pub use crate::net::inject::{SecretInfo, SecretSpec};
/// The bounds of injected secrets, for the front ends' schemas.
pub mod inject_limits {
    pub use crate::net::inject::{MAX_HOSTS, MAX_SECRETS, MAX_VALUE_BYTES, MIN_VALUE_CHARS};
}
pub use crate::net::{EgressMode, EgressPolicy};
/// What builds the sandboxes: the composition root picks one and hands it
/// to [`Ops::start`]; the front ends only pass it on.
pub use crate::sandbox::SandboxFactory;
/// The daemon's wall clock in ms since the epoch: what sessions are
/// stamped with, so also what the front ends stamp their stream lines with.
pub use crate::session::now_unix_ms;
/// The session handle the operations hand out: the front ends hold it only
/// to pass it back to an operation (and read its id, owner and spec).
pub use crate::session::{Session, State};
pub use auth::Scope;
pub use error::{OpsError, OpsResult};
pub use sessions::{OnIdle, SessionSpec, SessionView};
pub use state::{Fork, SnapshotView};

use crate::config::Config;
use crate::metrics::Metrics;
use crate::session::{reaper, Manager};
use crate::sync::lock;
use crossbeam_channel::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

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
    /// The reaper of a host started by [`Ops::start`]: its stop channel
    /// and thread, until [`Ops::shutdown`].
    reaper: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    /// Where the preview listener is reached, once it runs (`ports`).
    preview: Mutex<Option<String>>,
    /// Short-lived WebSocket tickets for browsers (`tickets`).
    tickets: tickets::Tickets,
}

impl Ops {
    /// Over a manager someone else runs (no pool or reaper of its own).
    pub fn new(mgr: Arc<Manager>, cfg: Arc<Config>) -> Arc<Ops> {
        Arc::new(Ops {
            mgr,
            cfg,
            reaper: Mutex::new(None),
            preview: Mutex::new(None),
            tickets: tickets::Tickets::default(),
        })
    }

    /// A running host: the session manager over `factory`, its warm pool
    /// and the reaper of idle and expired sessions. [`Ops::shutdown`]
    /// ends it.
    pub fn start(
        cfg: Arc<Config>,
        factory: Arc<dyn SandboxFactory>,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Ops>, String> {
        // A bad `guest_ca_bundle` fails the start here too (not only in
        // `Config::validate`), for configs that were never validated.
        cfg.guest_cas()?;
        let mgr = Manager::new(cfg.clone(), factory, metrics.clone());
        let audit = crate::audit::Log::start(
            &cfg.audit,
            cfg.audit.dir_in(&cfg.state_dir),
            Some(metrics.audit_dropped.clone()),
        )?;
        mgr.set_audit(audit);
        mgr.pool
            .start()
            .map_err(|e| format!("start pool thread: {e}"))?;
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let reaper =
            reaper::spawn(mgr.clone(), stop_rx).map_err(|e| format!("start reaper: {e}"))?;
        Ok(Arc::new(Ops {
            mgr,
            cfg,
            reaper: Mutex::new(Some((stop_tx, reaper))),
            preview: Mutex::new(None),
            tickets: tickets::Tickets::default(),
        }))
    }

    /// Stops the reaper, then ends every session (which cancels the
    /// commands still running in them).
    pub fn shutdown(&self) {
        if let Some((tx, h)) = lock(&self.reaper).take() {
            let _ = tx.send(());
            let _ = h.join();
        }
        self.mgr.shutdown();
        // After the sessions' last records.
        self.audit().stop();
    }

    /// The audit log (disabled when off, or for a manager run elsewhere).
    pub fn audit(&self) -> &crate::audit::Log {
        self.mgr.audit()
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
