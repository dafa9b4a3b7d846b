//! Input checks every front end's requests pass (one definition each).

use super::{EgressPolicy, OpsError, OpsResult};
use crate::config::Config;
use std::collections::BTreeMap;

/// A template name: `[a-z0-9][a-z0-9_-]{0,31}` (as the registry's).
pub fn template_name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 32
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && !n.starts_with(['-', '_'])
}

pub fn session_id(id: &str) -> OpsResult<()> {
    if crate::session::valid_session_id(id) {
        Ok(())
    } else {
        Err(OpsError::InvalidSessionId { id: truncate(id) })
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A guest path: non-empty, bounded, no NUL. Relative paths are taken
/// relative to the session's workspace by the agent. `what` names the
/// field in the error.
pub fn path(p: &str, what: &str) -> OpsResult<()> {
    let why = if p.is_empty() {
        "is empty"
    } else if p.len() > crate::proto::limits::MAX_PATH {
        "is too long"
    } else if p.contains('\0') {
        "contains a NUL byte"
    } else {
        return Ok(());
    };
    Err(OpsError::InvalidPath {
        path: what.to_string(),
        why,
    })
}

/// An egress policy as this daemon's network would apply it (see
/// [`EgressPolicy::validate`]): REST and MCP check it here before a
/// session is created or its policy replaced.
pub fn egress(p: &EgressPolicy, cfg: &Config) -> OpsResult<()> {
    p.validate(cfg.network.as_ref())
        .map_err(OpsError::BadRequest)
}

pub fn env(env: BTreeMap<String, String>) -> OpsResult<BTreeMap<String, String>> {
    if env.len() > crate::proto::limits::MAX_ENV {
        return Err(OpsError::BadRequest(
            "too many environment variables".into(),
        ));
    }
    for (k, v) in &env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(OpsError::BadRequest(format!(
                "invalid environment variable {:?}",
                truncate(k)
            )));
        }
    }
    Ok(env)
}

/// A snapshot id as the checkpoint store makes them (`snap-` and 12
/// lowercase hex digits); `what` names the field or parameter in the 400.
pub fn snapshot_id(id: &str, what: &str) -> OpsResult<()> {
    if crate::session::checkpoints::valid_id(id) {
        Ok(())
    } else {
        Err(OpsError::BadRequest(format!(
            "{what} {:?} is not a snapshot id (snap-, an optional host id and -, 12 hex digits)",
            truncate(id)
        )))
    }
}

/// A checkpoint's name: 1-64 characters.
pub fn snapshot_name(name: &str) -> OpsResult<()> {
    let n = name.chars().count();
    if (1..=64).contains(&n) {
        Ok(())
    } else {
        Err(OpsError::BadRequest(format!(
            "name must be 1-64 characters, not {n}"
        )))
    }
}

/// The most sessions one fork, or one create from a snapshot (`count`),
/// starts.
pub const MAX_FORK: u32 = 100;

/// How many sessions a fork or a create from a snapshot starts:
/// `1..=MAX_FORK`; `what` names the field.
pub fn count(n: i64, what: &str) -> OpsResult<u32> {
    let max = MAX_FORK;
    u32::try_from(n)
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| OpsError::BadRequest(format!("{what} {n} outside 1..={max}")))
}

/// `onIdle` as a client spells it.
pub fn on_idle(s: &str) -> OpsResult<super::OnIdle> {
    super::OnIdle::parse(s).ok_or_else(|| {
        OpsError::BadRequest(format!(
            "onIdle {:?}: want \"destroy\" or \"pause\"",
            truncate(s)
        ))
    })
}

/// Episodic secret files per exec (`exec {secrets}`): at most this many.
pub const MAX_SECRETS: usize = 32;
/// A secret value's size in bytes, at most (its least is
/// [`super::mask::MIN_MASKED_LEN`]: shorter values could not be masked).
pub const MAX_SECRET_BYTES: usize = 64 * 1024;
/// A secret's name (the file `/run/secrets/NAME`), at most this long.
pub const MAX_SECRET_NAME: usize = 64;

