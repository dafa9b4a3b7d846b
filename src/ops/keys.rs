//! Key operations (the admin routes): list, create, revoke, rotate,
//! delete. Revoking or deleting a key ends the sessions it owns: its
//! access is gone.

use super::auth::{validate_scopes, KeyError, KeyRecord, KeyStore, RateDefaults};
use super::{Ops, OpsError, OpsResult};
use crate::config::Config;

/// A key to make: its rate limit `None` is the daemon's.
#[derive(Debug, Clone, Default)]
pub struct NewKey {
    pub name: String,
    /// Checked by [`scopes`].
    pub scopes: Vec<String>,
    pub rate: Option<f64>,
    pub burst: Option<f64>,
    /// Ms since the epoch; `None`: never.
    pub expires_at: Option<u64>,
}

/// A key with its token, which is shown only now (create, rotate).
#[derive(Debug, Clone)]
pub struct Issued {
    pub record: KeyRecord,
    pub token: String,
}

/// The rate limit a key without its own has.
pub fn rate_defaults(cfg: &Config) -> RateDefaults {
    RateDefaults {
        rate: cfg.rate_per_sec,
        burst: cfg.rate_burst,
    }
}

/// A new key's scopes: `exec` when none are named.
pub fn scopes(scopes: Option<Vec<String>>) -> OpsResult<Vec<String>> {
    let scopes = scopes.unwrap_or_else(|| vec!["exec".into()]);
    validate_scopes(&scopes).map_err(OpsError::BadRequest)?;
    Ok(scopes)
}

/// A key id as a request names it: 1-64 ASCII letters and digits.
pub fn key_id(id: &str) -> OpsResult<&str> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(OpsError::BadRequest(format!("invalid key id {id:?}")));
    }
    Ok(id)
}

pub fn list(store: &KeyStore) -> Vec<KeyRecord> {
    store.list()
}

/// Every refusal of the store (bad name, rate, expiry; or the key file
/// not written) is the request's 400, as it always was.
pub fn create(store: &KeyStore, k: NewKey) -> OpsResult<Issued> {
    let (record, token) = store
        .create(&k.name, k.scopes, k.rate, k.burst, k.expires_at)
        .map_err(OpsError::BadRequest)?;
    Ok(Issued { record, token })
}

/// Revokes key `id` and ends its sessions.
pub fn revoke(store: &KeyStore, ops: &Ops, id: &str) -> OpsResult<KeyRecord> {
    let id = key_id(id)?;
    let rec = store.revoke(id).map_err(key_error)?;
    end_sessions_of(ops, id);
    Ok(rec)
}

/// A new secret for key `id` (same id, scopes and sessions).
pub fn rotate(store: &KeyStore, id: &str) -> OpsResult<Issued> {
    let id = key_id(id)?;
    let (record, token) = store.rotate(id).map_err(key_error)?;
    Ok(Issued { record, token })
}

/// Deletes key `id` and ends its sessions.
pub fn delete(store: &KeyStore, ops: &Ops, id: &str) -> OpsResult<()> {
    let id = key_id(id)?;
    store.delete(id).map_err(key_error)?;
    end_sessions_of(ops, id);
    Ok(())
}

/// The store's refusal in the client's terms: an unknown key, a revoked
/// one (rotating it is a conflict: it stays listed, revoked), or the key
/// file failing (ours).
fn key_error(e: KeyError) -> OpsError {
    match e {
        KeyError::NotFound { id } => OpsError::KeyNotFound { id },
        KeyError::Revoked { id } => OpsError::KeyRevoked { id },
        KeyError::Store(m) => OpsError::Internal(m),
    }
}

/// Ends every session a key owns (its access is gone).
fn end_sessions_of(ops: &Ops, key: &str) {
    for s in ops.mgr.list(Some(key)) {
        ops.mgr.remove(&s.owner, &s.id, "key revoked", false);
    }
}

/// Ends the sessions of keys that are revoked, expired or gone, also
/// behind the API's back (`agent-sandbox keys revoke` edits the key file).
pub fn end_sessions_of_unusable(store: &KeyStore, ops: &Ops) {
    for s in ops.mgr.list(None) {
        if !store.is_usable(&s.owner) {
            log::info!(
                "session {}/{}: its key is revoked or gone; ending it",
                s.owner,
                s.id
            );
            ops.mgr.remove(&s.owner, &s.id, "key revoked", false);
        }
    }
}
