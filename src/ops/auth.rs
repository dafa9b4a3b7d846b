//! API keys and authentication, one for both front ends: keys are
//! scoped, stored hashed in a 0600 JSON file, with a per-key token-bucket
//! rate limit; failed attempts are throttled per client address. A token
//! is `asbx_<id>_<secret>`: the id finds the record, the SHA-256 of the
//! whole token must match its hash. [`Auth::authenticate`] is the one
//! check REST and MCP-over-HTTP make; they map [`AuthError`] at their edge.

use super::Principal;
use crate::sync::lock;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

/// What a key may do. Key files and requests spell scopes as strings
/// (`exec`, `admin`, `metrics`); an unknown string grants nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Exec,
    Admin,
    Metrics,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Exec, Scope::Admin, Scope::Metrics];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Exec => "exec",
            Scope::Admin => "admin",
            Scope::Metrics => "metrics",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// Hex SHA-256 of the full token.
    pub hash: String,
    pub scopes: Vec<String>,
    /// Unix seconds.
    pub created: u64,
    #[serde(default)]
    pub revoked: bool,
    /// Requests per second allowed (token refill); `None` = daemon default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<f64>,
    /// When the key stops working, in ms since the Unix epoch; `None`:
    /// never. (Absent in key files written before keys could expire.)
    #[serde(default, rename = "expiresAt", skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// The start of its token before the id (`key_prefix` when it was
    /// made or last rotated); absent: [`TOKEN_PREFIX`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// What [`KeyRecord::public`] fills in for a key without its own rate
/// limit: the daemon's (`--rate-limit`, `--rate-burst`).
#[derive(Debug, Clone, Copy)]
pub struct RateDefaults {
    pub rate: f64,
    pub burst: f64,
}

impl KeyRecord {
    /// The public view (no hash), in the seed's record shape `{id, name,
    /// keyPrefix, scopes, rateLimit, createdAt, expiresAt, enabled}`
    /// (times in ms since the epoch, `expiresAt` null for never;
    /// `rateLimit` as in force: `{requestsPerSecond, burst}`), with
    /// `expired` and our older fields (`created` in seconds, `revoked`,
    /// `rate`, `burst`) beside it.
    pub fn public(&self, d: RateDefaults) -> serde_json::Value {
        serde_json::json!({
            "id": self.id,
            "name": self.name,
            "keyPrefix": self.key_prefix(),
            "scopes": self.scopes,
            "rateLimit": {
                "requestsPerSecond": self.rate.unwrap_or(d.rate),
                "burst": self.burst.unwrap_or(d.burst),
            },
            "createdAt": self.created.saturating_mul(1000),
            "expiresAt": self.expires_at,
            "enabled": !self.revoked,
            "expired": self.is_expired(now_ms()),
            "created": self.created,
            "revoked": self.revoked,
            "rate": self.rate,
            "burst": self.burst,
        })
    }

    /// The start of the key's tokens that is not secret (`asbx_<id>`): what
    /// tells a key apart in a list.
    pub fn key_prefix(&self) -> String {
        format!(
            "{}{}",
            self.prefix.as_deref().unwrap_or(TOKEN_PREFIX),
            self.id
        )
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        self.expires_at.is_some_and(|t| now_ms >= t)
    }

    /// Neither revoked nor expired.
    pub fn is_active(&self, now_ms: u64) -> bool {
        !self.revoked && !self.is_expired(now_ms)
    }

    /// `active`, `revoked` or `expired`, as `keys list` shows it.
    pub fn state(&self, now_ms: u64) -> &'static str {
        if self.revoked {
            "revoked"
        } else if self.is_expired(now_ms) {
            "expired"
        } else {
            "active"
        }
    }
}

/// Tokens are `<prefix><id>_<secret>`, the prefix `asbx_` unless the
/// operator names another (`key_prefix`, the seed's `AUTH_KEY_PREFIX`).
pub const TOKEN_PREFIX: &str = "asbx_";

/// Ids of keys this store makes: `k` and 12 hex digits. The id is found
/// at this length before a token's last `_`, whatever prefix the token
/// has (an operator may change the prefix; older keys keep working).
const ID_LEN: usize = 13;

