//! Forwarding every record elsewhere, so a host compromised later cannot
//! rewrite what already left it.
//!
//! - syslog: one RFC 5424 datagram per record to `/dev/log` (config
//!   `audit.syslog_socket`; facility
//!   `log audit` (13), severity info: `<110>1 - - agent-sandbox - audit -
//!   <record>`; journald's /dev/log takes it too). Sent non-blocking from
//!   the writer: a full socket buffer or no syslog drops the datagram
//!   (counted).
//! - HTTP: records queue (bounded) for a thread of kind `AuditSink` that
//!   POSTs them as NDJSON batches (`Content-Type: application/x-ndjson`,
//!   up to [`BATCH`] records or [`LINGER`] of waiting), retrying a failed
//!   batch with backoff ([`RETRIES`] times). A full queue drops the record
//!   (counted per session, recorded in the session's file); a batch given
//!   up on is counted the same way.

use super::{Counters, Settings};
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Key;
type Metric = super::DropMetric;

pub const BATCH: usize = 256;
pub const LINGER: Duration = Duration::from_millis(200);
pub const RETRIES: u32 = 4;
/// One POST may take this long (a hanging sink costs the sink thread this
/// per attempt, never the writer).
pub const POST_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Sinks {
    syslog: Option<(UnixDatagram, std::path::PathBuf)>,
    http: Option<Sender<(Key, String)>>,
    /// Records the HTTP sink gave up on, per session.
    failed: Arc<Mutex<HashMap<Key, u64>>>,
    counters: Arc<Counters>,
    metric: Option<Metric>,
}

impl Sinks {
    pub fn none() -> Sinks {
        Sinks {
            syslog: None,
            http: None,
            failed: Arc::default(),
            counters: Arc::default(),
            metric: None,
        }
    }

    pub(super) fn start(
        s: &Settings,
        counters: Arc<Counters>,
        metric: Option<Metric>,
    ) -> Result<Sinks, String> {
        let syslog = if s.syslog {
            let sock = UnixDatagram::unbound().map_err(|e| format!("audit syslog socket: {e}"))?;
            sock.set_nonblocking(true)
                .map_err(|e| format!("audit syslog socket: {e}"))?;
            Some((sock, s.syslog_socket.clone()))
        } else {
            None
        };
        let failed: Arc<Mutex<HashMap<Key, u64>>> = Arc::default();
        let http = match &s.http_url {
            None => None,
            Some(url) => {
                let (tx, rx) = bounded(s.http_queue);
                let (url, failed, counters, metric) = (
                    url.clone(),
                    failed.clone(),
                    counters.clone(),
                    metric.clone(),
                );
                crate::harden::thread::spawn(
                    crate::harden::ThreadKind::AuditSink,
                    std::thread::Builder::new().name("audit-http".into()),
                    move || http_loop(&url, rx, &failed, &counters, metric.as_ref()),
                )
                .map_err(|e| format!("start the audit HTTP sink: {e}"))?;
                Some(tx)
            }
        };
        Ok(Sinks {
            syslog,
            http,
            failed,
            counters,
            metric,
        })
    }

    fn dropped(&self, what: &str) {
        self.counters.sink_dropped.fetch_add(1, Ordering::Relaxed);
        if let Some(m) = &self.metric {
            m.get_or_create(&vec![("where", what.to_string())]).inc();
        }
    }

    /// Hands `line` to every sink without waiting; false when the HTTP
    /// sink's queue was full (the caller records that in the session).
    pub(super) fn send(&self, k: &Key, line: &str) -> bool {
        if let Some((s, path)) = &self.syslog {
            let msg = format!("<110>1 - - agent-sandbox - audit - {line}");
            if s.send_to(msg.as_bytes(), path).is_err() {
                self.dropped("syslog");
            }
        }
        match &self.http {
            Some(tx) => match tx.try_send((k.clone(), line.to_string())) {
                Ok(()) => true,
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped("http_queue");
                    false
                }
            },
            None => true,
        }
    }

    pub(super) fn take_failed(&self) -> HashMap<Key, u64> {
        std::mem::take(&mut *crate::sync::lock(&self.failed))
    }
}

fn http_loop(
    url: &str,
    rx: Receiver<(Key, String)>,
    failed: &Mutex<HashMap<Key, u64>>,
    counters: &Counters,
    metric: Option<&Metric>,
) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(POST_TIMEOUT))
        .build()
        .into();
    loop {
        let first = match rx.recv() {
            Ok(r) => r,
            Err(_) => return,
        };
        let mut batch = vec![first];
        let until = Instant::now() + LINGER;
        while batch.len() < BATCH {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(r) => batch.push(r),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut body = String::new();
        for (_, l) in &batch {
            body.push_str(l);
            body.push('\n');
        }
        let mut ok = false;
        for attempt in 0..=RETRIES {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(200 << attempt.min(5)));
            }
            match agent
                .post(url)
                .header("Content-Type", "application/x-ndjson")
                .send(body.as_bytes())
            {
                Ok(r) if r.status().is_success() => {
                    ok = true;
                    break;
                }
                Ok(r) => log::warn!("audit HTTP sink {url}: status {}", r.status()),
                Err(e) => log::warn!("audit HTTP sink {url}: {e}"),
            }
        }
        if !ok {
            let mut f = crate::sync::lock(failed);
            for (k, _) in batch {
                *f.entry(k).or_insert(0) += 1;
                counters.sink_dropped.fetch_add(1, Ordering::Relaxed);
                if let Some(m) = metric {
                    m.get_or_create(&vec![("where", "http".to_string())]).inc();
                }
            }
        }
    }
}
