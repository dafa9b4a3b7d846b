//! Sessions: a registry of live sessions, one worker thread per session
//! owning its sandbox, a reaper thread for idle/expired sessions and a warm
//! pool per template.
//!
//! The API talks to a session only through [`Session::call`]: the command
//! goes to the session's thread over a channel, which starts the request on
//! its sandbox's agent and hands back the [`Call`]; the API thread then
//! consumes the call's stream itself. So a long exec occupies neither the
//! session thread nor any other session, and one session can run several
//! commands at once.

pub mod cas;
pub mod checkpoints;
pub mod error;
pub mod limits;
pub mod pool;
pub mod reaper;
pub mod registry;
pub mod worker;

use crate::agent::Call;
use crate::net::EgressPolicy;
use crate::proto::Request;
use crate::sandbox::{SandboxFactory, SandboxSpec, TemplateInfo};
use crate::sync::lock;
use crossbeam_channel::{RecvTimeoutError, Sender};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

pub use error::SessionError;
pub use registry::{Manager, SessionOptions};

/// Valid session ids: `[A-Za-z0-9_-]{1,64}`.
pub fn valid_session_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Starting,
    Ready,
    Failed(String),
    /// Its state is saved in a checkpoint and no VMM runs (issue #21): an
    /// exec or file request, or a resume, restores it.
    Paused,
    Closing,
}

pub(crate) enum Cmd {
    /// Start `Request` on the agent; reply with the call handle.
    Call(Box<Request>, Sender<Result<Call, SessionError>>),
    /// Change the running sandbox's egress policy.
    SetEgress(EgressPolicy, Sender<Result<(), SessionError>>),
    /// Give the egress proxy these secrets (`None`: none).
    SetSecrets(
        Option<Arc<crate::net::inject::Injection>>,
        Sender<Result<(), SessionError>>,
    ),
    /// A handle dialing the guest's ports (`None`: paused, or no network
    /// that can).
    Connector(Sender<Result<Option<crate::net::GuestConnector>, SessionError>>),
    /// What the egress proxy did (`None`: none runs, or the session is paused).
    ProxyStats(Sender<Result<Option<crate::net::ProxyStats>, SessionError>>),
    /// Save the state as a checkpoint of `kind` (named `name`); the
    /// session runs on.
    Checkpoint(
        CheckpointAsk,
        Sender<Result<Arc<checkpoints::Entry>, SessionError>>,
    ),
    /// Save the state and stop the VMM.
    Pause(Sender<Result<(), SessionError>>),
    /// The reaper's pause of an idle session: one that cannot be paused
    /// is destroyed, as an idle session without `onIdle: pause` is.
    IdlePause,
    /// Restore a paused session (a running one: nothing to do).
    Resume(Sender<Result<(), SessionError>>),
    /// Destroy the sandbox and end the thread: the session is removed, a
    /// paused one's checkpoint goes with it.
    Stop,
    /// The daemon stops: a paused session's checkpoint stays, to be
    /// resumed after the restart.
    Shutdown,
}

/// What [`Cmd::Checkpoint`] saves.
pub(crate) struct CheckpointAsk {
    pub kind: checkpoints::Kind,
    pub name: Option<String>,
}

/// What happens to a session idle past its timeout (issue #21).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnIdle {
    /// Destroyed, its work gone (the default, as before).
    #[default]
    Destroy,
    /// Paused: its state kept in a checkpoint until `pausedTtl`.
    Pause,
}

impl OnIdle {
    pub fn as_str(self) -> &'static str {
        match self {
            OnIdle::Destroy => "destroy",
            OnIdle::Pause => "pause",
        }
    }
    pub fn parse(s: &str) -> Option<OnIdle> {
        match s {
            "destroy" => Some(OnIdle::Destroy),
            "pause" => Some(OnIdle::Pause),
            _ => None,
        }
    }
}

/// A paused session's checkpoint, as the session shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PausedInfo {
    /// Bytes its checkpoint takes on disk.
    pub bytes: u64,
    /// When it was paused, ms since the epoch.
    pub since_unix_ms: u64,
    /// When it is removed unless resumed, ms since the epoch.
    pub expires_unix_ms: u64,
}