pub use crate::config::validate_key_prefix as validate_prefix;

/// Why a token was refused (the 401 message).
pub fn refusal_message(r: &KeyRefusal) -> String {
    match r {
        KeyRefusal::Invalid => "invalid or revoked API key".into(),
        KeyRefusal::Expired { id, at } => format!(
            "API key {id} expired at {} ({at} ms since the epoch)",
            utc_string(*at)
        ),
    }
}

/// A token that does not authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRefusal {
    /// Unknown, malformed, wrong secret or revoked.
    Invalid,
    /// A key of ours whose `expiresAt` has passed.
    Expired { id: String, at: u64 },
}

/// Now, in ms since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `ms` since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_string(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyFile {
    keys: Vec<KeyRecord>,
}

impl Principal {
    /// The caller when authentication is off: every scope.
    pub fn anonymous() -> Principal {
        Principal {
            id: "anonymous".into(),
            scopes: Scope::ALL.to_vec(),
        }
    }

    /// The caller a key authenticates (its unknown scope strings grant
    /// nothing, as before scopes were typed).
    pub fn of_key(rec: &KeyRecord) -> Principal {
        Principal {
            id: rec.id.clone(),
            scopes: rec.scopes.iter().filter_map(|s| Scope::parse(s)).collect(),
        }
    }
}

