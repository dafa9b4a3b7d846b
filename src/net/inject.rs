//! Credential injection at the egress proxy (issue #25).
//!
//! A session's secrets `{name, value, hosts, header, format}` never enter
//! its guest: every command sees `NAME=<placeholder>` (an unguessable
//! token), and the guest's TLS to one of a secret's `hosts` is terminated
//! by the session's proxy ([`super::proxy`]) with a certificate of the
//! session's own CA (made here, its key never leaves the daemon; its
//! certificate is installed in the guest's trust store). There the proxy
//! reads the request head, puts the value in place of the placeholder in
//! the secret's `header` (as `format` says), and sends the request on over
//! a new TLS connection to the real host, verified against the host's CA
//! bundle. A placeholder in a request to a host it is not bound to is
//! refused, never forwarded. Hosts no secret names are never intercepted.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};

use super::policy::DomainPattern;
use crate::sync::lock;

/// Secrets per session, at most.
pub const MAX_SECRETS: usize = 16;
/// A value's size in bytes, at most (it goes into a request header).
pub const MAX_VALUE_BYTES: usize = 8 << 10;
/// ... and in characters, at least (shorter ones could not be masked).
pub const MIN_VALUE_CHARS: usize = 4;
/// Hosts per secret, at most.
pub const MAX_HOSTS: usize = 16;
/// A `format`'s length, at most.
pub const MAX_FORMAT: usize = 256;
/// The header a secret goes into unless it names another.
pub const DEFAULT_HEADER: &str = "Authorization";
/// What a placeholder starts with (then 32 random hex digits).
pub const PLACEHOLDER_PREFIX: &str = "asbx-secret-";
/// Leaf certificates kept per session (one per host name intercepted; a
/// wildcard host could otherwise make the guest grow the cache).
const MAX_LEAVES: usize = 256;

/// A secret as a client gives it (`POST /v1/sessions {secrets: [...]}`,
/// `PUT /v1/sessions/:id/secrets`).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The guest's environment variable holding the placeholder.
    pub name: String,
    pub value: String,
    /// Where the value may go: names (`api.example.com`) or wildcards
    /// (`*.example.com`), as the egress policy's `domains`.
    pub hosts: Vec<DomainPattern>,
    /// The request header it goes into (default `Authorization`).
    #[serde(default)]
    pub header: Option<String>,
    /// The header's value, `{value}` standing for the secret
    /// (`Bearer {value}`); absent: the placeholder in the header is
    /// replaced by the value and the rest of the header kept.
    #[serde(default)]
    pub format: Option<String>,
}

impl std::fmt::Debug for SecretSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSpec")
            .field("name", &self.name)
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .field("format", &self.format)
            .finish()
    }
}

/// What any GET shows of a secret: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<DomainPattern>,
    pub header: String,
    pub format: Option<String>,
    pub placeholder: String,
}

fn header_token(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 64
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
}

/// Headers that frame or route the request: a secret there could smuggle
/// a second request or redirect the first.
const FORBIDDEN_HEADERS: [&str; 8] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
];

fn printable(s: &str) -> bool {
    !s.chars().any(|c| c.is_control())
}

/// Checks a session's secrets; errors name the secret, never its value.
pub fn validate(specs: &[SecretSpec]) -> Result<(), String> {
    if specs.len() > MAX_SECRETS {
        return Err(format!(
            "too many secrets: {}, at most {MAX_SECRETS}",
            specs.len()
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    for s in specs {
        let n = &s.name;
        let ok = !n.is_empty()
            && n.len() <= 64
            && !n.as_bytes()[0].is_ascii_digit()
            && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(format!(
                "secret name {:?} is invalid: an environment variable name \
                 (A-Z a-z 0-9 _, not starting with a digit, at most 64)",
                n.chars().take(80).collect::<String>()
            ));
        }
        if !names.insert(n.as_str()) {
            return Err(format!("secret {n:?} is given twice"));
        }
        let chars = s.value.chars().count();
        if chars < MIN_VALUE_CHARS || s.value.len() > MAX_VALUE_BYTES {
            return Err(format!(
                "secret {n:?}: a value takes at least {MIN_VALUE_CHARS} characters and \
                 at most {MAX_VALUE_BYTES} bytes (this one: {chars} characters, {} bytes)",
                s.value.len()
            ));
        }
        if !printable(&s.value) {
            return Err(format!(
                "secret {n:?}: the value contains a control character (it goes into a header)"
            ));
        }
        if s.value.contains(PLACEHOLDER_PREFIX) {
            return Err(format!(
                "secret {n:?}: the value contains {PLACEHOLDER_PREFIX:?}"
            ));
        }
        if s.hosts.is_empty() || s.hosts.len() > MAX_HOSTS {
            return Err(format!(
                "secret {n:?}: hosts takes 1 to {MAX_HOSTS} names, not {}",
                s.hosts.len()
            ));
        }
        let h = s.header.as_deref().unwrap_or(DEFAULT_HEADER);
        if !header_token(h) || FORBIDDEN_HEADERS.contains(&h.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "secret {n:?}: header {:?} is not a header a secret may go into \
                 (A-Z a-z 0-9 - _, at most 64; not Host, Content-Length, \
                 Transfer-Encoding, Connection, Upgrade ...)",
                h.chars().take(80).collect::<String>()
            ));
        }
        if let Some(f) = &s.format {
            if f.len() > MAX_FORMAT || !printable(f) || f.matches("{value}").count() != 1 {
                return Err(format!(
                    "secret {n:?}: format takes {{value}} once, no control character, \
                     at most {MAX_FORMAT} bytes"
                ));
            }
        }
    }
    Ok(())
}

