//! `guest_ca_bundle`: extra certificate authorities every guest trusts
//! (issue #25), for hosts behind a TLS-inspecting proxy. Read and checked
//! once at daemon start; what the guests get is only the CERTIFICATE
//! blocks of the file, re-encoded, so a bundle that happens to hold a
//! private key (or anything else) never hands it to a guest.

use base64::Engine;
use std::path::{Path, PathBuf};

/// The value of `guest_ca_bundle` (and `--guest-ca-bundle`) that means
/// "the host's own trust store".
pub const HOST: &str = "host";

/// The host bundle [`HOST`] stands for: Debian/Ubuntu's (and NixOS's
/// compatibility link) of `update-ca-certificates`.
pub const HOST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Largest bundle file read (the host's whole store is ~220 KiB).
pub const MAX_BUNDLE_BYTES: u64 = 1 << 20;

const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const END: &str = "-----END CERTIFICATE-----";

/// A checked bundle: the certificates of the file, as PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestCas {
    /// The file they came from (`host` resolved).
    pub path: PathBuf,
    /// One normalized PEM block per certificate (64-column base64, `\n`).
    pub certs: Vec<String>,
}

impl GuestCas {
    /// All certificates as one PEM text, each block ending in `\n`.
    pub fn pem(&self) -> String {
        self.certs.concat()
    }
}

/// The file `value` names: [`HOST`] is [`HOST_BUNDLE`].
pub fn resolve(value: &Path) -> PathBuf {
    if value == Path::new(HOST) {
        PathBuf::from(HOST_BUNDLE)
    } else {
        value.to_path_buf()
    }
}

/// Reads and checks the bundle `value` names (readable, at most
/// [`MAX_BUNDLE_BYTES`], at least one certificate); errors name the file
/// and the key.
pub fn load(value: &Path) -> Result<GuestCas, String> {
    let path = resolve(value);
    let shown = if value == Path::new(HOST) {
        format!("{} ({HOST})", path.display())
    } else {
        path.display().to_string()
    };
    let err = |why: String| format!("guest_ca_bundle {shown}: {why}");
    let meta = std::fs::metadata(&path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    if meta.len() > MAX_BUNDLE_BYTES {
        return Err(err(format!(
            "{} bytes, more than the {MAX_BUNDLE_BYTES} a CA bundle may have",
            meta.len()
        )));
    }
    let bytes = std::fs::read(&path).map_err(|e| err(e.to_string()))?;
    // Checked again on what was read: the file may have grown meanwhile.
    if bytes.len() as u64 > MAX_BUNDLE_BYTES {
        return Err(err(format!("more than {MAX_BUNDLE_BYTES} bytes")));
    }
    let certs = parse(&bytes).map_err(err)?;
    Ok(GuestCas { path, certs })
}

/// The CERTIFICATE blocks of PEM text, normalized. Other blocks (keys,
/// CRLs) and text between blocks are skipped; a CERTIFICATE block that is
/// unterminated or not base64 of a DER SEQUENCE is an error, and so is a
/// text with no certificate at all.
pub fn parse(bytes: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| {
        "not PEM text (not UTF-8): want one or more -----BEGIN CERTIFICATE----- blocks".to_string()
    })?;
    let mut certs = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(BEGIN) {
        let body = &rest[at + BEGIN.len()..];
        let n = certs.len() + 1;
        let end = body
            .find(END)
            .ok_or_else(|| format!("certificate {n}: no {END} line"))?;
        let b64: String = body[..end]
            .chars()
            .filter(|c| !c.is_ascii_whitespace())
            .collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64.as_bytes())
            .map_err(|e| format!("certificate {n}: bad base64: {e}"))?;
        // A certificate is a DER SEQUENCE; anything else is not one.
        if der.len() < 16 || der[0] != 0x30 {
            return Err(format!("certificate {n}: not a DER certificate"));
        }
        certs.push(encode(&der));
        rest = &body[end + END.len()..];
    }
    if certs.is_empty() {
        return Err("no PEM CERTIFICATE block (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certs)
}

/// `der` as a PEM CERTIFICATE block in the layout `openssl x509` writes,
/// so the same certificate always has the same text (what the guest-side
/// "already there?" check compares).
fn encode(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 64);
    out.push_str(BEGIN);
    out.push('\n');
    for line in b64.as_bytes().chunks(64) {
        // base64 output is ASCII, so every chunk is valid UTF-8.
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(END);
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_der(len: usize) -> Vec<u8> {
        let mut d = vec![0x30, 0x82];
        d.extend((0..len).map(|i| i as u8));
        d
    }

    #[test]
    fn parses_and_normalizes_certificate_blocks() {
        let der = fake_der(100);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&der);
        // One long line, CRLF, a key block and junk around it.
        let text = format!(
            "junk\r\n-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n\
             {BEGIN}\r\n{b64}\r\n{END}\r\ntrailer\n{BEGIN}\n{}\n{END}\n",
            &b64
        );
        let certs = parse(text.as_bytes()).unwrap();
        assert_eq!(certs.len(), 2);
        assert_eq!(certs[0], certs[1]);
        assert_eq!(certs[0], encode(&der));
        assert!(certs[0].lines().all(|l| l.len() <= 64));
        assert!(!certs.concat().contains("PRIVATE"));
    }

    #[test]
    fn refuses_what_is_not_a_certificate() {
        assert!(parse(b"hello").unwrap_err().contains("no PEM CERTIFICATE"));
        assert!(parse(&[0xff, 0xfe, 0x00]).unwrap_err().contains("UTF-8"));
        let e = parse(format!("{BEGIN}\nAAAA\n").as_bytes()).unwrap_err();
        assert!(e.contains("no -----END"), "{e}");
        let e = parse(format!("{BEGIN}\n!!!!\n{END}\n").as_bytes()).unwrap_err();
        assert!(e.contains("base64"), "{e}");
        let e = parse(format!("{BEGIN}\nAAAAAAAA\n{END}\n").as_bytes()).unwrap_err();
        assert!(e.contains("not a DER"), "{e}");
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let e = load(&missing).unwrap_err();
        assert!(
            e.starts_with("guest_ca_bundle ") && e.contains("nope.pem"),
            "{e}"
        );
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; MAX_BUNDLE_BYTES as usize + 1]).unwrap();
        assert!(load(&big).unwrap_err().contains("bytes"));
        let e = load(dir.path()).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        assert_eq!(resolve(Path::new(HOST)), PathBuf::from(HOST_BUNDLE));
    }
}