pub fn validate_scopes(scopes: &[String]) -> Result<(), String> {
    if scopes.is_empty() {
        return Err("at least one scope is needed (exec, admin, metrics)".into());
    }
    for s in scopes {
        if Scope::parse(s).is_none() {
            return Err(format!("unknown scope {s:?} (exec, admin, metrics)"));
        }
    }
    Ok(())
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `bytes` random bytes from getrandom(2) as hex; key creation fails
/// closed when the kernel gives none.
fn random_hex(bytes: usize) -> Result<String, String> {
    let mut b = vec![0u8; bytes];
    crate::harden::random::secure_random(&mut b)
        .map_err(|e| format!("making key material: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn hash_token(token: &str) -> String {
    let d = Sha256::digest(token.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why the key store refused to change a key.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KeyError {
    #[error("no key {id:?}")]
    NotFound { id: String },
    #[error("key {id:?} is revoked")]
    Revoked { id: String },
    /// The key file could not be read or written (the message names it).
    #[error("{0}")]
    Store(String),
}

/// The key file, cached in memory and reloaded when it changes on disk
/// (so `agent-sandbox keys revoke` takes effect on a running daemon).
pub struct KeyStore {
    path: PathBuf,
    inner: Mutex<Cached>,
    /// What new and rotated tokens start with.
    prefix: String,
}

struct Cached {
    keys: Vec<KeyRecord>,
    mtime: Option<SystemTime>,
    checked: Instant,
}

impl KeyStore {
    /// Opens (or creates, empty) the key file; tightens its mode to 0600.
    pub fn open(path: &Path) -> Result<KeyStore, String> {
        Self::open_with_prefix(path, TOKEN_PREFIX)
    }

    /// [`open`](Self::open), new tokens starting with `prefix`.
    pub fn open_with_prefix(path: &Path, prefix: &str) -> Result<KeyStore, String> {
        validate_prefix(prefix)?;
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        }
        let store = KeyStore {
            path: path.to_path_buf(),
            inner: Mutex::new(Cached {
                keys: Vec::new(),
                mtime: None,
                checked: Instant::now(),
            }),
            prefix: prefix.to_string(),
        };
        if path.exists() {
            let meta = fs::metadata(path).map_err(|e| format!("stat {}: {e}", path.display()))?;
            if meta.permissions().mode() & 0o077 != 0 {
                log::warn!(
                    "key file {} was readable by others; setting mode 0600",
                    path.display()
                );
                fs::set_permissions(path, fs::Permissions::from_mode(0o600))
                    .map_err(|e| format!("chmod {}: {e}", path.display()))?;
            }
            let (keys, mtime) = store.read_file()?;
            let mut c = store.lock();
            c.keys = keys;
            c.mtime = mtime;
        } else {
            store.write_file(&[])?;
        }
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        lock(&self.inner)
    }

    fn read_file(&self) -> Result<(Vec<KeyRecord>, Option<SystemTime>), String> {
        let text = fs::read_to_string(&self.path)
            .map_err(|e| format!("read {}: {e}", self.path.display()))?;
        let mtime = fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if text.trim().is_empty() {
            return Ok((Vec::new(), mtime));
        }
        let f: KeyFile = serde_json::from_str(&text)
            .map_err(|e| format!("parse {}: {e}", self.path.display()))?;
        Ok((f.keys, mtime))
    }

    fn write_file(&self, keys: &[KeyRecord]) -> Result<(), String> {
        let tmp = self.path.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(&KeyFile {
            keys: keys.to_vec(),
        })
        .map_err(|e| format!("encode keys: {e}"))?;
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| format!("create {}: {e}", tmp.display()))?;
        f.write_all(&body)
            .and_then(|_| f.sync_all())
            .map_err(|e| format!("write {}: {e}", tmp.display()))?;
        fs::rename(&tmp, &self.path)
            .map_err(|e| format!("rename to {}: {e}", self.path.display()))?;
        Ok(())
    }

    /// Reloads from disk if the file changed (checked at most every 500 ms
    /// unless `force`).
    fn refresh(&self, c: &mut Cached, force: bool) {
        if !force && c.checked.elapsed().as_millis() < 500 {
            return;
        }
        c.checked = Instant::now();
        let mtime = fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if mtime != c.mtime {
            match self.read_file() {
                Ok((keys, m)) => {
                    c.keys = keys;
                    c.mtime = m;
                }
                Err(e) => log::error!("key file reload failed, keeping old keys: {e}"),
            }
        }
    }

    /// Applies `f` to the key list and saves it.
    fn update<T>(
        &self,
        f: impl FnOnce(&mut Vec<KeyRecord>) -> Result<T, KeyError>,
    ) -> Result<T, KeyError> {
        let mut c = self.lock();
        // Always start from the file so concurrent CLI edits are not lost.
        if let Ok((keys, _)) = self.read_file() {
            c.keys = keys;
        }
        let mut keys = c.keys.clone();
        let out = f(&mut keys)?;
        self.write_file(&keys).map_err(KeyError::Store)?;
        c.keys = keys;
        c.mtime = fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        c.checked = Instant::now();
        Ok(out)
    }

    pub fn list(&self) -> Vec<KeyRecord> {
        let mut c = self.lock();
        self.refresh(&mut c, false);
        c.keys.clone()
    }

    /// No key can authenticate (none, or all revoked or expired).
    pub fn is_empty(&self) -> bool {
        let now = now_ms();
        self.list().iter().all(|k| !k.is_active(now))
    }

    /// Creates a key; returns the record and the token (shown only now).
    pub fn create(
        &self,
        name: &str,
        scopes: Vec<String>,
        rate: Option<f64>,
        burst: Option<f64>,
        expires_at: Option<u64>,
    ) -> Result<(KeyRecord, String), String> {
        validate_scopes(&scopes)?;
        if let Some(t) = expires_at {
            let now = now_ms();
            if t <= now {
                return Err(format!(
                    "expiresAt {t} is not in the future (now is {now} ms since the epoch)"
                ));
            }
        }
        if name.len() > 128 || name.chars().any(|c| c.is_control()) {
            return Err("key name: at most 128 printable characters".into());
        }
        for v in [rate, burst].into_iter().flatten() {
            if !(v.is_finite() && v > 0.0 && v <= 1e6) {
                return Err(format!("rate/burst {v} out of range (0, 1e6]"));
            }
        }
        let id = format!("k{}", random_hex(6)?);
        let token = format!("{}{id}_{}", self.prefix, random_hex(24)?);
        let rec = KeyRecord {
            id,
            name: name.to_string(),
            hash: hash_token(&token),
            scopes,
            created: now_unix(),
            revoked: false,
            rate,
            burst,
            expires_at,
            prefix: self.record_prefix(),
        };
        let r2 = rec.clone();
        self.update(move |keys| {
            keys.push(r2);
            Ok(())
        })
        .map_err(|e| e.to_string())?;
        Ok((rec, token))
    }

    /// New secret for an existing key id (same id, scopes, sessions).
    pub fn rotate(&self, id: &str) -> Result<(KeyRecord, String), KeyError> {
        let token = format!(
            "{}{id}_{}",
            self.prefix,
            random_hex(24).map_err(KeyError::Store)?
        );
        let hash = hash_token(&token);
        let prefix = self.record_prefix();
        let rec = self.update(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id)
                .ok_or_else(|| KeyError::NotFound { id: id.to_string() })?;
            // A revoked key stays revoked: a new secret would not work.
            if k.revoked {
                return Err(KeyError::Revoked { id: id.to_string() });
            }
            k.hash = hash;
            k.prefix = prefix;
            Ok(k.clone())
        })?;
        Ok((rec, token))
    }

    pub fn revoke(&self, id: &str) -> Result<KeyRecord, KeyError> {
        self.update(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id)
                .ok_or_else(|| KeyError::NotFound { id: id.to_string() })?;
            k.revoked = true;
            Ok(k.clone())
        })
    }

    pub fn delete(&self, id: &str) -> Result<(), KeyError> {
        self.update(|keys| {
            let n = keys.len();
            keys.retain(|k| k.id != id);
            if keys.len() == n {
                return Err(KeyError::NotFound { id: id.to_string() });
            }
            Ok(())
        })
    }

    pub fn get(&self, id: &str) -> Option<KeyRecord> {
        self.list().into_iter().find(|k| k.id == id)
    }

    /// Whether key `id` exists and is neither revoked nor expired (the
    /// file is re-read if it changed: the CLI may have revoked or deleted
    /// it).
    pub fn is_usable(&self, id: &str) -> bool {
        let mut c = self.lock();
        self.refresh(&mut c, false);
        let now = now_ms();
        c.keys.iter().any(|k| k.id == id && k.is_active(now))
    }

    /// The active key a token belongs to, or why there is none.
    pub fn verify(&self, token: &str) -> Result<KeyRecord, KeyRefusal> {
        let id = token_id(token, &self.prefix).ok_or(KeyRefusal::Invalid)?;
        let check = |rec: Option<KeyRecord>| -> Result<KeyRecord, KeyRefusal> {
            let r = rec
                .filter(|r| !r.revoked && ct_eq(hash_token(token).as_bytes(), r.hash.as_bytes()))
                .ok_or(KeyRefusal::Invalid)?;
            match r.expires_at {
                // Only for the right secret: an expiry says nothing to a
                // caller who does not hold the key.
                Some(at) if r.is_expired(now_ms()) => Err(KeyRefusal::Expired {
                    id: r.id.clone(),
                    at,
                }),
                _ => Ok(r),
            }
        };
        match check(self.get(id)) {
            Err(KeyRefusal::Invalid) => {}
            r => return r,
        }
        // A key created or rotated by the CLI a moment ago: look at the
        // file now (one stat when it did not change).
        let mut c = self.lock();
        self.refresh(&mut c, true);
        check(c.keys.iter().find(|k| k.id == id).cloned())
    }

    /// The prefix a record keeps: none for the default (files stay as
    /// they were).
    fn record_prefix(&self) -> Option<String> {
        (self.prefix != TOKEN_PREFIX).then(|| self.prefix.clone())
    }
}

