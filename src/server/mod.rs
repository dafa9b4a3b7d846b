//! The HTTP server both front ends sit on: the socket and connection
//! threads ([`httpd`]), the transport pieces they share ([`http`]), the
//! shared state a request sees ([`Ctx`]) and the dispatch of a request to
//! its front end: `/mcp` to the MCP endpoint, everything else to the REST
//! router. It imports neither front end: the composition root (`lib.rs`,
//! `main.rs`) hands it [`Endpoints`].

pub mod http;
pub mod httpd;
pub mod preview;
pub mod shape;
pub mod ws;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::ops::auth::Auth;
use crate::ops::Ops;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Everything a handler of either front end needs.
pub struct Ctx {
    pub cfg: Arc<Config>,
    /// The operations (and through them the session manager).
    pub ops: Arc<Ops>,
    /// Keys, rate limits, failed-auth throttle.
    pub auth: Auth,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    closing: AtomicBool,
    /// Deferred/streaming requests running now.
    long_running: AtomicUsize,
}

impl Ctx {
    pub fn new(cfg: Arc<Config>, ops: Arc<Ops>, auth: Auth, metrics: Arc<Metrics>) -> Ctx {
        Ctx {
            cfg,
            ops,
            auth,
            metrics,
            started: Instant::now(),
            closing: AtomicBool::new(false),
            long_running: AtomicUsize::new(0),
        }
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// From now on requests are refused (503).
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Deferred/streaming requests running now.
    pub fn long_running(&self) -> usize {
        self.long_running.load(Ordering::Acquire)
    }
}

/// One long-running request counted in [`Ctx::long_running`] until it is
/// dropped.
pub struct LongGuard(Arc<Ctx>);

impl LongGuard {
    /// Counts one more; also says how many ran before it.
    pub fn start(ctx: &Arc<Ctx>) -> (LongGuard, usize) {
        let n = ctx.long_running.fetch_add(1, Ordering::AcqRel);
        (LongGuard(ctx.clone()), n)
    }
}

impl Drop for LongGuard {
    fn drop(&mut self) {
        self.0.long_running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A front end as the server sees it.
pub trait Endpoint: Send + Sync {
    /// Answers `req` (now, or later from another thread).
    fn handle(&self, ctx: &Arc<Ctx>, req: httpd::Request);
    /// The largest request body it reads: sizes the server's body limit.
    fn max_body(&self, cfg: &Config) -> usize;
}

/// Builds an endpoint once the shared state exists.
pub type MakeEndpoint = fn(&Arc<Ctx>) -> Arc<dyn Endpoint>;

/// The front ends a server dispatches to.
#[derive(Clone)]
pub struct Endpoints {
    /// Every request that is not for `/mcp`.
    pub rest: Arc<dyn Endpoint>,
    /// `/mcp` (when config `mcp_http` is on); `None`: the REST router
    /// answers it (404).
    pub mcp: Option<Arc<dyn Endpoint>>,
}

impl Endpoints {
    pub fn max_body(&self, cfg: &Config) -> usize {
        let mcp = self.mcp.as_ref().map_or(0, |m| m.max_body(cfg));
        self.rest.max_body(cfg).max(mcp)
    }

    /// Sends `req` to its front end. While the server closes, the REST
    /// front end answers everything (its 503), `/mcp` included.
    pub fn dispatch(&self, ctx: &Arc<Ctx>, req: httpd::Request) {
        match &self.mcp {
            Some(mcp) if !ctx.is_closing() && ctx.cfg.mcp_http && is_mcp_path(req.url()) => {
                mcp.handle(ctx, req)
            }
            _ => self.rest.handle(ctx, req),
        }
    }

    /// The connection threads' handler.
    pub fn handler(self, ctx: Arc<Ctx>) -> httpd::Handler {
        Arc::new(move |req| self.dispatch(&ctx, req))
    }
}

/// True for the request targets of the MCP endpoint.
pub fn is_mcp_path(url: &str) -> bool {
    let path = url.split('?').next().unwrap_or("");
    path == "/mcp" || path == "/mcp/"
}
