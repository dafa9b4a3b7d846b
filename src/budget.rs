//! Memory for replies built from guest data (file reads, listings), bounded
//! per request and in total.
//!
//! A guest decides how big what it returns is, and JSON can make it much
//! bigger again (a control byte escapes to six: `\u0001`). So every reply
//! made from guest data is sized before it is built: over the per-request
//! limit ([`crate::config::Config::max_json_reply`]) it is refused with 413
//! `reply_too_large`; the bytes held for it are leased from one daemon-wide
//! [`ReplyBudget`] (`max_reply_memory`), and when that is used up the
//! request gets 503 `reply_memory_exhausted` with `Retry-After`.

use serde::Serialize;
use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Why a reply cannot be built (the front end gives it a status: 413 and
/// 503 with `Retry-After` over HTTP).
#[derive(Debug, Clone, thiserror::Error)]
pub enum BudgetError {
    /// Over the per-request limit; `hint` says how to get the data
    /// another way.
    #[error("the JSON reply would be {len} bytes, over the {max}-byte limit; {hint}")]
    TooLarge {
        len: usize,
        max: usize,
        hint: String,
    },
    /// The daemon-wide budget is used up: retry shortly.
    #[error(
        "the daemon is holding {used} of its {limit} bytes for replies in flight; \
         this one needs {need} more: retry shortly"
    )]
    Exhausted { used: u64, limit: u64, need: u64 },
}

impl BudgetError {
    pub fn code(&self) -> &'static str {
        match self {
            BudgetError::TooLarge { .. } => "reply_too_large",
            BudgetError::Exhausted { .. } => "reply_memory_exhausted",
        }
    }
}

/// Bytes leased when a request is admitted, before any guest data arrived:
/// enough for small files and listings, so a full budget is answered at
/// once (with `Retry-After`) rather than half-way.
pub const ADMIT_BYTES: u64 = 256 * 1024;

/// Bytes of reply memory in use across the daemon, and the most allowed.
pub struct ReplyBudget {
    limit: u64,
    used: AtomicU64,
}

impl ReplyBudget {
    pub fn new(limit: u64) -> Arc<ReplyBudget> {
        Arc::new(ReplyBudget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// Bytes leased right now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= self.limit)
            })
            .is_ok()
    }

    fn give(&self, n: u64) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Admits a request: leases [`ADMIT_BYTES`] or answers 503.
    pub fn admit(self: &Arc<Self>) -> Result<Lease, BudgetError> {
        let mut l = Lease {
            budget: self.clone(),
            held: 0,
        };
        l.grow(ADMIT_BYTES)?;
        Ok(l)
    }
}

/// Bytes held for one request; given back when dropped.
pub struct Lease {
    budget: Arc<ReplyBudget>,
    held: u64,
}

impl Lease {
    /// Holds `n` more bytes, or fails with 503 + `Retry-After` (the lease
    /// keeps what it had; dropping it gives everything back).
    pub fn grow(&mut self, n: u64) -> Result<(), BudgetError> {
        if self.budget.take(n) {
            self.held += n;
            return Ok(());
        }
        Err(BudgetError::Exhausted {
            used: self.budget.used(),
            limit: self.budget.limit,
            need: n,
        })
    }

    /// Makes sure at least `n` bytes are held in all.
    pub fn hold(&mut self, n: u64) -> Result<(), BudgetError> {
        match n.checked_sub(self.held) {
            Some(more) if more > 0 => self.grow(more),
            _ => Ok(()),
        }
    }

    /// Gives back all but `n` bytes (data already freed).
    pub fn shrink_to(&mut self, n: u64) {
        if self.held > n {
            self.budget.give(self.held - n);
            self.held = n;
        }
    }

    pub fn held(&self) -> u64 {
        self.held
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.give(self.held);
    }
}

/// Counts what is written, keeps nothing.
struct Counter(usize);

impl Write for Counter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0 += b.len();
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Length of `v` serialized as JSON, computed without building it.
pub fn json_len<T: Serialize + ?Sized>(v: &T) -> usize {
    let mut c = Counter(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// The refusal of a reply of `len` bytes over `max`; `hint` says how to
/// get the data another way.
pub fn too_large(len: usize, max: usize, hint: &str) -> BudgetError {
    BudgetError::TooLarge {
        len,
        max,
        hint: hint.to_string(),
    }
}

/// Sizes `v` as JSON and leases its bytes from `lease`: refused beyond
/// `max` bytes. The caller serializes it (into exactly that many bytes).
pub fn lease_json<T: Serialize + ?Sized>(
    lease: &mut Lease,
    v: &T,
    max: usize,
    hint: &str,
) -> Result<usize, BudgetError> {
    let len = json_len(v);
    if len > max {
        return Err(too_large(len, max, hint));
    }
    lease.grow(len as u64)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_bounded_and_given_back() {
        let b = ReplyBudget::new(ADMIT_BYTES * 2 + 10);
        let mut a = b.admit().unwrap();
        let c = b.admit().unwrap();
        assert!(a.grow(10).is_ok());
        let e = a.grow(1).err().unwrap();
        assert_eq!(e.code(), "reply_memory_exhausted");
        assert!(b.admit().is_err());
        drop(c);
        assert_eq!(b.used(), ADMIT_BYTES + 10);
        a.shrink_to(5);
        assert_eq!(b.used(), 5);
        drop(a);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn json_is_sized_first() {
        let b = ReplyBudget::new(1 << 20);
        let mut l = b.admit().unwrap();
        let text = "\u{1}".repeat(1000);
        let v = serde_json::json!({ "content": text });
        assert_eq!(json_len(&v), serde_json::to_vec(&v).unwrap().len());
        let e = lease_json(&mut l, &v, 5000, "use base64").err().unwrap();
        assert_eq!(e.code(), "reply_too_large");
        assert!(e.to_string().contains("6014 bytes"), "{e}");
        let before = l.held();
        assert_eq!(lease_json(&mut l, &v, 10_000, "").unwrap(), 6014);
        assert_eq!(l.held(), before + 6014);
    }
}