/// An exec's secrets: names of `[A-Za-z0-9_.-]`, 1..=64 characters, no
/// `..`; values of at least [`super::mask::MIN_MASKED_LEN`] characters
/// and at most [`MAX_SECRET_BYTES`] bytes, no more than [`MAX_SECRETS`]. Errors name a secret, never show
/// its value.
pub fn secrets(s: &BTreeMap<String, String>) -> OpsResult<()> {
    if s.len() > MAX_SECRETS {
        return Err(OpsError::BadRequest(format!(
            "too many secrets: {}, at most {MAX_SECRETS}",
            s.len()
        )));
    }
    let min = super::mask::MIN_MASKED_LEN;
    for (k, v) in s {
        let ok_chars = k
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if k.is_empty() || k.len() > MAX_SECRET_NAME || !ok_chars || k.contains("..") {
            return Err(OpsError::BadRequest(format!(
                "secret name {:?} is invalid: use 1-{MAX_SECRET_NAME} characters of \
                 A-Z a-z 0-9 _ . - and no ..",
                truncate(k)
            )));
        }
        // The least counts characters, as JSON Schema's `minLength` does (4
        // characters are at least 4 bytes, so the masker's floor holds); the
        // most counts bytes, which is what a value costs.
        let chars = v.chars().count();
        if chars < min || v.len() > MAX_SECRET_BYTES {
            return Err(OpsError::BadRequest(format!(
                "secret {k:?} is {chars} characters, {} bytes: a value takes at least \
                 {min} characters (shorter ones could not be masked in output) and at \
                 most {MAX_SECRET_BYTES} bytes",
                v.len()
            )));
        }
        if v.contains('\0') {
            return Err(OpsError::BadRequest(format!(
                "secret {k:?} contains a NUL byte"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_names_and_counts() {
        assert!(snapshot_id("snap-0123456789ab", "snapshot").is_ok());
        for bad in [
            "",
            "snap-",
            "snap-0123456789AB",
            "snap-0123456789a",
            "snap-0123456789abc",
            "s-0123456789ab",
            "snap-0123456789ag",
        ] {
            let e = snapshot_id(bad, "fromSnapshot").unwrap_err().message();
            assert!(e.starts_with("fromSnapshot "), "{bad}: {e}");
        }
        assert!(snapshot_name("x").is_ok());
        assert!(snapshot_name(&"é".repeat(64)).is_ok());
        assert!(snapshot_name("").is_err());
        assert_eq!(
            snapshot_name(&"x".repeat(65)).unwrap_err().message(),
            "name must be 1-64 characters, not 65"
        );
        assert_eq!(count(1, "count").ok(), Some(1));
        let max = MAX_FORK;
        assert_eq!(count(max.into(), "count").ok(), Some(max));
        for bad in [0, -1, i64::from(max) + 1, 1 << 40] {
            let e = count(bad, "count").unwrap_err().message();
            assert_eq!(e, format!("count {bad} outside 1..={max}"));
        }
        assert_eq!(on_idle("pause").ok(), Some(super::super::OnIdle::Pause));
        assert!(on_idle("sleep").unwrap_err().message().contains("onIdle"));
    }

    #[test]
    fn secret_names_sizes_and_counts() {
        let one = |k: &str, v: &str| secrets(&BTreeMap::from([(k.to_string(), v.to_string())]));
        assert!(one("API_KEY.v1-x", "abcd").is_ok());
        assert!(one(&"n".repeat(64), &"v".repeat(MAX_SECRET_BYTES)).is_ok());
        for bad in ["", "a/b", "..", "a..b", "a b", "é", &"n".repeat(65)] {
            let e = one(bad, "value-1234").unwrap_err().message();
            assert!(e.starts_with("secret name"), "{bad}: {e}");
            assert!(!e.contains("value-1234"), "{e}");
        }
        // 3 characters of 5 bytes are too short: the schema's minLength counts characters.
        assert!(one("K", "\u{ea}>\u{ba}").is_err());
        assert!(one("K", "\u{ea}>\u{ba}x").is_ok());
        for v in ["abc".to_string(), "v".repeat(MAX_SECRET_BYTES + 1)] {
            let e = one("K", &v).unwrap_err().message();
            assert!(e.starts_with("secret \"K\" is"), "{e}");
            assert!(!e.contains(&v), "{e}");
        }
        let many: BTreeMap<String, String> = (0..=MAX_SECRETS)
            .map(|i| (format!("k{i}"), "abcd".to_string()))
            .collect();
        assert!(secrets(&many)
            .unwrap_err()
            .message()
            .contains("too many secrets"));
    }
}
