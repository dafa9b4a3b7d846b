//! API keys: scoped, stored hashed in a 0600 JSON file, with a per-key
//! token-bucket rate limit. A token is `asbx_<id>_<secret>`: the id finds
//! the record, the SHA-256 of the whole token must match its hash.

use super::errors::ApiError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

pub const SCOPES: &[&str] = &["exec", "admin", "metrics"];

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
}

impl KeyRecord {
    /// The public view (no hash).
    pub fn public(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id, "name": self.name, "scopes": self.scopes,
            "created": self.created, "revoked": self.revoked,
            "rate": self.rate, "burst": self.burst,
        })
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyFile {
    keys: Vec<KeyRecord>,
}

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Principal {
    /// Key id, or `anonymous` when auth is off.
    pub id: String,
    pub scopes: Vec<String>,
}

impl Principal {
    pub fn has(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }
    pub fn is_admin(&self) -> bool {
        self.has("admin")
    }
    pub fn anonymous() -> Principal {
        Principal {
            id: "anonymous".into(),
            scopes: SCOPES.iter().map(|s| s.to_string()).collect(),
        }
    }
}

pub fn validate_scopes(scopes: &[String]) -> Result<(), String> {
    if scopes.is_empty() {
        return Err("at least one scope is needed (exec, admin, metrics)".into());
    }
    for s in scopes {
        if !SCOPES.contains(&s.as_str()) {
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
    crate::agent::secure_random(&mut b).map_err(|e| format!("making key material: {e}"))?;
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

/// The key file, cached in memory and reloaded when it changes on disk
/// (so `agent-sandbox keys revoke` takes effect on a running daemon).
pub struct KeyStore {
    path: PathBuf,
    inner: Mutex<Cached>,
}

struct Cached {
    keys: Vec<KeyRecord>,
    mtime: Option<SystemTime>,
    checked: Instant,
}

impl KeyStore {
    /// Opens (or creates, empty) the key file; tightens its mode to 0600.
    pub fn open(path: &Path) -> Result<KeyStore, String> {
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
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
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
        f: impl FnOnce(&mut Vec<KeyRecord>) -> Result<T, String>,
    ) -> Result<T, String> {
        let mut c = self.lock();
        // Always start from the file so concurrent CLI edits are not lost.
        if let Ok((keys, _)) = self.read_file() {
            c.keys = keys;
        }
        let mut keys = c.keys.clone();
        let out = f(&mut keys)?;
        self.write_file(&keys)?;
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

    pub fn is_empty(&self) -> bool {
        self.list().iter().all(|k| k.revoked)
    }

    /// Creates a key; returns the record and the token (shown only now).
    pub fn create(
        &self,
        name: &str,
        scopes: Vec<String>,
        rate: Option<f64>,
        burst: Option<f64>,
    ) -> Result<(KeyRecord, String), String> {
        validate_scopes(&scopes)?;
        if name.len() > 128 || name.chars().any(|c| c.is_control()) {
            return Err("key name: at most 128 printable characters".into());
        }
        for v in [rate, burst].into_iter().flatten() {
            if !(v.is_finite() && v > 0.0 && v <= 1e6) {
                return Err(format!("rate/burst {v} out of range (0, 1e6]"));
            }
        }
        let id = format!("k{}", random_hex(6)?);
        let token = format!("asbx_{id}_{}", random_hex(24)?);
        let rec = KeyRecord {
            id,
            name: name.to_string(),
            hash: hash_token(&token),
            scopes,
            created: now_unix(),
            revoked: false,
            rate,
            burst,
        };
        let r2 = rec.clone();
        self.update(move |keys| {
            keys.push(r2);
            Ok(())
        })?;
        Ok((rec, token))
    }

    /// New secret for an existing key id (same id, scopes, sessions).
    pub fn rotate(&self, id: &str) -> Result<(KeyRecord, String), String> {
        let token = format!("asbx_{id}_{}", random_hex(24)?);
        let hash = hash_token(&token);
        let rec = self.update(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id && !k.revoked)
                .ok_or_else(|| format!("no active key {id:?}"))?;
            k.hash = hash;
            Ok(k.clone())
        })?;
        Ok((rec, token))
    }

    pub fn revoke(&self, id: &str) -> Result<KeyRecord, String> {
        self.update(|keys| {
            let k = keys
                .iter_mut()
                .find(|k| k.id == id)
                .ok_or_else(|| format!("no key {id:?}"))?;
            k.revoked = true;
            Ok(k.clone())
        })
    }

    pub fn delete(&self, id: &str) -> Result<(), String> {
        self.update(|keys| {
            let n = keys.len();
            keys.retain(|k| k.id != id);
            if keys.len() == n {
                return Err(format!("no key {id:?}"));
            }
            Ok(())
        })
    }

    pub fn get(&self, id: &str) -> Option<KeyRecord> {
        self.list().into_iter().find(|k| k.id == id)
    }

    /// The active key a token belongs to.
    /// Whether key `id` exists and is not revoked (the file is re-read if
    /// it changed: the CLI may have revoked or deleted it).
    pub fn is_usable(&self, id: &str) -> bool {
        let mut c = self.lock();
        self.refresh(&mut c, false);
        c.keys.iter().any(|k| k.id == id && !k.revoked)
    }

    pub fn verify(&self, token: &str) -> Option<KeyRecord> {
        let id = token.strip_prefix("asbx_")?.split('_').next()?;
        let check = |rec: Option<KeyRecord>| {
            rec.filter(|r| !r.revoked && ct_eq(hash_token(token).as_bytes(), r.hash.as_bytes()))
        };
        if let Some(r) = check(self.get(id)) {
            return Some(r);
        }
        // A key created or rotated by the CLI a moment ago: look at the
        // file now (one stat when it did not change).
        let mut c = self.lock();
        self.refresh(&mut c, true);
        check(c.keys.iter().find(|k| k.id == id).cloned())
    }
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
    pub fn check(&self, key: &KeyRecord) -> Result<(), ApiError> {
        let rate = key.rate.unwrap_or(self.default_rate).max(1e-6);
        let burst = key.burst.unwrap_or(self.default_burst).max(1.0);
        let mut b = match self.buckets.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let now = Instant::now();
        let (tokens, last) = b.entry(key.id.clone()).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            return Ok(());
        }
        let wait = ((1.0 - *tokens) / rate).ceil().max(1.0) as u64;
        let mut e = ApiError::new(
            429,
            "rate_limited",
            format!(
                "key {} is over its rate limit of {rate}/s (burst {burst})",
                key.id
            ),
        );
        e.retry_after = Some(wait);
        Err(e)
    }
}

/// Failed authentications one client address may make in a burst, and
/// how many per second it earns back.
pub const AUTH_FAIL_BURST: f64 = 20.0;
pub const AUTH_FAIL_RATE: f64 = 2.0;
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
    pub fn check(&self, ip: IpAddr) -> Result<(), ApiError> {
        let mut m = self.m.lock().unwrap_or_else(|p| p.into_inner());
        let Some(b) = m.get_mut(&ip) else {
            return Ok(());
        };
        self.refill(b, Instant::now());
        if b.0 >= 1.0 {
            return Ok(());
        }
        let wait = ((1.0 - b.0) / AUTH_FAIL_RATE).ceil().max(1.0) as u64;
        let mut e = ApiError::new(
            429,
            "auth_throttled",
            format!("too many failed authentications from {ip}; retry in {wait} s"),
        );
        e.retry_after = Some(wait);
        Err(e)
    }

    /// Counts one failed authentication of `ip`.
    pub fn failed(&self, ip: IpAddr) {
        let now = Instant::now();
        let mut m = self.m.lock().unwrap_or_else(|p| p.into_inner());
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

/// The token from `Authorization: Bearer` or `X-API-Key`.
pub fn token_from_headers(headers: &[super::httpd::Header]) -> Option<String> {
    for h in headers {
        if h.is("authorization") {
            let v = h.value.as_str().trim();
            // Bytes, not a str slice: a value may hold any UTF-8.
            if v.len() > 7 && v.as_bytes()[..7].eq_ignore_ascii_case(b"bearer ") {
                return v.get(7..).map(|t| t.trim().to_string());
            }
        } else if h.is("x-api-key") {
            return Some(h.value.as_str().trim().to_string());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_verify_rotate_revoke() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.json");
        let s = KeyStore::open(&p).unwrap();
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (rec, tok) = s.create("a", vec!["exec".into()], None, None).unwrap();
        assert_eq!(s.verify(&tok).unwrap().id, rec.id);
        assert!(s.verify(&format!("{tok}x")).is_none());
        assert!(!fs::read_to_string(&p).unwrap().contains(&tok));
        let (_, tok2) = s.rotate(&rec.id).unwrap();
        assert!(s.verify(&tok).is_none());
        assert!(s.verify(&tok2).is_some());
        s.revoke(&rec.id).unwrap();
        assert!(s.verify(&tok2).is_none());
        assert!(s.create("b", vec!["root".into()], None, None).is_err());
    }

    #[test]
    fn token_parsing_takes_any_utf8_header_value() {
        let h = |n: &str, v: &str| super::super::httpd::Header {
            name: n.into(),
            value: v.into(),
        };
        // A multi-byte character across byte 7 (found by the rest fuzzer).
        assert_eq!(
            token_from_headers(&[h("Authorization", "Bearer\u{72b}x")]),
            None
        );
        assert_eq!(
            token_from_headers(&[h("authorization", "bearer  asbx_k1_x ")]),
            Some("asbx_k1_x".into())
        );
        assert_eq!(
            token_from_headers(&[h("X-API-Key", " asbx_k2_y")]),
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
    fn bucket() {
        let rl = RateLimiter::new(1.0, 2.0);
        let k = KeyRecord {
            id: "k1".into(),
            name: String::new(),
            hash: String::new(),
            scopes: vec![],
            created: 0,
            revoked: false,
            rate: None,
            burst: None,
        };
        assert!(rl.check(&k).is_ok());
        assert!(rl.check(&k).is_ok());
        let e = rl.check(&k).unwrap_err();
        assert_eq!(e.status, 429);
        assert_eq!(e.retry_after, Some(1));
    }
}
