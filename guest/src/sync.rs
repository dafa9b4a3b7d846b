//! Poison-tolerant locking, for the agent and the host daemon alike.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Locks `m`, taking over a lock a panicking thread poisoned: the panic is
/// already reported where it happened, and every structure kept under these
/// locks stays usable (a half-applied update is at worst a stale entry),
/// whereas propagating the poison would take down every later request.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// [`Condvar::wait_timeout`], poison-tolerant as [`lock`]. Callers loop on
/// their own condition and deadline, so whether it timed out is not kept.
pub fn wait_timeout<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>, dur: Duration) -> MutexGuard<'a, T> {
    match cv.wait_timeout(g, dur) {
        Ok((g, _)) => g,
        Err(p) => p.into_inner().0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_poisoned_lock_still_locks() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = lock(&m2);
            panic!("poison it");
        })
        .join();
        assert!(r.is_err() && m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
        let cv = Condvar::new();
        let g = wait_timeout(&cv, lock(&m), Duration::from_millis(1));
        assert_eq!(*g, 2);
    }
}
