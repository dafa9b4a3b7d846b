//! Templates from users' images (issue #27), end to end with real VMs: an
//! OCI image this test writes byte by byte (a whiteout, an opaque
//! directory, a hard link, a setuid file, an owner other than root, an
//! xattr, `Env`, `WorkingDir`, `User`), a second image from a Dockerfile
//! whose `FROM` is that archive and which `RUN`s a command (buildah), a
//! third with no shell at all; `agent-sandbox template build` for each,
//! sessions of each through the daemon, then the same through `POST
//! /v1/templates`, and the failures: a failing `RUN` names its line, a
//! corrupt layer names the layer, and neither leaves anything behind.

mod common;
#[path = "common/skip.rs"]
mod skip;
#[path = "common/vm.rs"]
mod vm;

use common::daemon::{stdout_of, Daemon, Http};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A file of a layer.
enum Entry<'a> {
    Dir(&'a str, u32, u32, u32),
    File(&'a str, &'a [u8], u32, u32, u32),
    Link(&'a str, &'a str),
    Hard(&'a str, &'a str),
    /// A file with an xattr (`user.` namespace).
    Xattr(&'a str, &'a [u8], &'a str, &'a str),
}

fn layer(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let head = |path: &str, kind: tar::EntryType, mode: u32, uid: u32, gid: u32, size: u64| {
        let mut h = tar::Header::new_ustar();
        h.set_path(path).expect("path");
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid as u64);
        h.set_gid(gid as u64);
        h.set_size(size);
        h.set_mtime(1_700_000_000);
        h
    };
    for e in entries {
        match e {
            Entry::Dir(p, mode, uid, gid) => {
                let mut h = head(p, tar::EntryType::Directory, *mode, *uid, *gid, 0);
                h.set_cksum();
                b.append(&h, std::io::empty()).expect("dir");
            }
            Entry::File(p, data, mode, uid, gid) => {
                let mut h = head(
                    p,
                    tar::EntryType::Regular,
                    *mode,
                    *uid,
                    *gid,
                    data.len() as u64,
                );
                h.set_cksum();
                b.append(&h, *data).expect("file");
            }
            Entry::Link(p, to) => {
                let mut h = head(p, tar::EntryType::Symlink, 0o777, 0, 0, 0);
                h.set_link_name(to).expect("link");
                h.set_cksum();
                b.append(&h, std::io::empty()).expect("symlink");
            }
            Entry::Hard(p, to) => {
                let mut h = head(p, tar::EntryType::Link, 0o640, 1000, 1000, 0);
                h.set_link_name(to).expect("hard link");
                h.set_cksum();
                b.append(&h, std::io::empty()).expect("hard link");
            }
            Entry::Xattr(p, data, k, v) => {
                let key = format!("SCHILY.xattr.{k}");
                b.append_pax_extensions([(key.as_str(), v.as_bytes())])
                    .expect("pax");
                let mut h = head(p, tar::EntryType::Regular, 0o644, 0, 0, data.len() as u64);
                h.set_cksum();
                b.append(&h, *data).expect("xattr file");
            }
        }
    }
    b.into_inner().expect("tar")
}

fn put(dir: &Path, data: &[u8]) -> (String, usize) {
    let hex = format!("{:x}", Sha256::digest(data));
    std::fs::write(dir.join("blobs/sha256").join(&hex), data).expect("blob");
    (format!("sha256:{hex}"), data.len())
}

/// An OCI layout at `dir` (and its archive `dir.tar`) of `layers` (the
/// first gzip-compressed, the rest plain) with `config`.
fn oci_image(dir: &Path, layers: &[Vec<u8>], config: Value) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("blobs/sha256")).expect("layout dir");
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        diff_ids.push(format!("sha256:{:x}", Sha256::digest(l)));
        let (blob, media) = if i == 0 {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(l).expect("gzip");
            (
                gz.finish().expect("gzip"),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            )
        } else {
            (l.clone(), "application/vnd.oci.image.layer.v1.tar")
        };
        let (d, n) = put(dir, &blob);
        descs.push(json!({"mediaType": media, "digest": d, "size": n}));
    }
    let mut cfg = config;
    cfg["architecture"] = "amd64".into();
    cfg["os"] = "linux".into();
    cfg["rootfs"] = json!({"type": "layers", "diff_ids": diff_ids});
    let (cd, cn) = put(dir, &serde_json::to_vec(&cfg).expect("config"));
    let man = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
        "layers": descs,
    });
    let (md, mn) = put(dir, &serde_json::to_vec(&man).expect("manifest"));
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": md, "size": mn,
            "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))
        .expect("index"),
    )
    .expect("index.json");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("oci-layout");
    let tar = dir.with_extension("tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .expect("tar");
    assert!(st.success(), "tar of the layout");
    tar
}

