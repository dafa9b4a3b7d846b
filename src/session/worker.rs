//! One thread per session: creates (or takes from the pool) the sandbox,
//! starts agent requests for the API, destroys the sandbox at the end.

use super::pool::Pool;
use super::SessionError;
use super::{Cmd, Session, State};
use crate::metrics::Metrics;
use crate::sandbox::{Sandbox, SandboxFactory};
use crate::sync::lock;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often an idle session checks that its sandbox is still there. A VMM
/// that dies (killed, crashed, OOM on the host) closes the agent
/// connection; in-flight calls fail at once, this catches idle sessions.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// What a session's worker uses of the registry (`Manager::home` fills
/// it): where sandboxes come from, the metrics, and how to drop a session
/// that failed. Passed in so the worker does not depend on the registry
/// that spawns it.
pub(crate) struct Home {
    pub pool: Arc<Pool>,
    pub factory: Arc<dyn SandboxFactory>,
    pub metrics: Arc<Metrics>,
    pub forget: Forget,
}

/// The registry's `forget`: drops a session that failed to start.
pub(crate) type Forget = Box<dyn Fn(&Arc<Session>) + Send>;

impl Home {
    fn forget(&self, s: &Arc<Session>) {
        (self.forget)(s)
    }
}

/// The sandbox went away under the session: mark it failed, drop it from
/// the registry (later requests get 404, or a fresh session on the seed
/// routes) and let the caller's loop destroy what is left of it.
fn died(mgr: &Home, session: &Arc<Session>) {
    log::error!(
        "session {}/{}: sandbox died (agent connection lost); destroying it",
        session.owner,
        session.id
    );
    mgr.metrics.error("sandbox_died");
    *lock(&session.state) = State::Failed("sandbox died (agent connection lost)".into());
    mgr.forget(session);
}

/// Session threads do little work of their own; a small stack keeps the
/// per-session memory low.
const STACK: usize = 256 * 1024;

pub(crate) fn spawn(
    mgr: Home,
    session: Arc<Session>,
    rx: Receiver<Cmd>,
) -> std::io::Result<JoinHandle<()>> {
    // Started by an HTTP worker, but must not be limited to what HTTP
    // workers may do: the broker starts it with the Session allowlist.
    crate::harden::thread::spawn(
        crate::harden::ThreadKind::Session,
        std::thread::Builder::new()
            .name(format!("session-{}", session.id))
            .stack_size(STACK),
        move || run(mgr, session, rx),
    )
}

fn run(mgr: Home, session: Arc<Session>, rx: Receiver<Cmd>) {
    let t0 = Instant::now();
    let spec = &session.spec;
    let made = match mgr.pool.take(spec) {
        Some(sb) => Ok(sb),
        None => mgr.factory.create(spec).inspect(|_| {
            mgr.metrics
                .sandbox_created(mgr.factory.backend(), &spec.template, t0.elapsed())
        }),
    };
    let mut sandbox: Box<dyn Sandbox> = match made {
        Ok(sb) => sb,
        Err(e) => {
            let msg = e.to_string();
            log::error!("session {}/{}: {msg}", session.owner, session.id);
            mgr.metrics.error("sandbox_create");
            *lock(&session.state) = State::Failed(msg.clone());
            mgr.forget(&session);
            // Answer everything queued so far; later senders find the
            // channel closed and report the failure from the state.
            for cmd in rx.try_iter() {
                let failed = || SessionError::Failed {
                    id: session.id.clone(),
                    why: msg.clone(),
                };
                if let Cmd::SetEgress(_, reply) = cmd {
                    let _ = reply.send(Err(failed()));
                } else if let Cmd::Call(_, reply) = cmd {
                    let _ = reply.send(Err(failed()));
                }
            }
            return;
        }
    };
    *lock(&session.pids) = sandbox.pids();
    for (phase, took) in sandbox.timings() {
        let template = vec![("template", spec.template.clone())];
        match phase {
            crate::sandbox::Phase::Network => mgr
                .metrics
                .net_setup
                .get_or_create(&template)
                .observe(took.as_secs_f64()),
            crate::sandbox::Phase::StandbyVmm => {
                mgr.metrics.standby_used.get_or_create(&template).inc();
            }
        }
    }
    {
        let mut st = lock(&session.state);
        if *st == State::Starting {
            *st = State::Ready;
        }
    }
    log::info!(
        "session {}/{}: ready as {} in {:?}",
        session.owner,
        session.id,
        sandbox.id(),
        t0.elapsed()
    );
    loop {
        let cmd = match rx.recv_timeout(LIVENESS_CHECK) {
            Ok(cmd) => cmd,
            Err(RecvTimeoutError::Timeout) => {
                if sandbox.agent().is_closed() {
                    died(&mgr, &session);
                    break;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        match cmd {
            Cmd::Call(req, reply) => {
                let r = sandbox.agent().call(&req).map_err(SessionError::Agent);
                let _ = reply.send(r);
                if sandbox.agent().is_closed() {
                    died(&mgr, &session);
                    break;
                }
            }
            Cmd::SetEgress(policy, reply) => {
                let r = sandbox
                    .set_egress(&policy)
                    .map_err(|e| SessionError::EgressNotApplied(e.to_string()));
                let _ = reply.send(r);
            }
            Cmd::Stop => break,
        }
    }
    let (bytes_in, bytes_out) = sandbox.agent().traffic();
    mgr.metrics.agent_traffic(bytes_in, bytes_out);
    if let Err(e) = sandbox.destroy() {
        log::error!("session {}/{}: destroy: {e}", session.owner, session.id);
        mgr.metrics.error("sandbox_destroy");
    }
    // Anything that raced with the stop gets a clear answer.
    for cmd in rx.try_iter() {
        if let Cmd::Call(_, reply) = cmd {
            let _ = reply.send(Err(SessionError::Closed {
                id: session.id.clone(),
            }));
        }
    }
    log::info!("session {}/{}: destroyed", session.owner, session.id);
}
