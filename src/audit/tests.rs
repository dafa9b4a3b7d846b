use super::*;
use serde_json::json;
use std::sync::atomic::Ordering;

fn settings() -> Settings {
    Settings {
        rotate_bytes: 4096,
        ..Settings::default()
    }
}

fn lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn records_chain_and_verify_across_rotation() {
    let d = tempfile::tempdir().unwrap();
    let log = Log::start(&settings(), d.path().to_path_buf(), None).unwrap();
    for i in 0..200 {
        log.record(
            "k1",
            "s1",
            "api",
            json!({"route": "/x", "i": i, "seq": "not mine"}),
        );
    }
    assert!(log.flush(Duration::from_secs(5)));
    let files = log.files("k1", "s1");
    assert!(files.len() > 2, "rotated: {files:?}");
    let sum = verify::verify(&files, None).unwrap();
    assert_eq!((sum.records, sum.first_seq, sum.last_seq), (200, 1, 200));
    assert_eq!(log.head("k1", "s1"), Some((200, sum.head.clone())));
    let first = &lines(&files[0])[0];
    assert_eq!(first["seq"], 1);
    assert_eq!(first["prev"], GENESIS);
    assert_eq!(first["kind"], "api");
    assert_eq!(first["session"], "s1");
    assert_eq!(first["i"], 0);
    // A restarted writer continues the chain.
    log.stop();
    let log = Log::start(&settings(), d.path().to_path_buf(), None).unwrap();
    log.record("k1", "s1", "api", json!({}));
    assert!(log.flush(Duration::from_secs(5)));
    let sum = verify::verify(&log.files("k1", "s1"), None).unwrap();
    assert_eq!(sum.last_seq, 201);
    // The head catches a cut tail.
    let files = log.files("k1", "s1");
    let cur = files.last().unwrap();
    let text = std::fs::read_to_string(cur).unwrap();
    let cut: Vec<&str> = text.lines().collect();
    std::fs::write(cur, format!("{}\n", cut[..cut.len() - 1].join("\n"))).unwrap();
    assert!(verify::verify(&files, None).is_ok());
    let e = verify::verify(&files, Some(&sum.head)).unwrap_err();
    assert!(e.why.contains("head"), "{e}");
}

#[test]
fn tampering_fails_verification() {
    let d = tempfile::tempdir().unwrap();
    let log = Log::start(&Settings::default(), d.path().to_path_buf(), None).unwrap();
    for i in 0..10 {
        log.record("k", "s", "exec", json!({"argv": ["echo", i]}));
    }
    assert!(log.flush(Duration::from_secs(5)));
    let f = log.files("k", "s").pop().unwrap();
    let good = std::fs::read(&f).unwrap();
    let check = |bytes: &[u8]| {
        let p = d.path().join("t.jsonl");
        std::fs::write(&p, bytes).unwrap();
        verify::verify(&[p], None)
    };
    assert!(check(&good).is_ok());
    // One byte, anywhere in a record.
    for at in [3, good.len() / 2, good.len() - 5] {
        let mut b = good.clone();
        b[at] ^= 0x01;
        assert!(check(&b).is_err(), "byte {at}");
    }
    let text = String::from_utf8(good).unwrap();
    let ls: Vec<&str> = text.lines().collect();
    let removed = [&ls[..4], &ls[5..]].concat().join("\n") + "\n";
    let e = check(removed.as_bytes()).unwrap_err();
    assert_eq!(e.seq, Some(6), "{e}");
    let mut swapped = ls.clone();
    swapped.swap(2, 3);
    assert!(check((swapped.join("\n") + "\n").as_bytes()).is_err());
}

#[test]
fn a_flood_is_rate_limited_and_summarised() {
    let d = tempfile::tempdir().unwrap();
    let s = Settings {
        rate_per_sec: 50.0,
        rate_burst: 100.0,
        // Room for the whole flood: this test is about the rate limit
        // (queue drops would be counted in `dropped` records).
        queue: 65536,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().to_path_buf(), None).unwrap();
    for i in 0..20_000 {
        log.record(
            "k",
            "s",
            "proc",
            json!({"pid": i, "argv": ["sh", "-c", "fork"]}),
        );
    }
    log.record("k", "s", "exec", json!({"argv": ["after"]}));
    assert!(log.flush(Duration::from_secs(10)));
    let files = log.files("k", "s");
    let recs: Vec<Value> = files.iter().flat_map(|f| lines(f)).collect();
    let procs = recs.iter().filter(|r| r["kind"] == "proc").count();
    assert!(procs <= 200, "{procs} proc records kept");
    let suppressed: u64 = recs
        .iter()
        .filter(|r| r["kind"] == "summary")
        .map(|r| r["suppressed"]["proc"].as_u64().unwrap_or(0))
        .sum();
    let dropped: u64 = recs
        .iter()
        .filter(|r| r["kind"] == "dropped")
        .map(|r| r["dropped"].as_u64().unwrap_or(0))
        .sum();
    // Every record is either written, summarised or counted as dropped.
    assert_eq!(procs as u64 + suppressed + dropped, 20_000);
    assert!(suppressed > 0);
    assert!(
        recs.iter().any(|r| r["kind"] == "exec"),
        "others still pass"
    );
    assert!(verify::verify(&files, None).is_ok());
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .sum();
    assert!(bytes < 200_000, "{bytes} bytes");
}