const BUSYBOX: &str = "/usr/bin/busybox";
const APPLETS: &[&str] = &[
    "sh", "ls", "stat", "cat", "id", "pwd", "echo", "test", "env", "true", "chmod", "chown",
];

/// The first image: busybox, and every case a layer applier must get right.
fn first_image(dir: &Path) -> PathBuf {
    let bb = std::fs::read(BUSYBOX).expect("busybox-static (apt-get install busybox-static)");
    let mut l1 = vec![
        Entry::Dir("bin", 0o755, 0, 0),
        Entry::File("bin/busybox", &bb, 0o755, 0, 0),
    ];
    let links: Vec<String> = APPLETS.iter().map(|a| format!("bin/{a}")).collect();
    for l in &links {
        l1.push(Entry::Link(l, "busybox"));
    }
    l1.extend([
        Entry::Dir("etc", 0o755, 0, 0),
        Entry::File(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
            0o644,
            0,
            0,
        ),
        Entry::File("etc/group", b"root:x:0:\napp:x:1000:\n", 0o644, 0, 0),
        Entry::Dir("data", 0o755, 0, 0),
        Entry::File("data/gone", b"whited out\n", 0o644, 0, 0),
        Entry::File("data/a", b"linked\n", 0o640, 1000, 1000),
        Entry::Hard("data/b", "data/a"),
        Entry::Dir("data/opq", 0o755, 0, 0),
        Entry::File("data/opq/old", b"old\n", 0o644, 0, 0),
        Entry::Dir("usr", 0o755, 0, 0),
        Entry::Dir("usr/local", 0o755, 0, 0),
        Entry::Dir("usr/local/bin", 0o755, 0, 0),
        Entry::File("usr/local/bin/suid", b"#!/bin/sh\nid -u\n", 0o4755, 0, 0),
        Entry::Dir("home", 0o755, 0, 0),
        Entry::Dir("home/app", 0o750, 1000, 1000),
        Entry::Xattr("data/tagged", b"x\n", "user.tag", "blue"),
    ]);
    let l2 = [
        Entry::Dir("data", 0o755, 0, 0),
        Entry::File("data/.wh.gone", b"", 0o644, 0, 0),
        Entry::Dir("data/opq", 0o755, 0, 0),
        Entry::File("data/opq/.wh..wh..opq", b"", 0o644, 0, 0),
        Entry::File("data/opq/new", b"new\n", 0o644, 0, 0),
    ];
    oci_image(
        dir,
        &[layer(&l1), layer(&l2)],
        json!({"config": {
            "Env": ["PATH=/bin:/usr/local/bin", "FOO=bar"],
            "WorkingDir": "/home/app",
            "User": "app",
            "Labels": {
                "template.name": "handmade",
                "template.displayName": "Hand made",
                "template.tools": "sh,ls,cat"
            }
        }}),
    )
}

/// An image with one static program and no shell.
fn shell_less_image(dir: &Path) -> PathBuf {
    let bb = std::fs::read(BUSYBOX).expect("busybox");
    oci_image(
        dir,
        &[layer(&[
            Entry::Dir("opt", 0o755, 0, 0),
            Entry::File("opt/busybox", &bb, 0o755, 0, 0),
        ])],
        json!({"config": {"Env": ["PATH=/opt"]}}),
    )
}

/// A registry on loopback (`docker-registry`, Debian's CNCF distribution).
struct Registry {
    child: std::process::Child,
    addr: String,
}

