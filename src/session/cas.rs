//! Extra trusted CAs in a guest (issue #25): `guest_ca_bundle` at every
//! session start, and later other CAs (the egress proxy's per-session
//! interception CA) through the same [`install_guest_cas`].
//!
//! Done from the host over the agent's file requests rather than by a
//! script in the guest, so it needs no guest tool and no guest change:
//! - the PEM goes to `/usr/local/share/ca-certificates/<label>.crt`, where
//!   Debian's `update-ca-certificates` finds it should the user run it;
//! - it is appended to `/etc/ssl/certs/ca-certificates.crt` (the store
//!   OpenSSL, curl, Python, pip and git read) between marker lines naming
//!   the label. A second install of the same label replaces its block, so a
//!   session restored from a checkpoint, fork or pause, whose disk already
//!   has the block, ends with the same file and nothing is rewritten;
//!   certificates already in the bundle outside a block (the user ran
//!   `update-ca-certificates`, which folds our `.crt` in) are not added
//!   again. Running `update-ca-certificates` at each start instead would
//!   cost seconds on TCG and needs the tool in every image.
//!
//! Every exec of such a session gets [`guest_env`]: the variables that
//! make Python requests, pip, Node, curl and git read that same bundle
//! (system CAs + extra, so public sites still verify).

use crate::agent::{AgentClient, ClientError, Inbound};
use crate::proto::{ErrorCode, Request, Response};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Where a label's PEM is written.
pub const STORE_DIR: &str = "/usr/local/share/ca-certificates";
/// The guest's combined bundle (system CAs, then ours).
pub const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The label of `guest_ca_bundle`'s CAs.
pub const CONFIG_LABEL: &str = "agent-sandbox";
/// The label of the session's egress-proxy CA (injected secrets).
pub const PROXY_LABEL: &str = "egress-proxy";
/// The variables [`guest_env`] sets, all to [`BUNDLE`].
pub const ENV_VARS: [&str; 6] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
];
/// Largest guest bundle read back: the guest may have grown it, and the
/// host holds it in memory for the edit (Debian's is ~220 KiB).
const MAX_GUEST_BUNDLE: u64 = 8 << 20;
/// The whole install (a read and up to two writes); TCG guests on a busy
/// host are slow, a dead one must not hold the session's start forever.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(30);

/// What [`install_guest_cas`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Installed {
    /// Certificates in the PEM.
    pub certs: usize,
    /// Whether the guest's bundle was rewritten (false: already there).
    pub bundle_changed: bool,
}

/// The environment of every exec of a session whose guest trusts extra
/// CAs (a user's own value for a variable wins: `Session::env_for`).
pub fn guest_env() -> BTreeMap<String, String> {
    ENV_VARS
        .iter()
        .map(|k| (k.to_string(), BUNDLE.to_string()))
        .collect()
}