/// The key id in `token` (`<prefix><id>_<secret>`): the [`ID_LEN`]
/// characters before the last `_` when they look like one of our ids,
/// else what follows `prefix` or [`TOKEN_PREFIX`] (ids of other lengths,
/// made by hand). The hash check that follows covers the whole token, the
/// prefix included.
fn token_id<'a>(token: &'a str, prefix: &str) -> Option<&'a str> {
    let (head, secret) = token.rsplit_once('_')?;
    if secret.is_empty() {
        return None;
    }
    let b = head.as_bytes();
    if b.len() > ID_LEN {
        let id = &b[b.len() - ID_LEN..];
        if id[0] == b'k' && id[1..].iter().all(u8::is_ascii_hexdigit) {
            // ASCII, so a char boundary.
            return head.get(head.len() - ID_LEN..);
        }
    }
    [prefix, TOKEN_PREFIX]
        .iter()
        .find_map(|p| head.strip_prefix(p))
        .filter(|id| !id.is_empty() && !id.contains('_'))
}

/// Per-key token buckets.
pub struct RateLimiter {
    default_rate: f64,
    default_burst: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl RateLimiter {
    pub fn new(rate: f64, burst: f64) -> RateLimiter {
        RateLimiter {
            default_rate: rate,
            default_burst: burst,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `key`, or says how many seconds until one is there.
    pub fn check(&self, key: &KeyRecord) -> Result<(), AuthError> {
        let rate = key.rate.unwrap_or(self.default_rate).max(1e-6);
        let burst = key.burst.unwrap_or(self.default_burst).max(1.0);
        let mut b = lock(&self.buckets);
        let now = Instant::now();
        let (tokens, last) = b.entry(key.id.clone()).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            return Ok(());
        }
        let wait = ((1.0 - *tokens) / rate).ceil().max(1.0) as u64;
        Err(AuthError::RateLimited {
            id: key.id.clone(),
            rate,
            burst,
            retry_after: wait,
        })
    }
}

/// Failed authentications one client address may make in a burst (the
/// default of config `auth_fail_burst`), and how many per second it earns
/// back.
pub use crate::config::{AUTH_FAIL_BURST, AUTH_FAIL_RATE};
/// Client addresses tracked at once (oldest forgotten beyond).
const AUTH_FAIL_TRACKED: usize = 4096;

/// Throttles failed authentication per client address: a token bucket
/// of `burst` failures (config `auth_fail_burst`, default
/// [`AUTH_FAIL_BURST`]) refilled at [`AUTH_FAIL_RATE`] per second. An
/// address that spent it gets 429 before its key is checked.
pub struct AuthThrottle {
    burst: f64,
    m: Mutex<HashMap<IpAddr, (f64, Instant)>>,
}

impl AuthThrottle {
    pub fn new(burst: f64) -> AuthThrottle {
        AuthThrottle {
            burst,
            m: Mutex::new(HashMap::new()),
        }
    }

    fn refill(&self, b: &mut (f64, Instant), now: Instant) {
        let dt = now.saturating_duration_since(b.1).as_secs_f64();
        b.0 = (b.0 + dt * AUTH_FAIL_RATE).min(self.burst);
        b.1 = now;
    }

    /// Refuses an address that has failed too often lately.
    pub fn check(&self, ip: IpAddr) -> Result<(), AuthError> {
        let mut m = lock(&self.m);
        let Some(b) = m.get_mut(&ip) else {
            return Ok(());
        };
        self.refill(b, Instant::now());
        if b.0 >= 1.0 {
            return Ok(());
        }
        let wait = ((1.0 - b.0) / AUTH_FAIL_RATE).ceil().max(1.0) as u64;
        Err(AuthError::Throttled {
            ip,
            retry_after: wait,
        })
    }

    /// Counts one failed authentication of `ip`.
    pub fn failed(&self, ip: IpAddr) {
        let now = Instant::now();
        let mut m = lock(&self.m);
        if m.len() >= AUTH_FAIL_TRACKED && !m.contains_key(&ip) {
            // Forget addresses whose bucket is full again, then the
            // stalest one if that freed nothing.
            m.retain(|_, b| {
                self.refill(b, now);
                b.0 < self.burst
            });
            if m.len() >= AUTH_FAIL_TRACKED {
                if let Some(k) = m.iter().min_by_key(|(_, b)| b.1).map(|(k, _)| *k) {
                    m.remove(&k);
                }
            }
        }
        let b = m.entry(ip).or_insert((self.burst, now));
        self.refill(b, now);
        b.0 = (b.0 - 1.0).max(0.0);
    }
}

/// The token from `Authorization: Bearer` or `X-API-Key`, given the
/// request's headers as (name, value) pairs in the order received.
pub fn token_from_headers<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Option<String> {
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("authorization") {
            let v = value.trim();
            // Bytes, not a str slice: a value may hold any UTF-8.
            if v.len() > 7 && v.as_bytes()[..7].eq_ignore_ascii_case(b"bearer ") {
                return v.get(7..).map(|t| t.trim().to_string());
            }
        } else if name.eq_ignore_ascii_case("x-api-key") {
            return Some(value.trim().to_string());
        }
    }
    None
}

/// Why a request did not authenticate. Both front ends answer 401 for
/// [`Missing`](AuthError::Missing) and [`Refused`](AuthError::Refused),
/// 429 with `Retry-After` for the other two.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AuthError {
    #[error("an API key is required (Authorization: Bearer <key> or X-API-Key: <key>)")]
    Missing,
    #[error("{}", refusal_message(.0))]
    Refused(KeyRefusal),
    /// The client address failed too often lately (checked before its key).
    #[error("too many failed authentications from {ip}; retry in {retry_after} s")]
    Throttled { ip: IpAddr, retry_after: u64 },
    /// The key is over its rate limit.
    #[error("key {id} is over its rate limit of {rate}/s (burst {burst})")]
    RateLimited {
        id: String,
        rate: f64,
        burst: f64,
        retry_after: u64,
    },
}

