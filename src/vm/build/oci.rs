//! Reading an OCI image layout (`index.json`, `blobs/sha256/`): which
//! manifest, its layers, and the config fields a template takes (`Env`,
//! `WorkingDir`, `User`, `Labels`). Every blob read is bounded and its
//! digest checked; the layers are checked one by one so a corrupt one is
//! named.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Largest index, manifest or config blob read (real ones are a few KiB).
pub const MAX_META_BYTES: u64 = 4 << 20;
/// Most layers an image may have (Docker's own limit is 127).
pub const MAX_LAYERS: usize = 128;

const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

#[derive(Debug, Clone, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
}

#[derive(Deserialize)]
struct Index {
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize, Default)]
struct ConfigFile {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<RunConfig>,
}

/// The parts of an image's config a template uses.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct RunConfig {
    #[serde(rename = "Env", default)]
    pub env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    pub working_dir: Option<String>,
    #[serde(rename = "User", default)]
    pub user: Option<String>,
    #[serde(rename = "Labels", default)]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(rename = "Entrypoint", default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    pub cmd: Option<Vec<String>>,
}

/// One image of a layout.
#[derive(Debug, Clone)]
pub struct Image {
    /// `sha256:...` of its manifest: what a build is cached by.
    pub digest: String,
    pub layers: Vec<Descriptor>,
    pub config: RunConfig,
}

impl Image {
    /// "layer 2 of 3 (sha256:0123456789ab)" for the layer `digest` names.
    pub fn layer_name(&self, digest: &str) -> Option<String> {
        let i = self.layers.iter().position(|l| l.digest == digest)?;
        Some(format!(
            "layer {} of {} ({})",
            i + 1,
            self.layers.len(),
            short(digest)
        ))
    }

    /// The first layer a message names by digest.
    pub fn layer_in(&self, msg: &str) -> Option<String> {
        self.layers
            .iter()
            .find(|l| msg.contains(l.digest.trim_start_matches("sha256:")))
            .and_then(|l| self.layer_name(&l.digest))
    }

    pub fn layer_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }
}

/// `sha256:0123456789ab` (12 hex digits).
pub fn short(digest: &str) -> String {
    digest.chars().take("sha256:".len() + 12).collect()
}

/// `blobs/sha256/<hex>` of `digest`, which must be a well-formed sha256.
pub fn blob_path(layout: &Path, digest: &str) -> Result<PathBuf, String> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| {
            h.len() == 64
                && h.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        })
        .ok_or_else(|| {
            format!("unsupported or malformed digest {digest:?} (want sha256:<64 hex>)")
        })?;
    Ok(layout.join("blobs/sha256").join(hex))
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, String> {
    let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if out.len() as u64 > max {
        return Err(format!("{} is larger than {max} bytes", path.display()));
    }
    Ok(out)
}

/// A small blob (index, manifest, config), its size and digest checked.
fn read_blob(layout: &Path, d: &Descriptor, what: &str) -> Result<Vec<u8>, String> {
    if d.size > MAX_META_BYTES {
        return Err(format!(
            "{what} {}: {} bytes, more than {MAX_META_BYTES}",
            short(&d.digest),
            d.size
        ));
    }
    let data = read_bounded(&blob_path(layout, &d.digest)?, MAX_META_BYTES)
        .map_err(|e| format!("{what} {}: {e}", short(&d.digest)))?;
    let got = format!("sha256:{:x}", Sha256::digest(&data));
    if data.len() as u64 != d.size || got != d.digest {
        return Err(format!(
            "{what} {}: content does not match its descriptor (size {} vs {}, digest {})",
            short(&d.digest),
            data.len(),
            d.size,
            short(&got)
        ));
    }
    Ok(data)
}

/// Streams a layer blob through sha256: its size and digest must match
/// the manifest. `progress(bytes)` after each chunk.
pub fn verify_layer(
    layout: &Path,
    d: &Descriptor,
    progress: &mut dyn FnMut(u64),
) -> Result<(), String> {
    let path = blob_path(layout, &d.digest)?;
    let mut f = File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if k == 0 {
            break;
        }
        n += k as u64;
        if n > d.size {
            return Err(format!(
                "larger than the {} bytes its manifest says",
                d.size
            ));
        }
        h.update(&buf[..k]);
        progress(k as u64);
    }
    let got = format!("sha256:{:x}", h.finalize());
    if n != d.size {
        return Err(format!("{n} bytes, its manifest says {}", d.size));
    }
    if got != d.digest {
        return Err(format!(
            "its content hashes to {}, not to its digest",
            short(&got)
        ));
    }
    Ok(())
}

fn is_amd64_linux(p: &Option<Platform>) -> bool {
    p.as_ref()
        .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
}