#[test]
fn the_cap_ends_a_file_set_with_truncated() {
    let d = tempfile::tempdir().unwrap();
    let s = Settings {
        max_session_bytes: 65536,
        rotate_bytes: 16384,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().to_path_buf(), None).unwrap();
    for i in 0..2000 {
        log.record("k", "s", "api", json!({"i": i, "pad": "x".repeat(100)}));
    }
    assert!(log.flush(Duration::from_secs(10)));
    let files = log.files("k", "s");
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len())
        .sum();
    assert!(bytes <= 65536, "{bytes}");
    let recs: Vec<Value> = files.iter().flat_map(|f| lines(f)).collect();
    assert_eq!(recs.last().unwrap()["kind"], "truncated");
    assert_eq!(recs.iter().filter(|r| r["kind"] == "truncated").count(), 1);
    assert!(verify::verify(&files, None).is_ok());
}

#[test]
fn owners_never_share_or_escape_a_directory() {
    assert_eq!(owner_dir("key_1"), "key_1");
    assert!(owner_dir("../x").starts_with("h-"));
    assert_ne!(owner_dir("a/b"), owner_dir("a_b"));
    let log = Log::disabled();
    log.record("k", "s", "api", json!({}));
    assert!(!log.flush(Duration::from_millis(1)));
}

#[test]
fn a_full_queue_drops_counts_and_says_so_in_the_file() {
    let d = tempfile::tempdir().unwrap();
    let s = Settings {
        queue: 1,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().to_path_buf(), None).unwrap();
    for i in 0..5000 {
        log.record("k", "s", "api", json!({"i": i}));
    }
    assert!(log.flush(Duration::from_secs(10)));
    let files = log.files("k", "s");
    let recs: Vec<Value> = files.iter().flat_map(|f| lines(f)).collect();
    let written = recs.iter().filter(|r| r["kind"] == "api").count() as u64;
    let dropped: u64 = recs
        .iter()
        .filter(|r| r["kind"] == "dropped" && r["reason"] == "queue_full")
        .map(|r| r["dropped"].as_u64().unwrap())
        .sum();
    let counted = log
        .counters()
        .unwrap()
        .queue_dropped
        .load(Ordering::Relaxed);
    assert_eq!(written + dropped, 5000, "every record written or counted");
    assert_eq!(dropped, counted);
    assert!(verify::verify(&files, None).is_ok());
}

#[test]
fn syslog_gets_each_record_as_an_rfc5424_datagram() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("log.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let s = Settings {
        syslog: true,
        syslog_socket: sock,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().join("a"), None).unwrap();
    log.record("k", "s", "exec", json!({"argv": ["true"]}));
    assert!(log.flush(Duration::from_secs(5)));
    let mut buf = vec![0u8; 65536];
    let n = rx.recv(&mut buf).unwrap();
    let msg = std::str::from_utf8(&buf[..n]).unwrap();
    let line = msg
        .strip_prefix("<110>1 - - agent-sandbox - audit - ")
        .expect(msg);
    let file = std::fs::read_to_string(log.files("k", "s").pop().unwrap()).unwrap();
    assert_eq!(format!("{line}\n"), file, "the very line, hash and all");
}

#[test]
fn retention_removes_old_files_then_the_oldest_over_the_size() {
    let d = tempfile::tempdir().unwrap();
    let own = d.path().join("k");
    std::fs::create_dir_all(&own).unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(3 * 24 * 3600);
    let mk = |name: &str, age: Duration, size: usize| {
        let p = own.join(name);
        std::fs::write(&p, vec![b'x'; size]).unwrap();
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_modified(std::time::SystemTime::now() - age).unwrap();
        p
    };
    let ancient = own.join("a.jsonl");
    std::fs::write(&ancient, b"x").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&ancient)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let older = mk("b.1.jsonl", Duration::from_secs(3600), 6000);
    let newer = mk("b.jsonl", Duration::from_secs(60), 6000);
    let s = Settings {
        retention_secs: 24 * 3600,
        retention_bytes: 10_000,
        ..Settings::default()
    };
    let log = Log::start(&s, d.path().to_path_buf(), None).unwrap();
    assert!(log.flush(Duration::from_secs(5)));
    assert!(!ancient.exists(), "past the age");
    assert!(!older.exists(), "the oldest, over the size");
    assert!(newer.exists());
}