pub struct Session {
    /// The user-visible id (unique per owner).
    pub id: String,
    /// Key id that created it.
    pub owner: String,
    pub spec: SandboxSpec,
    /// What it counts against its key's quota.
    pub charge: limits::Charge,
    pub created: Instant,
    pub created_unix_ms: u64,
    /// End of its lifetime (moved on by the time it spends paused).
    pub(crate) expires: Mutex<Instant>,
    pub idle_timeout: Duration,
    pub on_idle: OnIdle,
    /// How long it may stay paused before it is removed.
    pub paused_ttl: Duration,
    /// Set while paused.
    pub(crate) paused: Mutex<Option<PausedInfo>>,
    last_used: Mutex<Instant>,
    /// Requests in flight; a busy session is never idle-reaped.
    active: AtomicUsize,
    pub(crate) state: Mutex<State>,
    pub(crate) tx: Sender<Cmd>,
    pub(crate) thread: Mutex<Option<JoinHandle<()>>>,
    /// Sandbox pids, filled once it is up (diagnostics and tests).
    pub(crate) pids: Mutex<Vec<i32>>,
    /// The egress policy in force (`spec.egress` until changed live).
    pub(crate) egress: Mutex<EgressPolicy>,
    /// Env under the session's own: the CA variables when the daemon has
    /// a `guest_ca_bundle` (`cas::guest_env`). Fixed at creation, since an
    /// exec's env is built before the session may be up.
    pub(crate) base_env: BTreeMap<String, String>,
    /// Guest ports reachable from outside (preview URLs), by port.
    pub ports: Mutex<BTreeMap<u16, PortGrant>>,
    /// Secrets the egress proxy injects for this session (their
    /// placeholders are in every command's env; `net::inject`).
    pub(crate) inject: Mutex<Option<Arc<crate::net::inject::Injection>>>,
    /// Names of the secret files (`/run/secrets/NAME`) of the commands
    /// running now: while any is there, no checkpoint, fork or pause may
    /// capture them, and no second command may take the same name.
    pub secret_files: Mutex<std::collections::BTreeSet<String>>,
    /// Processes started with secret files: their output is masked only
    /// in their own exec's answer, so no attach may replay it (bounded:
    /// the oldest ids go first, long after the agent forgot them).
    pub secret_procs: Mutex<std::collections::BTreeSet<u64>>,
    /// Processes whose end the audit log has recorded (each once, however
    /// it was seen: its exec, an attach, a listing); bounded like
    /// `secret_procs`.
    pub audited_exits: Mutex<std::collections::BTreeSet<u64>>,
}

/// A guest port opened to the outside (`POST /v1/sessions/:id/ports`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortGrant {
    pub port: u16,
    /// The URL's secret part: who has it reaches the port (a public
    /// one), or with the owner's key as well (not public).
    pub token: String,
    pub public: bool,
    pub created_unix_ms: u64,
    pub expires_unix_ms: u64,
}

/// Held while a request uses a session: counts as activity.
pub struct Activity(Arc<Session>);

impl Drop for Activity {
    fn drop(&mut self) {
        self.0.touch();
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Session {
    pub fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }

    pub fn idle_for(&self) -> Duration {
        lock(&self.last_used).elapsed()
    }

    pub fn busy(&self) -> bool {
        self.active.load(Ordering::Acquire) > 0
    }

    pub fn state(&self) -> State {
        lock(&self.state).clone()
    }

    /// Marks the session in use until the returned guard drops.
    pub fn activity(self: &Arc<Self>) -> Activity {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.touch();
        Activity(self.clone())
    }

    /// Starts `req` on this session's agent, waiting up to `wait` for the
    /// sandbox to come up.
    pub fn call(&self, req: Request, wait: Duration) -> Result<Call, SessionError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.tx.send(Cmd::Call(Box::new(req), tx)).is_err() {
            return Err(self.gone_error());
        }
        match rx.recv_timeout(wait) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(SessionError::StartTimeout {
                id: self.id.clone(),
                wait,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone_error()),
        }
    }