impl Registry {
    fn start(root: &Path) -> Registry {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = root.join("registry.yml");
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                root.join("registry").display()
            ),
        )
        .expect("registry config");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("docker-registry (apt-get install docker-registry)");
        let up = common::wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(&addr).is_ok()
        });
        assert!(up, "the registry did not listen on {addr}");
        Registry { child, addr }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Setup {
    root: PathBuf,
    cache: PathBuf,
    config: PathBuf,
    agent: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A cache of the test's own (templates built here stay here), with the
/// VM tests' kernel and agent; readable by the VMM's unprivileged uid.
fn setup(env: &vm::VmEnv) -> Setup {
    let root = env
        .work
        .join(format!("template-build-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let cache = root.join("cache");
    std::fs::create_dir_all(&cache).expect("cache dir");
    let agent = skip::target_dir().join("x86_64-unknown-linux-gnu/release/sandbox-agent");
    assert!(
        agent.is_file(),
        "{} (built by the VM environment)",
        agent.display()
    );
    std::fs::write(
        cache.join("current.json"),
        serde_json::to_vec(&json!({"agent": agent, "rootfs": {}})).expect("json"),
    )
    .expect("current.json");
    let config = root.join("config.json");
    std::fs::write(
        &config,
        serde_json::to_vec(&json!({
            "cache_dir": cache,
            "kernel": env.kernel,
            "templates_dir": env.images_dir.join("templates"),
        }))
        .expect("json"),
    )
    .expect("config");
    Setup {
        root,
        cache,
        config,
        agent,
    }
}

/// `agent-sandbox template ARGS --config ...`: (success, stdout, stderr).
fn cli(s: &Setup, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_agent-sandbox"))
        .arg("template")
        .args(args)
        .arg("--config")
        .arg(&s.config)
        .arg("--state-dir")
        .arg(s.root.join("state"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run agent-sandbox template");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn build(s: &Setup, name: &str, how: &[&str]) -> f64 {
    let t0 = Instant::now();
    let agent = s.agent.display().to_string();
    let mut args = vec!["build", name, "--agent", agent.as_str()];
    args.extend_from_slice(how);
    let (ok, out, err) = cli(s, &args);
    assert!(ok, "template build {name}: {out}\n{err}");
    t0.elapsed().as_secs_f64()
}

/// Files of the cache besides what the test put there: nothing of a
/// failed build may be left.
fn cache_files(s: &Setup) -> Vec<String> {
    let mut out = Vec::new();
    for d in ["templates", "rootfs", "build"] {
        for e in std::fs::read_dir(s.cache.join(d))
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if !n.ends_with(".lock") {
                out.push(format!("{d}/{n}"));
            }
        }
    }
    out.sort();
    out
}

fn sh(h: &Http, session: &str, cmd: &str) -> (i64, String) {
    let r = h.post(
        &format!("/v1/sessions/{session}/exec"),
        &json!({"command": cmd, "timeout": 60000}),
    );
    assert_eq!(r.status, 200, "{cmd}: {}", r.text());
    let v = r.json();
    (v["exitCode"].as_i64().unwrap_or(-1), stdout_of(&v))
}

fn session(h: &Http, template: &str) -> String {
    let r = h.post("/v1/sessions", &json!({"template": template}));
    assert_eq!(r.status, 201, "session of {template}: {}", r.text());
    r.json()["id"].as_str().expect("id").to_string()
}

/// Waits for build `id` to end; its last status.
fn wait_build(h: &Http, id: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let r = h.get(&format!("/v1/templates/builds/{id}"));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        if v["status"] != "building" {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "build {id} still running: {v}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn images_and_dockerfiles_become_templates() {
    let Some(env) = vm::env() else { return };
    let _serial = vm::serial();
    for tool in [
        "skopeo",
        "umoci",
        "buildah",
        "runc",
        "mkfs.erofs",
        "docker-registry",
    ] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        if !found {
            skip::skipped(&format!("{tool} is not installed (images/install-deps.sh)"));
            return;
        }
    }
    let s = setup(env);
    let a = first_image(&s.root.join("handmade"));
    let plain = shell_less_image(&s.root.join("plain"));
    let ctx = s.root.join("ctx");
    std::fs::create_dir_all(&ctx).expect("context");
    std::fs::write(ctx.join("motd"), "from the context\n").expect("context file");
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM oci-archive:{}\nUSER root\nRUN echo built > /built && chown app:app /built && chmod 640 /built\nCOPY motd /etc/motd\nENV BAR=baz\nWORKDIR /srv/app\nUSER app\nLABEL template.displayName=\"From a Dockerfile\"\n",
            a.display()
        ),
    )
    .expect("Dockerfile");

    // The CLI: each builds its image and its snapshot.
    let t_a = build(
        &s,
        "handmade",
        &["--from", &format!("oci-archive:{}", a.display())],
    );
    let df = ctx.join("Dockerfile").display().to_string();
    let t_b = build(&s, "fromdf", &["--dockerfile", &df]);
    let t_c = build(
        &s,
        "plain",
        &["--from", &format!("oci-archive:{}", plain.display())],
    );
    // Again: the erofs is reused (cached by the image's digest and agent).
    let (ok, out, err) = cli(
        &s,
        &[
            "build",
            "handmade",
            "--no-snapshot",
            "--from",
            &format!("oci-archive:{}", a.display()),
        ],
    );
    assert!(ok && out.contains("cached"), "{out}\n{err}");
    let mib = |n: &str| {
        std::fs::read_dir(s.cache.join("rootfs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let f = e.file_name().to_string_lossy().into_owned();
                f.starts_with(&format!("{n}-")) && f.ends_with(".erofs")
            })
            .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
            .sum::<u64>() as f64
            / 1048576.0
    };
    eprintln!(
        "FIGURES template build (image + snapshot): handmade {t_a:.1} s {:.1} MiB, fromdf (buildah) {t_b:.1} s {:.1} MiB, plain {t_c:.1} s {:.1} MiB",
        mib("handmade"),
        mib("fromdf"),
        mib("plain")
    );
    // The other transports, from the same image: a `docker save` style
    // archive, and a registry (Debian's docker-registry, the CNCF
    // distribution server, on loopback) pulled over docker://.
    let digest_of = |name: &str| -> String {
        let f = s.cache.join("templates").join(format!("{name}.json"));
        let v: Value =
            serde_json::from_slice(&std::fs::read(&f).expect("template file")).expect("json");
        v["source"]["digest"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let da = s.root.join("docker.tar");
    let st = Command::new("skopeo")
        .args(["copy", "-q"])
        .arg(format!("oci-archive:{}", a.display()))
        .arg(format!("docker-archive:{}:handmade:1", da.display()))
        .status();
    assert!(
        st.map(|s| s.success()).unwrap_or(false),
        "skopeo copy to docker-archive"
    );
    build(
        &s,
        "fromdocker",
        &[
            "--no-snapshot",
            "--from",
            &format!("docker-archive:{}", da.display()),
        ],
    );
    let registry = Registry::start(&s.root);
    let st = Command::new("skopeo")
        .args(["copy", "-q", "--dest-tls-verify=false"])
        .arg(format!("oci-archive:{}", a.display()))
        .arg(format!("docker://{}/handmade:1", registry.addr))
        .status();
    assert!(
        st.map(|s| s.success()).unwrap_or(false),
        "skopeo push to the registry"
    );
    let r = format!("docker://{}/handmade:1", registry.addr);
    build(
        &s,
        "viareg",
        &["--no-snapshot", "--insecure-registry", "--from", &r],
    );
    assert_eq!(
        digest_of("viareg"),
        digest_of("handmade"),
        "the same image by digest"
    );
    drop(registry);
    let (ok, out, _) = cli(&s, &["rm", "viareg"]);
    assert!(
        ok && !s.cache.join("templates/viareg.json").exists(),
        "{out}"
    );

    let (ok, out, _) = cli(&s, &["list"]);
    assert!(
        ok && out.contains("handmade") && out.contains("oci-archive:"),
        "{out}"
    );

    // Failures name the Dockerfile line or the layer, and leave nothing.
    let before = cache_files(&s);
    let bad = s.root.join("bad");
    std::fs::create_dir_all(&bad).expect("bad ctx");
    std::fs::write(
        bad.join("Dockerfile"),
        format!(
            "FROM oci-archive:{}\n\nUSER root\nRUN echo about to fail && false\n",
            a.display()
        ),
    )
    .expect("bad Dockerfile");
    let bad_df = bad.join("Dockerfile").display().to_string();
    let agent = s.agent.display().to_string();
    let (ok, out, err) = cli(
        &s,
        &[
            "build",
            "broken",
            "--agent",
            &agent,
            "--dockerfile",
            &bad_df,
        ],
    );
    assert!(!ok, "a failing RUN fails the build: {out}");
    assert!(
        err.contains("step build")
            && err.contains("Dockerfile line 4")
            && err.contains("RUN echo about to fail"),
        "the failure names the step and line: {err}"
    );
    assert!(
        err.contains("about to fail"),
        "the builder's own output: {err}"
    );
    assert_eq!(cache_files(&s), before, "a failed build leaves nothing");

    let corrupt = s.root.join("corrupt");
    let _ = std::fs::remove_dir_all(&corrupt);
    let st = Command::new("cp")
        .arg("-a")
        .arg(s.root.join("handmade"))
        .arg(&corrupt)
        .status();
    assert!(st.map(|s| s.success()).unwrap_or(false));
    let idx: Value =
        serde_json::from_slice(&std::fs::read(corrupt.join("index.json")).unwrap()).unwrap();
    let man_hex = idx["manifests"][0]["digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let man: Value = serde_json::from_slice(
        &std::fs::read(corrupt.join("blobs/sha256").join(&man_hex)).unwrap(),
    )
    .unwrap();
    let second = man["layers"][1]["digest"].as_str().unwrap().to_string();
    let blob = corrupt
        .join("blobs/sha256")
        .join(second.trim_start_matches("sha256:"));
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[600] ^= 0xff;
    std::fs::write(&blob, bytes).unwrap();
    let from = format!("oci:{}:latest", corrupt.display());
    let (ok, out, err) = cli(
        &s,
        &["build", "corrupt", "--agent", &agent, "--from", &from],
    );
    assert!(!ok, "a corrupt layer fails the build: {out}");
    assert!(
        err.contains(&second[..19]) || err.contains("layer 2 of 2"),
        "the failure names the layer {second}: {err}"
    );
    assert_eq!(cache_files(&s), before, "a failed build leaves nothing");

    // Sessions of each, through the daemon.
    let d = Daemon::start(&["--config", s.config.to_str().unwrap()]);
    let h = d.http();
    let list = h.get("/v1/templates").json();
    let all = list["templates"].as_array().cloned().unwrap_or_default();
    let hm = all
        .iter()
        .find(|t| t["name"] == "handmade")
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(hm["displayName"], "Hand made", "{hm}");
    assert_eq!(hm["tools"], json!(["sh", "ls", "cat"]), "{hm}");
    assert_eq!(hm["builtin"], false, "{hm}");
    assert!(
        hm["source"]["digest"]
            .as_str()
            .unwrap_or("")
            .starts_with("sha256:"),
        "{hm}"
    );
    let fd = all
        .iter()
        .find(|t| t["name"] == "fromdf")
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(fd["displayName"], "From a Dockerfile", "{fd}");

    let t0 = Instant::now();
    let s1 = session(&h, "handmade");
    let (code, out) = sh(&h, &s1, "id -u; id -g; pwd; echo $FOO; echo $HOME");
    let first_exec = t0.elapsed();
    assert_eq!(
        (code, out.as_str()),
        (0, "1000\n1000\n/home/app\nbar\n/home/app\n")
    );
    let (code, out) = sh(
        &h,
        &s1,
        "ls /data; ls /data/opq; stat -c '%u:%g %a %h' /data/a; test $(stat -c %i /data/a) = $(stat -c %i /data/b) && echo same-inode; stat -c '%u %a' /usr/local/bin/suid; cat /data/b",
    );
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out, "a\nb\nopq\ntagged\nnew\n1000:1000 640 2\nsame-inode\n0 4755\nlinked\n",
        "whiteout, opaque dir, owners, modes, hard link, setuid"
    );
    // The agent is at its fixed path; the image's own files are untouched.
    let (code, out) = sh(&h, &s1, "stat -c '%u %a' /sbin/sandbox-agent");
    assert_eq!((code, out.as_str()), (0, "0 755\n"));

    let s2 = session(&h, "fromdf");
    let (code, out) = sh(
        &h,
        &s2,
        "id -u; pwd; echo $FOO $BAR; cat /built; stat -c '%u %a' /built; cat /etc/motd",
    );
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            "1000\n/srv/app\nbar baz\nbuilt\n1000 640\nfrom the context\n"
        )
    );

    let s3 = session(&h, "plain");
    let r = h.post(
        &format!("/v1/sessions/{s3}/exec"),
        &json!({"argv": ["busybox", "echo", "no shell needed"], "timeout": 60000}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(stdout_of(&r.json()), "no shell needed\n", "{}", r.text());
    let r = h.post(
        &format!("/v1/sessions/{s3}/exec"),
        &json!({"command": "echo hi"}),
    );
    assert!(
        r.text().contains("/bin/sh"),
        "a shell command says what is missing: {}",
        r.text()
    );

    // The API: a build from the same archive, its progress, a session,
    // and deletes (refused while used, and for built-in templates).
    let r = h.post(
        "/v1/templates",
        &json!({"name": "apibuilt", "from": format!("oci-archive:{}", a.display()), "displayName": "Via the API"}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    let id = v["buildId"].as_str().expect("buildId").to_string();
    assert_eq!(v["status"], "building", "{v}");
    let names: Vec<&str> = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["fetch", "verify", "unpack", "agent", "erofs", "register", "snapshot"]
    );
    let end = wait_build(&h, &id);
    assert_eq!(end["status"], "ready", "{end}");
    assert!(
        end["steps"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["status"] == "done"),
        "{end}"
    );
    assert!(
        end["logTail"].as_array().is_some_and(|l| !l.is_empty()),
        "{end}"
    );
    let s4 = session(&h, "apibuilt");
    assert_eq!(sh(&h, &s4, "cat /data/opq/new").1, "new\n");
    let r = h.delete("/v1/templates/apibuilt");
    assert_eq!(r.status, 409, "in use: {}", r.text());
    assert_eq!(r.code(), "template_busy");
    assert_eq!(h.delete(&format!("/v1/sessions/{s4}")).status, 200);
    let r = h.delete("/v1/templates/apibuilt");
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = h.get("/v1/templates").text();
    assert!(!listed.contains("apibuilt"), "{listed}");
    assert_eq!(h.delete("/v1/templates/apibuilt").status, 404);
    let r = h.post(
        "/v1/templates",
        &json!({"name": "base", "from": format!("oci-archive:{}", a.display())}),
    );
    assert_eq!(r.status, 409, "a built-in name: {}", r.text());
    let r = h.delete("/v1/templates/base");
    assert_eq!(r.status, 409, "a built-in template: {}", r.text());

    // A broken Dockerfile through the API: failed, with the line and the
    // builder's message; nothing registered.
    let r = h.post(
        "/v1/templates",
        &json!({"name": "apibroken", "dockerfile": format!("FROM oci-archive:{}\nUSER root\nRUN exit 3\n", a.display())}),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let end = wait_build(&h, r.json()["buildId"].as_str().unwrap());
    assert_eq!(end["status"], "failed", "{end}");
    assert_eq!(end["error"]["step"], "build", "{end}");
    assert!(
        end["error"]["at"]
            .as_str()
            .unwrap_or("")
            .contains("Dockerfile line 3"),
        "{end}"
    );
    assert!(!h.get("/v1/templates").text().contains("apibroken"));
    let r = h.post(
        "/v1/templates",
        &json!({"name": "x", "from": "oci-archive:relative.tar"}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = h.get("/v1/templates/builds/nosuchbuild");
    assert_eq!(r.status, 404, "{}", r.text());

    eprintln!(
        "FIGURES session of a custom template (handmade): create + first exec {} ms",
        first_exec.as_millis()
    );
    for s in [&s1, &s2, &s3] {
        let _ = h.delete(&format!("/v1/sessions/{s}"));
    }
    drop(d);
}