impl AuthError {
    pub fn code(&self) -> &'static str {
        match self {
            AuthError::Missing | AuthError::Refused(KeyRefusal::Invalid) => "unauthorized",
            AuthError::Refused(KeyRefusal::Expired { .. }) => "key_expired",
            AuthError::Throttled { .. } => "auth_throttled",
            AuthError::RateLimited { .. } => "rate_limited",
        }
    }

    /// Seconds until a retry may succeed (the 429s).
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            AuthError::Throttled { retry_after, .. }
            | AuthError::RateLimited { retry_after, .. } => Some(*retry_after),
            AuthError::Missing | AuthError::Refused(_) => None,
        }
    }

    /// Too many attempts (429) rather than no valid key (401).
    pub fn is_throttle(&self) -> bool {
        self.retry_after().is_some()
    }
}

/// The daemon's authentication state: the key store, the per-key rate
/// limiter and the failed-auth throttle.
pub struct Auth {
    /// Off only on a loopback address (`--no-auth`): every caller is
    /// [`Principal::anonymous`].
    pub required: bool,
    pub keys: Arc<KeyStore>,
    pub limiter: RateLimiter,
    /// Failed authentications per client address.
    pub throttle: AuthThrottle,
}

impl Auth {
    /// Opens the config's key file; limits from the config.
    pub fn from_config(cfg: &crate::config::Config) -> Result<Auth, String> {
        Ok(Auth {
            required: cfg.auth,
            keys: Arc::new(KeyStore::open_with_prefix(&cfg.key_file, &cfg.key_prefix)?),
            limiter: RateLimiter::new(cfg.rate_per_sec, cfg.rate_burst),
            throttle: AuthThrottle::new(cfg.auth_fail_burst),
        })
    }

