//! Checking a file set's chain (`agent-sandbox audit verify`).

use super::chain;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// What a good chain holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub records: u64,
    pub first_seq: u64,
    pub last_seq: u64,
    /// The last record's hash (the head).
    pub head: String,
}

/// Where and why a chain is broken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    pub file: PathBuf,
    /// 1-based line number in `file`.
    pub line: u64,
    /// The record's `seq` when it could be read.
    pub seq: Option<u64>,
    pub why: String,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)?;
        if let Some(s) = self.seq {
            write!(f, " (seq {s})")?;
        }
        write!(f, ": {}", self.why)
    }
}

/// Verifies `files` as one chain, in the order given (rotated files
/// oldest first, then the current one). The first record may continue an
/// older chain (its `prev` is not checked against GENESIS unless its seq
/// is 1). `head`: a hash the chain must contain (the head the daemon
/// reported), which is what shows a cut-off tail.
pub fn verify(files: &[PathBuf], head: Option<&str>) -> Result<Summary, Broken> {
    let mut prev: Option<(u64, String)> = None;
    let mut first = None;
    let mut records = 0u64;
    let mut seen_head = head.is_none();
    for f in files {
        check_file(f, &mut prev, &mut first, &mut records, head, &mut seen_head)?;
    }
    let Some((last_seq, last)) = prev else {
        return Err(Broken {
            file: files.last().cloned().unwrap_or_default(),
            line: 0,
            seq: None,
            why: "no records".into(),
        });
    };
    if !seen_head {
        return Err(Broken {
            file: files.last().cloned().unwrap_or_default(),
            line: records,
            seq: Some(last_seq),
            why: format!(
                "the head hash {} is not in the chain (ends at seq {last_seq}, {last}): records \
                 are missing at the end",
                head.unwrap_or("")
            ),
        });
    }
    Ok(Summary {
        records,
        first_seq: first.unwrap_or(0),
        last_seq,
        head: last,
    })
}

fn check_file(
    f: &Path,
    prev: &mut Option<(u64, String)>,
    first: &mut Option<u64>,
    records: &mut u64,
    head: Option<&str>,
    seen_head: &mut bool,
) -> Result<(), Broken> {
    let broken = |line: u64, seq: Option<u64>, why: String| Broken {
        file: f.to_path_buf(),
        line,
        seq,
        why,
    };
    let file = std::fs::File::open(f).map_err(|e| broken(0, None, format!("open: {e}")))?;
    let mut r = std::io::BufReader::new(file);
    let mut n = 0u64;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let got = r
            .read_until(b'\n', &mut buf)
            .map_err(|e| broken(n + 1, None, format!("read: {e}")))?;
        if got == 0 {
            return Ok(());
        }
        n += 1;
        if buf.last() != Some(&b'\n') {
            return Err(broken(
                n,
                None,
                "last line has no newline (cut short?)".into(),
            ));
        }
        buf.pop();
        let line = std::str::from_utf8(&buf).map_err(|_| broken(n, None, "not UTF-8".into()))?;
        let v: Value =
            serde_json::from_str(line).map_err(|e| broken(n, None, format!("bad JSON: {e}")))?;
        let seq = v.get("seq").and_then(Value::as_u64);
        let Some((body, hash)) = chain::split(line) else {
            return Err(broken(
                n,
                seq,
                "no hash member at the end of the line".into(),
            ));
        };
        let Some(seq) = seq else {
            return Err(broken(n, None, "no seq".into()));
        };
        let claimed_prev = v
            .get("prev")
            .and_then(Value::as_str)
            .ok_or_else(|| broken(n, Some(seq), "no prev".into()))?;
        match prev.as_ref() {
            Some((ps, ph)) => {
                if seq != ps + 1 {
                    return Err(broken(n, Some(seq), format!("seq gap: {seq} follows {ps}")));
                }
                if claimed_prev != ph {
                    return Err(broken(
                        n,
                        Some(seq),
                        format!("prev mismatch: {claimed_prev} is not the previous hash {ph}"),
                    ));
                }
            }
            None if seq == 1 && claimed_prev != chain::GENESIS => {
                return Err(broken(
                    n,
                    Some(seq),
                    "seq 1 without the genesis prev".into(),
                ));
            }
            None => {}
        }
        let want = chain::hash_of(claimed_prev, body.as_bytes());
        if want != hash {
            return Err(broken(
                n,
                Some(seq),
                format!("hash mismatch: the record hashes to {want}, it says {hash}"),
            ));
        }
        if head == Some(hash) {
            *seen_head = true;
        }
        first.get_or_insert(seq);
        *records += 1;
        *prev = Some((seq, hash.to_string()));
    }
}