/// One secret with its placeholder.
struct Bound {
    spec: SecretSpec,
    placeholder: String,
}

impl Bound {
    fn header(&self) -> &str {
        self.spec.header.as_deref().unwrap_or(DEFAULT_HEADER)
    }

    fn binds(&self, host: &str) -> bool {
        self.spec.hosts.iter().any(|p| p.matches(host))
    }
}

/// A session's interception CA: made at the session's start, kept for its
/// life (the guest trusts it), never written anywhere.
pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pem: String,
    /// A TLS server config per host name intercepted so far.
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl Ca {
    pub fn new(session: &str) -> Result<Ca, String> {
        let err = |e: rcgen::Error| format!("session {session}: make the interception CA: {e}");
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "agent-sandbox");
        dn.push(
            DnType::CommonName,
            format!("agent-sandbox egress proxy, session {session}"),
        );
        p.distinguished_name = dn;
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = time_now();
        p.not_before = now - std::time::Duration::from_secs(3600);
        p.not_after = now + std::time::Duration::from_secs(400 * 86_400);
        let key = KeyPair::generate().map_err(err)?;
        let issuer = CertifiedIssuer::self_signed(p, key).map_err(err)?;
        let pem = issuer.pem();
        Ok(Ca {
            issuer,
            pem,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate (PEM) the guest trusts.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The TLS config presenting a certificate for `host`, signed by this CA.
    pub(super) fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        if let Some(c) = lock(&self.leaves).get(host) {
            return Ok(c.clone());
        }
        let err = |e: String| format!("a certificate for {host}: {e}");
        let mut p =
            CertificateParams::new(vec![host.to_string()]).map_err(|e| err(e.to_string()))?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, host);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let now = time_now();
        p.not_before = now - std::time::Duration::from_secs(3600);
        p.not_after = now + std::time::Duration::from_secs(30 * 86_400);
        let key = KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(|e| err(e.to_string()))?;
        let chain = vec![cert.der().clone(), self.issuer.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| err(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| err(e.to_string()))?;
        // One request per connection, read as HTTP/1.1: a client that
        // would speak h2 is told it may not.
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        let mut l = lock(&self.leaves);
        if l.len() >= MAX_LEAVES {
            l.clear();
        }
        l.insert(host.to_string(), cfg.clone());
        Ok(cfg)
    }
}

fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

/// The one crypto provider the daemon's TLS uses.
pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS client config the proxy re-originates with: the roots of
/// `bundle` (a PEM file; the host's CA bundle unless configured).
pub fn upstream_tls(bundle: &std::path::Path) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    let shown = bundle.display();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(bundle)
        .map_err(|e| format!("proxy_upstream_ca {shown}: {e}"))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("proxy_upstream_ca {shown}: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "proxy_upstream_ca {shown}: no usable CA certificate in it"
        ));
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("proxy_upstream_ca: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// What a request head becomes on its way to a host.
#[derive(Debug, PartialEq, Eq)]
pub enum Rewrite {
    /// The head to send, and how many secrets were put in.
    Send(Vec<u8>, usize),
    /// It carries the placeholder of a secret not bound to this host.
    Refuse(String),
}

/// A session's secrets and its CA: what the proxy intercepts for.
pub struct Injection {
    ca: Arc<Ca>,
    secrets: Vec<Bound>,
}

impl std::fmt::Debug for Injection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names and hosts only: a value must not reach a log line.
        f.debug_list().entries(self.info()).finish()
    }
}