/// The image tagged `tag` in the layout at `layout` (the only one when
/// `tag` is `None`); a multi-platform index gives its linux/amd64 image.
pub fn read_layout(layout: &Path, tag: Option<&str>) -> Result<Image, String> {
    let raw = read_bounded(&layout.join("index.json"), MAX_META_BYTES)?;
    let index: Index = serde_json::from_slice(&raw).map_err(|e| format!("index.json: {e}"))?;
    let pick = match tag {
        Some(t) => index
            .manifests
            .iter()
            .find(|m| {
                m.annotations
                    .get("org.opencontainers.image.ref.name")
                    .map(String::as_str)
                    == Some(t)
            })
            .ok_or_else(|| format!("index.json has no image tagged {t:?}"))?,
        None if index.manifests.len() == 1 => &index.manifests[0],
        None => {
            return Err(format!(
                "index.json lists {} images: name one (oci:DIR:TAG)",
                index.manifests.len()
            ))
        }
    };
    let mut desc = pick.clone();
    for _ in 0..4 {
        let data = read_blob(layout, &desc, "manifest")?;
        let m: Manifest = serde_json::from_slice(&data)
            .map_err(|e| format!("manifest {}: {e}", short(&desc.digest)))?;
        let nested = m.media_type == INDEX
            || m.media_type == DOCKER_LIST
            || desc.media_type == INDEX
            || (m.config.is_none() && !m.manifests.is_empty());
        if nested {
            desc = m
                .manifests
                .iter()
                .find(|d| is_amd64_linux(&d.platform))
                .cloned()
                .ok_or_else(|| {
                    format!(
                        "image index {} has no linux/amd64 image",
                        short(&desc.digest)
                    )
                })?;
            continue;
        }
        let cfg_desc = m
            .config
            .ok_or_else(|| format!("manifest {} has no config", short(&desc.digest)))?;
        if m.layers.len() > MAX_LAYERS {
            return Err(format!("{} layers, more than {MAX_LAYERS}", m.layers.len()));
        }
        let cfg: ConfigFile = serde_json::from_slice(&read_blob(layout, &cfg_desc, "config")?)
            .map_err(|e| format!("config {}: {e}", short(&cfg_desc.digest)))?;
        if (!cfg.os.is_empty() && cfg.os != "linux")
            || (!cfg.architecture.is_empty() && cfg.architecture != "amd64")
        {
            return Err(format!(
                "the image is for {}/{}; sandboxes run linux/amd64",
                cfg.os, cfg.architecture
            ));
        }
        for l in &m.layers {
            blob_path(layout, &l.digest)?;
        }
        return Ok(Image {
            digest: desc.digest,
            layers: m.layers,
            config: cfg.config.unwrap_or_default(),
        });
    }
    Err("image indexes nested more than 4 deep".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(dir: &Path, data: &[u8]) -> String {
        let d = format!("{:x}", Sha256::digest(data));
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("blobs/sha256").join(&d), data).unwrap();
        format!("sha256:{d}")
    }

    #[test]
    fn reads_a_layout_and_names_a_corrupt_layer() {
        let t = tempfile::tempdir().unwrap();
        let l1 = put(t.path(), b"layer one");
        let cfg = br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=b"],"WorkingDir":"/w","User":"1:2","Labels":{"template.name":"x"}}}"#;
        let c = put(t.path(), cfg);
        let man = format!(
            r#"{{"schemaVersion":2,"config":{{"mediaType":"x","digest":"{c}","size":{}}},"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"{l1}","size":9}}]}}"#,
            cfg.len()
        );
        let m = put(t.path(), man.as_bytes());
        std::fs::write(
            t.path().join("index.json"),
            format!(
                r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{m}","size":{},"annotations":{{"org.opencontainers.image.ref.name":"v1"}}}}]}}"#,
                man.len()
            ),
        )
        .unwrap();
        let img = read_layout(t.path(), None).unwrap();
        assert_eq!(img.digest, m);
        assert_eq!(img.config.env.as_deref(), Some(&["A=b".to_string()][..]));
        assert_eq!(img.config.working_dir.as_deref(), Some("/w"));
        assert!(read_layout(t.path(), Some("v1")).is_ok());
        assert!(read_layout(t.path(), Some("v2"))
            .unwrap_err()
            .contains("v2"));
        let mut seen = 0;
        verify_layer(t.path(), &img.layers[0], &mut |n| seen += n).unwrap();
        assert_eq!(seen, 9);
        std::fs::write(blob_path(t.path(), &l1).unwrap(), b"layer 0ne").unwrap();
        let e = verify_layer(t.path(), &img.layers[0], &mut |_| {}).unwrap_err();
        assert!(e.contains("hashes to"), "{e}");
        assert_eq!(
            img.layer_name(&l1).unwrap(),
            format!("layer 1 of 1 ({})", short(&l1))
        );
        assert!(img.layer_in(&format!("bad blob {}", &l1[7..])).is_some());
        assert!(blob_path(t.path(), "sha256:../../etc/passwd").is_err());
        // A manifest whose bytes changed is refused, not parsed.
        std::fs::write(
            blob_path(t.path(), &m).unwrap(),
            man.replace("schemaVersion\":2", "schemaVersion\":3"),
        )
        .unwrap();
        assert!(read_layout(t.path(), None)
            .unwrap_err()
            .contains("does not match"));
    }
}