fn valid_label(l: &str) -> bool {
    !l.is_empty()
        && l.len() <= 32
        && l.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn begin_line(label: &str) -> String {
    format!("# agent-sandbox extra CAs begin: {label}\n")
}

fn end_line(label: &str) -> String {
    format!("# agent-sandbox extra CAs end: {label}\n")
}

/// `label`'s block of `pem` in the bundle, marker lines included.
fn block_of(label: &str, pem: &str) -> String {
    let mut block = format!("{}{pem}", begin_line(label));
    if !pem.ends_with('\n') {
        block.push('\n');
    }
    block.push_str(&end_line(label));
    block
}

/// `bundle` without `label`'s blocks (every one, should there be several).
fn strip_block(bundle: &str, label: &str) -> String {
    let (begin, end) = (begin_line(label), end_line(label));
    let mut out = String::with_capacity(bundle.len());
    let mut rest = bundle;
    while let Some(b) = rest.find(&begin) {
        out.push_str(&rest[..b]);
        match rest[b..].find(&end) {
            Some(e) => rest = &rest[b + e + end.len()..],
            // A block cut short (the guest edited it): drop to the end.
            None => rest = "",
        }
    }
    out.push_str(rest);
    out
}

/// `bundle` with `pem` as `label`'s block: an existing block is replaced
/// where it stands (so with several labels no install reorders, and an
/// unchanged one rewrites nothing), else it is appended, unless every
/// certificate of `pem` is already in the file.
pub fn edit_bundle(bundle: &str, label: &str, pem: &str) -> String {
    let (begin, end) = (begin_line(label), end_line(label));
    let block = block_of(label, pem);
    if let Some(b) = bundle.find(&begin) {
        let after = match bundle[b..].find(&end) {
            Some(e) => &bundle[b + e + end.len()..],
            // A block cut short (the guest edited it): drop to the end.
            None => "",
        };
        return format!("{}{block}{}", &bundle[..b], strip_block(after, label));
    }
    let certs: Vec<&str> = pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .filter(|c| c.contains("-----BEGIN CERTIFICATE-----"))
        .collect();
    if !certs.is_empty() && certs.iter().all(|c| bundle.contains(c)) {
        return bundle.to_string();
    }
    let mut out = bundle.to_string();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(&block);
    out
}

/// Installs `pem` (one or more CERTIFICATE blocks, already checked, e.g.
/// by `config::guest_ca::parse`) into the guest's trust store under
/// `label` (`[a-z0-9-]{1,32}`; one file and one bundle block per label, so
/// a second CA, e.g. the egress proxy's, is its own label). Idempotent:
/// call it at every start of a sandbox, restored ones included. The
/// session's execs need [`guest_env`] too (`Session::env_for` adds it for
/// sessions made while the daemon has a `guest_ca_bundle`; the variables
/// name the bundle, so one more label needs no other variable).
pub fn install_guest_cas(agent: &AgentClient, label: &str, pem: &str) -> Result<Installed, String> {
    if !valid_label(label) {
        return Err(format!("CA label {label:?}: 1-32 of a-z, 0-9, '-'"));
    }
    let certs = pem.matches("-----BEGIN CERTIFICATE-----").count();
    if certs == 0 {
        return Err(format!("CAs {label}: no PEM CERTIFICATE block"));
    }
    let deadline = Instant::now() + INSTALL_TIMEOUT;
    let file = format!("{STORE_DIR}/{label}.crt");
    if already_installed(agent, &file, label, pem, deadline) {
        return Ok(Installed {
            certs,
            bundle_changed: false,
        });
    }
    write(agent, &file, pem.as_bytes(), deadline).map_err(|e| format!("write {file}: {e}"))?;
    let old = read(agent, BUNDLE, 0, MAX_GUEST_BUNDLE, deadline)
        .map_err(|e| format!("read {BUNDLE}: {e}"))?;
    // The bundle is PEM text; bytes that are not UTF-8 would be replaced,
    // so such a file is left alone rather than rewritten damaged.
    let old = match old {
        Some(b) => {
            String::from_utf8(b).map_err(|_| format!("{BUNDLE}: not UTF-8 text; left as it is"))?
        }
        None => String::new(),
    };
    let new = edit_bundle(&old, label, pem);
    let bundle_changed = new != old;
    if bundle_changed {
        write(agent, BUNDLE, new.as_bytes(), deadline)
            .map_err(|e| format!("write {BUNDLE}: {e}"))?;
    }
    Ok(Installed {
        certs,
        bundle_changed,
    })
}

/// The common case of a restored guest, checked cheaply (two small reads
/// and a stat instead of reading the whole ~220 KiB bundle, which cost
/// ~170 ms of a TCG restore): `label`'s file holds `pem` and the bundle
/// ends with its block. Any doubt (an error, another label's block after
/// ours) is `false`: the full install then decides.
fn already_installed(
    agent: &AgentClient,
    file: &str,
    label: &str,
    pem: &str,
    deadline: Instant,
) -> bool {
    let block = block_of(label, pem);
    let want = block.len() as u64;
    // Both asked at once: one round trip to the guest, not two.
    let crt = agent.call(&read_request(file, 0, pem.len() as u64));
    let stat = agent.call(&Request::Stat {
        path: BUNDLE.into(),
    });
    let (Ok(crt), Ok(mut stat)) = (crt, stat) else {
        return false;
    };
    match collect(crt, pem.len() as u64, deadline) {
        Ok(Some(f)) if f == pem.as_bytes() => {}
        _ => return false,
    }
    let size = loop {
        match stat.recv_deadline(deadline) {
            Ok(Inbound::Response(Response::Stat(st))) => break st.size,
            Ok(Inbound::Response(_) | Inbound::Error(_)) | Err(_) => return false,
            Ok(_) => {}
        }
    };
    if size < want {
        return false;
    }
    matches!(read(agent, BUNDLE, size - want, want, deadline),
             Ok(Some(tail)) if tail == block.as_bytes())
}

fn read_request(path: &str, offset: u64, max: u64) -> Request {
    Request::ReadFile {
        path: path.into(),
        offset,
        // One more than wanted, to tell "exactly max" from "more".
        len: Some(max + 1),
    }
}

/// At most `max` bytes of the guest file `path` from `offset` (`None`:
/// there is no such file; more than `max` is an error), by `deadline`.
fn read(
    agent: &AgentClient,
    path: &str,
    offset: u64,
    max: u64,
    deadline: Instant,
) -> Result<Option<Vec<u8>>, ClientError> {
    collect(agent.call(&read_request(path, offset, max))?, max, deadline)
}

/// What a started read answers ([`read`]).
fn collect(
    mut c: crate::agent::Call,
    max: u64,
    deadline: Instant,
) -> Result<Option<Vec<u8>>, ClientError> {
    let mut out = Vec::new();
    loop {
        match c.recv_deadline(deadline)? {
            Inbound::Data { bytes, .. } => {
                out.extend_from_slice(&bytes);
                if out.len() as u64 > max {
                    let _ = c.cancel();
                    return Err(ClientError::OverBudget(format!("larger than {max} bytes")));
                }
            }
            Inbound::Response(_) => return Ok(Some(out)),
            Inbound::Error(e) if e.code == ErrorCode::NotFound => return Ok(None),
            Inbound::Error(e) => return Err(ClientError::Agent(e)),
            _ => {}
        }
    }
}

/// Writes `data` to the guest file `path` (mode 0644, parents made; the
/// agent renames a temporary file over it, so no reader sees half).
fn write(
    agent: &AgentClient,
    path: &str,
    data: &[u8],
    deadline: Instant,
) -> Result<(), ClientError> {
    let mut c = agent.call(&Request::WriteFile {
        path: path.into(),
        mode: Some(0o644),
        create_parents: true,
        append: false,
    })?;
    c.send_all(data)?;
    c.send_eof()?;
    loop {
        match c.recv_deadline(deadline)? {
            Inbound::Response(Response::Written { .. }) => return Ok(()),
            Inbound::Response(r) => {
                return Err(ClientError::Protocol(format!("unexpected answer {r:?}")))
            }
            Inbound::Error(e) => return Err(ClientError::Agent(e)),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    const B: &str = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n";
    const SYS: &str = "-----BEGIN CERTIFICATE-----\nSYS\n-----END CERTIFICATE-----\n";

    #[test]
    fn appends_once_and_replaces_its_own_block() {
        let once = edit_bundle(SYS, "agent-sandbox", A);
        assert!(once.starts_with(SYS) && once.contains(A));
        // A restored guest already has it: the same text, nothing to write.
        assert_eq!(edit_bundle(&once, "agent-sandbox", A), once);
        assert_eq!(once.matches(A).count(), 1);
        // Another bundle for the same label replaces the block.
        let changed = edit_bundle(&once, "agent-sandbox", B);
        assert!(changed.contains(B) && !changed.contains(A));
        // Another label is its own block beside it.
        let two = edit_bundle(&once, "proxy", B);
        assert!(two.contains(A) && two.contains(B));
        assert_eq!(edit_bundle(&two, "agent-sandbox", A), two);
        assert_eq!(edit_bundle(&two, "proxy", B), two);
        // A second copy of a block (a guest's doing) is dropped.
        let doubled = format!(
            "{once}{}{A}{}",
            begin_line("agent-sandbox"),
            end_line("agent-sandbox")
        );
        assert_eq!(edit_bundle(&doubled, "agent-sandbox", A), once);
    }

    #[test]
    fn certificates_already_in_the_bundle_are_not_added() {
        // What update-ca-certificates leaves: our .crt folded in, no block.
        let folded = format!("{SYS}{A}");
        assert_eq!(edit_bundle(&folded, "agent-sandbox", A), folded);
        // No bundle at all (an image without ca-certificates).
        let fresh = edit_bundle("", "agent-sandbox", A);
        assert!(fresh.starts_with("# agent-sandbox") && fresh.contains(A));
        // A bundle without a final newline still gets whole lines.
        let e = edit_bundle(SYS.trim_end(), "x", A);
        assert!(e.contains("-----END CERTIFICATE-----\n# agent-sandbox"));
        // A cut-short block is dropped and written whole again.
        let cut = format!("{SYS}{}{A}", begin_line("x"));
        let fixed = edit_bundle(&cut, "x", A);
        assert_eq!(fixed.matches(A).count(), 1);
        assert!(fixed.ends_with(&end_line("x")));
    }

    #[test]
    fn env_names_the_bundle_and_labels_are_checked() {
        let e = guest_env();
        assert_eq!(e.len(), ENV_VARS.len());
        assert!(e.values().all(|v| v == BUNDLE));
        assert!(valid_label(CONFIG_LABEL));
        assert!(!valid_label("../x") && !valid_label("") && !valid_label("A"));
    }
}
