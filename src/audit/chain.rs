//! The hash chain of an audit file set.
//!
//! A record is one line: a JSON object whose last member is
//! `"hash":"<64 hex>"`, and whose other members include `seq` (1, 2, ...
//! per session, continuing across rotated files) and `prev` (the previous
//! record's hash; [`GENESIS`], 64 zeros, for the first). With `body` the
//! line's bytes with its `,"hash":"…"` member cut out (so it ends in
//! `…,"prev":"<hex>"}`):
//!
//! ```text
//! hash = hex(sha256(prev_hex_ascii || body))
//! ```
//!
//! Any changed byte of a line changes its hash (or breaks its JSON); a
//! removed or reordered record breaks the next record's `prev` and the
//! `seq` run. A file cut short after a whole line still verifies: only the
//! head (last seq and hash) the daemon reports shows that.

use sha2::{Digest, Sha256};

/// `prev` of a session's first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The member that ends every line (before the closing brace).
pub const HASH_KEY: &str = ",\"hash\":\"";

pub fn sha256_hex(b: &[u8]) -> String {
    let d = Sha256::digest(b);
    let mut s = String::with_capacity(64);
    for x in d {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// The hash of a record whose line without its hash member is `body`.
pub fn hash_of(prev: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(prev.as_bytes());
    h.update(body);
    let mut s = String::with_capacity(64);
    for x in h.finalize() {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// `body` (an object ending in `}`) with its hash member added: the line
/// written (without its newline).
pub fn seal(body: &str, hash: &str) -> String {
    let mut line = String::with_capacity(body.len() + 80);
    line.push_str(&body[..body.len() - 1]);
    line.push_str(HASH_KEY);
    line.push_str(hash);
    line.push_str("\"}");
    line
}

/// A line split into its body (hash member cut out) and the hash it
/// claims; `None` if it does not end in a hash member.
pub fn split(line: &str) -> Option<(String, &str)> {
    let rest = line.strip_suffix("\"}")?;
    if rest.len() < 64 + HASH_KEY.len() {
        return None;
    }
    let (head, hash) = rest.split_at(rest.len() - 64);
    let head = head.strip_suffix(HASH_KEY)?;
    if !hash
        .bytes()
        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        return None;
    }
    Some((format!("{head}}}"), hash))
}