    /// The caller of a request from `peer` carrying `token` (see
    /// [`token_from_headers`]): throttle of the address first, then the
    /// key (a failure counts against the address), then its rate limit.
    /// Scopes are the caller's to check ([`Principal::may`]).
    pub fn authenticate(
        &self,
        peer: Option<IpAddr>,
        token: Option<String>,
    ) -> Result<Principal, AuthError> {
        if !self.required {
            return Ok(Principal::anonymous());
        }
        if let Some(ip) = peer {
            self.throttle.check(ip)?;
        }
        let failed = |e: AuthError| {
            if let Some(ip) = peer {
                self.throttle.failed(ip);
            }
            e
        };
        let token = token.ok_or_else(|| failed(AuthError::Missing))?;
        let rec = self
            .keys
            .verify(&token)
            .map_err(|r| failed(AuthError::Refused(r)))?;
        self.limiter.check(&rec)?;
        Ok(Principal::of_key(&rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Key `k1` with `scopes`, nothing else set.
    fn test_key(scopes: &[&str]) -> KeyRecord {
        KeyRecord {
            id: "k1".into(),
            name: String::new(),
            hash: String::new(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            created: 0,
            revoked: false,
            prefix: None,
            rate: None,
            burst: None,
            expires_at: None,
        }
    }

    #[test]
    fn create_verify_rotate_revoke() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.json");
        let s = KeyStore::open(&p).unwrap();
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (rec, tok) = s
            .create("a", vec!["exec".into()], None, None, None)
            .unwrap();
        assert_eq!(s.verify(&tok).unwrap().id, rec.id);
        assert!(s.verify(&format!("{tok}x")).is_err());
        assert!(!fs::read_to_string(&p).unwrap().contains(&tok));
        let (_, tok2) = s.rotate(&rec.id).unwrap();
        assert!(s.verify(&tok).is_err());
        assert!(s.verify(&tok2).is_ok());
        s.revoke(&rec.id).unwrap();
        assert_eq!(s.verify(&tok2), Err(KeyRefusal::Invalid));
        assert!(s
            .create("b", vec!["root".into()], None, None, None)
            .is_err());
    }

    #[test]
    fn keys_expire_and_old_files_load() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.json");
        // A key file from before keys could expire.
        fs::write(
            &p,
            r#"{"keys":[{"id":"k1","name":"old","hash":"00","scopes":["exec"],"created":5}]}"#,
        )
        .unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
        let s = KeyStore::open(&p).unwrap();
        let old = s.get("k1").unwrap();
        assert_eq!(old.expires_at, None);
        assert_eq!(old.state(now_ms()), "active");
        let d = RateDefaults {
            rate: 10.0,
            burst: 20.0,
        };
        let v = old.public(d);
        assert_eq!(v["createdAt"], 5000);
        assert_eq!(v["expiresAt"], serde_json::Value::Null);
        assert_eq!(v["enabled"], true);
        assert_eq!(v["keyPrefix"], "asbx_k1");
        assert_eq!(v["rateLimit"]["requestsPerSecond"], 10.0);

        assert!(s
            .create("past", vec!["exec".into()], None, None, Some(now_ms() - 1))
            .is_err());
        let soon = now_ms() + 300;
        let (rec, tok) = s
            .create("soon", vec!["exec".into()], None, None, Some(soon))
            .unwrap();
        assert!(s.verify(&tok).is_ok());
        assert!(s.is_usable(&rec.id));
        std::thread::sleep(std::time::Duration::from_millis(400));
        assert_eq!(
            s.verify(&tok),
            Err(KeyRefusal::Expired {
                id: rec.id.clone(),
                at: soon
            })
        );
        assert!(!s.is_usable(&rec.id));
        assert_eq!(s.get(&rec.id).unwrap().state(now_ms()), "expired");
        // A wrong secret for an expired key is just invalid.
        assert_eq!(s.verify(&format!("{tok}0")), Err(KeyRefusal::Invalid));
        // The expiry survives a reload from disk.
        let again = KeyStore::open(&p).unwrap();
        assert_eq!(again.get(&rec.id).unwrap().expires_at, Some(soon));
        assert!(fs::read_to_string(&p).unwrap().contains("\"expiresAt\""));
    }

    #[test]
    fn utc_strings() {
        assert_eq!(utc_string(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_string(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_string(1_795_000_000_123), "2026-11-18T11:06:40Z");
    }

    #[test]
    fn token_parsing_takes_any_utf8_header_value() {
        // A multi-byte character across byte 7 (found by the rest fuzzer).
        assert_eq!(
            token_from_headers([("Authorization", "Bearer\u{72b}x")]),
            None
        );
        assert_eq!(
            token_from_headers([("authorization", "bearer  asbx_k1_x ")]),
            Some("asbx_k1_x".into())
        );
        assert_eq!(
            token_from_headers([("X-API-Key", " asbx_k2_y")]),
            Some("asbx_k2_y".into())
        );
    }

    #[test]
    fn key_material_is_random_hex_of_the_asked_length() {
        let (a, b) = (random_hex(24).unwrap(), random_hex(24).unwrap());
        assert_eq!(a.len(), 48);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn a_chosen_prefix_makes_tokens_and_older_ones_still_verify() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.json");
        let old = KeyStore::open(&p).unwrap();
        let (_, t_old) = old
            .create("a", vec!["exec".into()], None, None, None)
            .unwrap();
        assert!(t_old.starts_with("asbx_k"), "{t_old}");
        let s = KeyStore::open_with_prefix(&p, "sk_live_").unwrap();
        let (rec, t) = s
            .create("b", vec!["exec".into()], None, None, None)
            .unwrap();
        assert!(t.starts_with(&format!("sk_live_{}_", rec.id)), "{t}");
        assert_eq!(rec.key_prefix(), format!("sk_live_{}", rec.id));
        assert_eq!(s.verify(&t).map(|r| r.id), Ok(rec.id.clone()));
        assert!(s.verify(&t_old).is_ok(), "a key of the old prefix");
        // The prefix is part of what the hash covers.
        let forged = t.replacen("sk_live_", "asbx_", 1);
        assert_eq!(s.verify(&forged), Err(KeyRefusal::Invalid));
        // Hand-made ids of other lengths, and junk.
        assert_eq!(token_id("asbx_k1_x", "asbx_"), Some("k1"));
        assert_eq!(token_id("sk-k1_x", "sk-"), Some("k1"));
        for bad in ["", "_", "asbx_", "asbx__x", "asbx_k1_", "nope"] {
            assert_eq!(token_id(bad, "asbx_"), None, "{bad:?}");
        }
        assert!(KeyStore::open_with_prefix(&p, "bad prefix").is_err());
        assert!(validate_prefix(&"x".repeat(33)).is_err());
    }

    #[test]
    fn scopes_are_spelled_as_before() {
        for (s, want) in [
            ("exec", Some(Scope::Exec)),
            ("admin", Some(Scope::Admin)),
            ("metrics", Some(Scope::Metrics)),
            ("Exec", None),
            ("root", None),
        ] {
            assert_eq!(Scope::parse(s), want, "{s}");
            assert_eq!(want.map(Scope::as_str).unwrap_or(s), s);
        }
        let rec = test_key(&["metrics", "root"]);
        let p = Principal::of_key(&rec);
        assert_eq!(
            p.scopes,
            vec![Scope::Metrics],
            "an unknown scope grants nothing"
        );
        assert!(!p.may(Scope::Exec));
        assert!(Principal::anonymous().may(Scope::Admin));
    }

    #[test]
    fn one_authentication_throttles_refuses_and_rate_limits() {
        let dir = tempfile::tempdir().unwrap();
        let keys = Arc::new(KeyStore::open(&dir.path().join("keys.json")).unwrap());
        let (rec, tok) = keys
            .create("a", vec!["exec".into()], Some(1.0), Some(1.0), None)
            .unwrap();
        let auth = Auth {
            required: true,
            keys,
            limiter: RateLimiter::new(10.0, 10.0),
            throttle: AuthThrottle::new(2.0),
        };
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let e = auth.authenticate(Some(ip), None).unwrap_err();
        assert_eq!((e.code(), e.retry_after()), ("unauthorized", None));
        assert!(e.to_string().starts_with("an API key is required"));
        let e = auth
            .authenticate(Some(ip), Some("asbx_k1_x".into()))
            .unwrap_err();
        assert_eq!(e, AuthError::Refused(KeyRefusal::Invalid));
        assert_eq!(e.to_string(), "invalid or revoked API key");
        // Two failures spent the address's burst: even a good key waits.
        let e = auth.authenticate(Some(ip), Some(tok.clone())).unwrap_err();
        assert_eq!(e.code(), "auth_throttled");
        assert!(e.is_throttle() && e.retry_after().is_some());
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        let p = auth.authenticate(Some(other), Some(tok.clone())).unwrap();
        assert_eq!(
            (p.id.as_str(), p.scopes.as_slice()),
            (rec.id.as_str(), &[Scope::Exec][..])
        );
        let e = auth.authenticate(Some(other), Some(tok)).unwrap_err();
        assert_eq!(e.code(), "rate_limited");
        assert_eq!(e.retry_after(), Some(1));
        let off = Auth {
            required: false,
            ..auth
        };
        assert_eq!(off.authenticate(None, None).unwrap().id, "anonymous");
    }

    #[test]
    fn bucket() {
        let rl = RateLimiter::new(1.0, 2.0);
        let k = test_key(&[]);
        assert!(rl.check(&k).is_ok());
        assert!(rl.check(&k).is_ok());
        let e = rl.check(&k).unwrap_err();
        assert_eq!(e.code(), "rate_limited");
        assert_eq!(e.retry_after(), Some(1));
    }
}