fn new_placeholder() -> Result<String, String> {
    let mut b = [0u8; 16];
    crate::harden::random::secure_random(&mut b).map_err(|e| format!("a placeholder: {e}"))?;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{PLACEHOLDER_PREFIX}{hex}"))
}

impl Injection {
    /// `specs` (validated) with `ca`; a secret keeps its placeholder from
    /// `prev` when its name is there (processes already hold it).
    pub fn new(
        ca: Arc<Ca>,
        specs: &[SecretSpec],
        prev: Option<&Injection>,
    ) -> Result<Injection, String> {
        validate(specs)?;
        let mut secrets = Vec::with_capacity(specs.len());
        for s in specs {
            let kept = prev
                .and_then(|p| p.secrets.iter().find(|b| b.spec.name == s.name))
                .map(|b| b.placeholder.clone());
            let placeholder = match kept {
                Some(p) => p,
                None => new_placeholder()?,
            };
            secrets.push(Bound {
                spec: s.clone(),
                placeholder,
            });
        }
        Ok(Injection { ca, secrets })
    }

    /// The same secrets and placeholders under another CA (a fork: the
    /// copy's guest holds the placeholders, not the source's key).
    pub fn rebind(&self, ca: Arc<Ca>) -> Injection {
        Injection {
            ca,
            secrets: self
                .secrets
                .iter()
                .map(|b| Bound {
                    spec: b.spec.clone(),
                    placeholder: b.placeholder.clone(),
                })
                .collect(),
        }
    }

    pub fn ca(&self) -> &Arc<Ca> {
        &self.ca
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// The specs (with values), for a live change or a fork.
    pub fn specs(&self) -> Vec<SecretSpec> {
        self.secrets.iter().map(|b| b.spec.clone()).collect()
    }

    /// `NAME=placeholder` for every command of the session.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.secrets
            .iter()
            .map(|b| (b.spec.name.clone(), b.placeholder.clone()))
            .collect()
    }