    /// What the session's egress inspection proxy did so far.
    pub fn proxy_stats(
        &self,
        wait: Duration,
    ) -> Result<Option<crate::net::ProxyStats>, SessionError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.tx.send(Cmd::ProxyStats(tx)).is_err() {
            return Err(self.gone_error());
        }
        match rx.recv_timeout(wait) {
            Ok(r) => r,
            // Busy (e.g. starting): the counters are not worth a wait.
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone_error()),
        }
    }

    /// Applies a new egress policy to the running sandbox (for the
    /// networking layer's `PUT /v1/sessions/:id/network`).
    pub fn set_egress(&self, policy: EgressPolicy, wait: Duration) -> Result<(), SessionError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.tx.send(Cmd::SetEgress(policy.clone(), tx)).is_err() {
            return Err(self.gone_error());
        }
        match rx.recv_timeout(wait) {
            Ok(Ok(())) => {
                *lock(&self.egress) = policy;
                Ok(())
            }
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) => Err(SessionError::EgressTimeout {
                id: self.id.clone(),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone_error()),
        }
    }

    /// Replaces the session's injected secrets (none: `specs` empty). A
    /// secret keeps its placeholder when its name stays, and the session
    /// keeps its CA; a paused session gets them when it resumes.
    pub fn set_secrets(
        &self,
        specs: &[crate::net::inject::SecretSpec],
        wait: Duration,
    ) -> Result<(), SessionError> {
        use crate::net::inject::{Ca, Injection};
        let failed = |why: String| SessionError::Failed {
            id: self.id.clone(),
            why,
        };
        let prev = lock(&self.inject).clone();
        let next = if specs.is_empty() {
            None
        } else {
            let ca = match &prev {
                Some(p) => p.ca().clone(),
                None => Arc::new(Ca::new(&self.id).map_err(failed)?),
            };
            Some(Arc::new(
                Injection::new(ca, specs, prev.as_deref()).map_err(failed)?,
            ))
        };
        self.ask(|tx| Cmd::SetSecrets(next.clone(), tx), wait)?;
        *lock(&self.inject) = next;
        Ok(())
    }

    /// A handle that dials the guest's TCP ports; `None` while paused or
    /// without per-session networking.
    pub fn guest_connector(
        &self,
        wait: Duration,
    ) -> Result<Option<crate::net::GuestConnector>, SessionError> {
        self.ask(Cmd::Connector, wait)
    }

    /// What GETs show of the injected secrets (never a value).
    pub fn secrets_info(&self) -> Vec<crate::net::inject::SecretInfo> {
        lock(&self.inject)
            .as_ref()
            .map(|i| i.info())
            .unwrap_or_default()
    }

    /// The injected secrets' values, for masking output.
    pub fn secret_values(&self) -> Vec<String> {
        lock(&self.inject)
            .as_ref()
            .map(|i| i.values().map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// The injected secrets as given (a fork passes them on).
    pub fn injection(&self) -> Option<Arc<crate::net::inject::Injection>> {
        lock(&self.inject).clone()
    }

    fn gone_error(&self) -> SessionError {
        match self.state() {
            State::Failed(why) => SessionError::Failed {
                id: self.id.clone(),
                why,
            },
            _ => SessionError::Closed {
                id: self.id.clone(),
            },
        }
    }

    /// Its checkpoint while paused.
    pub fn paused(&self) -> Option<PausedInfo> {
        lock(&self.paused).clone()
    }

    /// End of its lifetime.
    pub fn expires(&self) -> Instant {
        *lock(&self.expires)
    }

    fn ask<T>(
        &self,
        cmd: impl FnOnce(Sender<Result<T, SessionError>>) -> Cmd,
        wait: Duration,
    ) -> Result<T, SessionError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.tx.send(cmd(tx)).is_err() {
            return Err(self.gone_error());
        }
        match rx.recv_timeout(wait) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(SessionError::Busy {
                id: self.id.clone(),
                why: format!("no answer within {wait:?}"),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(self.gone_error()),
        }
    }

    /// Saves the session's state as a checkpoint; it runs on.
    pub fn checkpoint(
        &self,
        kind: checkpoints::Kind,
        name: Option<String>,
        wait: Duration,
    ) -> Result<Arc<checkpoints::Entry>, SessionError> {
        self.ask(|tx| Cmd::Checkpoint(CheckpointAsk { kind, name }, tx), wait)
    }

    /// Saves the state and stops the VMM (waiting up to `wait`).
    pub fn pause(&self, wait: Duration) -> Result<(), SessionError> {
        self.ask(Cmd::Pause, wait)
    }

    /// Asks for the idle pause without waiting (the reaper's).
    pub(crate) fn pause_when_idle(&self) {
        let _ = self.tx.send(Cmd::IdlePause);
    }

    /// Restores a paused session (waiting up to `wait`).
    pub fn resume(&self, wait: Duration) -> Result<(), SessionError> {
        self.ask(Cmd::Resume, wait)
    }

    pub fn pids(&self) -> Vec<i32> {
        lock(&self.pids).clone()
    }

    /// Session-wide env merged under a command's own, both over the
    /// daemon's (the CA variables): the user's value of a variable wins.
    pub fn env_for(&self, cmd_env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut e = self.base_env.clone();
        if let Some(inj) = lock(&self.inject).as_ref() {
            // The guest trusts the proxy's CA through the same bundle.
            e.extend(cas::guest_env());
            e.extend(inj.env());
        }
        e.extend(self.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        e.extend(cmd_env.iter().map(|(k, v)| (k.clone(), v.clone())));
        e
    }
}

pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Options as the API receives them (already validated).
pub fn default_egress() -> EgressPolicy {
    EgressPolicy::default()
}

/// The template a session asking for `name` gets: "default" names the
/// factory's default template (`vm::templates::DEFAULT_TEMPLATE` for VMs).
pub(crate) fn template_name(factory: &dyn SandboxFactory, name: String) -> String {
    if name != "default" {
        return name;
    }
    default_of(&factory.templates(), &name)
}

/// [`template_name`] of `name` among the factory's `templates`.
pub(crate) fn default_of(templates: &[TemplateInfo], name: &str) -> String {
    if name != "default" {
        return name.to_string();
    }
    templates
        .iter()
        .find(|t| t.is_default)
        .map_or_else(|| name.to_string(), |t| t.name.clone())
}