    /// The values, for output masking.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.secrets.iter().map(|b| b.spec.value.as_str())
    }

    pub fn info(&self) -> Vec<SecretInfo> {
        self.secrets
            .iter()
            .map(|b| SecretInfo {
                name: b.spec.name.clone(),
                hosts: b.spec.hosts.clone(),
                header: b.header().to_string(),
                format: b.spec.format.clone(),
                placeholder: b.placeholder.clone(),
            })
            .collect()
    }

    /// Whether the proxy terminates TLS to `host` (some secret names it).
    pub fn binds(&self, host: &str) -> bool {
        self.secrets.iter().any(|b| b.binds(host))
    }

    /// Whether `bytes` hold any placeholder.
    pub fn carries_placeholder(&self, bytes: &[u8]) -> bool {
        self.secrets
            .iter()
            .any(|b| contains(bytes, b.placeholder.as_bytes()))
    }

    /// The request `head` (through its blank line) as it goes to `host`:
    /// each secret bound to `host` in place of its placeholder in its
    /// header; refused when a placeholder of a secret not bound to `host`
    /// is anywhere in it.
    pub fn rewrite(&self, host: &str, head: &[u8]) -> Rewrite {
        for b in &self.secrets {
            if !b.binds(host) && contains(head, b.placeholder.as_bytes()) {
                return Rewrite::Refuse(b.spec.name.clone());
            }
        }
        let text = String::from_utf8_lossy(head);
        let mut out = String::with_capacity(head.len() + 64);
        let mut put = 0;
        for (i, line) in text.split("\r\n").enumerate() {
            if line.is_empty() {
                continue;
            }
            let mut line = line.to_string();
            if i > 0 {
                if let Some((k, v)) = line.split_once(':') {
                    let k = k.trim();
                    for b in self.secrets.iter().filter(|b| b.binds(host)) {
                        if k.eq_ignore_ascii_case(b.header()) && v.contains(&b.placeholder) {
                            let nv = match &b.spec.format {
                                Some(f) => f.replace("{value}", &b.spec.value),
                                None => v.trim().replace(&b.placeholder, &b.spec.value),
                            };
                            line = format!("{k}: {nv}");
                            put += 1;
                            break;
                        }
                    }
                }
            }
            out.push_str(&line);
            out.push_str("\r\n");
        }
        out.push_str("\r\n");
        Rewrite::Send(out.into_bytes(), put)
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// A session's secrets as the network layer holds them.
pub type Shared = Arc<Injection>;

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, value: &str, hosts: &[&str]) -> SecretSpec {
        SecretSpec {
            name: name.into(),
            value: value.into(),
            hosts: hosts.iter().map(|h| h.parse().unwrap()).collect(),
            header: None,
            format: None,
        }
    }

    #[test]
    fn validation_bounds_and_redaction() {
        assert!(validate(&[spec("API_KEY", "sk-live-1234", &["api.test"])]).is_ok());
        let cases: Vec<(SecretSpec, &str)> = vec![
            (spec("1X", "abcd", &["a.test"]), "secret name"),
            (spec("A-B", "abcd", &["a.test"]), "secret name"),
            (spec("K", "abc", &["a.test"]), "at least 4"),
            (spec("K", "ab\r\ncd", &["a.test"]), "control character"),
            (spec("K", "abcd", &[]), "hosts takes"),
            (
                SecretSpec {
                    header: Some("Host".into()),
                    ..spec("K", "abcd-efgh", &["a.test"])
                },
                "header",
            ),
            (
                SecretSpec {
                    format: Some("Bearer".into()),
                    ..spec("K", "abcd-efgh", &["a.test"])
                },
                "format",
            ),
        ];
        for (s, want) in cases {
            let e = validate(std::slice::from_ref(&s)).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains(&s.value) || s.value.len() < 4, "{e}");
        }
        let two = [spec("K", "abcd", &["a"]), spec("K", "efgh", &["b"])];
        assert!(validate(&two).unwrap_err().contains("twice"));
        assert!(!format!("{:?}", spec("K", "hidden-1", &["a"])).contains("hidden-1"));
    }

    #[test]
    fn rewrite_puts_values_only_where_bound() {
        let ca = Arc::new(Ca::new("t").unwrap());
        let mut s = spec("KEY", "real-value-42", &["api.test"]);
        s.format = Some("Bearer {value}".into());
        let other = spec("OTHER", "other-value-7", &["other.test"]);
        let inj = Injection::new(ca.clone(), &[s, other], None).unwrap();
        let env = inj.env();
        let (p, q) = (&env["KEY"], &env["OTHER"]);
        assert!(p.starts_with(PLACEHOLDER_PREFIX) && p.len() == PLACEHOLDER_PREFIX.len() + 32);
        assert_ne!(p, q);
        let head = format!("GET / HTTP/1.1\r\nHost: api.test\r\nauthorization: Bearer {p}\r\n\r\n");
        let Rewrite::Send(out, 1) = inj.rewrite("api.test", head.as_bytes()) else {
            panic!("not rewritten")
        };
        let out = String::from_utf8(out).unwrap();
        assert!(
            out.contains("\r\nauthorization: Bearer real-value-42\r\n"),
            "{out}"
        );
        assert!(!out.contains(p.as_str()));
        // Another secret's placeholder to api.test: refused.
        let head = format!("GET / HTTP/1.1\r\nHost: api.test\r\nX-Other: {q}\r\n\r\n");
        assert_eq!(
            inj.rewrite("api.test", head.as_bytes()),
            Rewrite::Refuse("OTHER".into())
        );
        // Its own placeholder to a host it is not bound to: refused.
        let head = format!("GET /?k={p} HTTP/1.1\r\nHost: other.test\r\n\r\n");
        assert_eq!(
            inj.rewrite("other.test", head.as_bytes()),
            Rewrite::Refuse("KEY".into())
        );
        assert!(inj.binds("api.test") && !inj.binds("evil.test"));
        // A live change keeps the placeholder of a name still there.
        let again =
            Injection::new(ca, &[spec("KEY", "new-value-1", &["api.test"])], Some(&inj)).unwrap();
        assert_eq!(again.env()["KEY"], *p);
        // Without format: the placeholder in the header is replaced.
        let plain = Injection::new(
            Arc::new(Ca::new("u").unwrap()),
            &[spec("K", "vvvv-1", &["*.api.test"])],
            None,
        )
        .unwrap();
        let ph = &plain.env()["K"];
        let head =
            format!("GET / HTTP/1.1\r\nHost: x.api.test\r\nAuthorization: token {ph}\r\n\r\n");
        let Rewrite::Send(out, 1) = plain.rewrite("x.api.test", head.as_bytes()) else {
            panic!()
        };
        assert!(String::from_utf8(out)
            .unwrap()
            .contains("Authorization: token vvvv-1\r\n"));
    }

    #[test]
    fn the_ca_signs_a_leaf_per_host() {
        let ca = Ca::new("s-1").unwrap();
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca.server_config("api.test").unwrap();
        let b = ca.server_config("api.test").unwrap();
        assert!(Arc::ptr_eq(&a, &b), "cached");
    }
}
