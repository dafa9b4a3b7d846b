//! Templates from users' images, for admins (issue #27): start a build,
//! see its progress, delete a template built from an image. The build
//! itself runs in the host's builder process (`sandbox::builds`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{Ops, OpsError, OpsResult, Principal};
use crate::sandbox::builds::{BuildNetwork, BuildSpec, BuildView, MAX_DOCKERFILE};

/// `POST /v1/templates` (and the MCP tool, if one is added): exactly one of
/// `from` (an image reference on this host or a registry) and
/// `dockerfile` (its text).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateBuildRequest {
    pub name: String,
    #[serde(default)]
    pub from: Option<String>,
    /// The Dockerfile's text.
    #[serde(default)]
    pub dockerfile: Option<String>,
    /// Build context: a directory on the daemon's host [none: an empty one].
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub display_name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    #[serde(default)]
    pub vcpus: Option<u32>,
    #[serde(default)]
    pub memory_mib: Option<u32>,
    #[serde(default)]
    pub disk_mib: Option<u32>,
    /// `none` (the default) or `host`: honoured only where the daemon
    /// allows builds the host's network.
    #[serde(default)]
    pub network: Option<String>,
    #[serde(default)]
    pub insecure_registry: bool,
}

fn bad(m: impl Into<String>) -> OpsError {
    OpsError::BadRequest(m.into())
}

fn text(field: &str, v: &Option<String>, max: usize) -> OpsResult<()> {
    if let Some(v) = v {
        if v.len() > max || v.chars().any(char::is_control) {
            return Err(bad(format!(
                "{field}: at most {max} bytes, no control characters"
            )));
        }
    }
    Ok(())
}

fn host_path(field: &str, p: &str) -> OpsResult<PathBuf> {
    let path = Path::new(p);
    if !path.is_absolute()
        || p.len() > 4096
        || path
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(bad(format!(
            "{field}: an absolute path on the daemon's host without '..'"
        )));
    }
    Ok(path.to_path_buf())
}

impl TemplateBuildRequest {
    /// The spec the builder gets, and the Dockerfile's text.
    fn validate(self, shape: &crate::config::Config) -> OpsResult<(BuildSpec, Option<String>)> {
        if !crate::ops::validate::template_name_ok(&self.name) {
            return Err(bad(format!(
                "name {:?}: expected [a-z0-9][a-z0-9_-]{{0,31}}",
                self.name
            )));
        }
        match (&self.from, &self.dockerfile) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => return Err(bad("give exactly one of from and dockerfile")),
        }
        if let Some(f) = &self.from {
            text("from", &self.from, 4096)?;
            let local = ["oci-archive:", "oci:", "docker-archive:"]
                .iter()
                .find_map(|p| f.strip_prefix(p));
            match local {
                Some(rest) => {
                    host_path(
                        "from",
                        rest.rsplit_once(':').map_or(
                            rest,
                            |(d, t)| {
                                if t.contains('/') {
                                    rest
                                } else {
                                    d
                                }
                            },
                        ),
                    )?;
                }
                None if f.starts_with("docker://") => {}
                None => return Err(bad(
                    "from: oci-archive:FILE, oci:DIR[:TAG], docker-archive:FILE or docker://REF",
                )),
            }
        }
        if let Some(d) = &self.dockerfile {
            if d.len() > MAX_DOCKERFILE || d.contains('\0') {
                return Err(bad(format!(
                    "dockerfile: at most {MAX_DOCKERFILE} bytes of text"
                )));
            }
        } else if self.context.is_some() {
            return Err(bad("context goes with dockerfile"));
        }
        let context = match &self.context {
            Some(c) => {
                let p = host_path("context", c)?;
                if !p.is_dir() {
                    return Err(bad(format!("context {c}: not a directory on this host")));
                }
                Some(p)
            }
            None => None,
        };
        text("displayName", &self.display_name, 128)?;
        text("description", &self.description, 1024)?;
        if let Some(t) = &self.tools {
            if t.len() > 64
                || t.iter()
                    .any(|x| x.is_empty() || x.len() > 64 || x.contains([',', ' ']))
            {
                return Err(bad(
                    "tools: at most 64 names of 1..64 bytes, no commas or spaces",
                ));
            }
        }
        if let Some(v) = self.vcpus {
            if v == 0 || v > shape.max_vcpus {
                return Err(bad(format!("vcpus {v}: 1..={}", shape.max_vcpus)));
            }
        }
        if let Some(m) = self.memory_mib {
            if !(128..=shape.max_mem_mib).contains(&m) {
                return Err(bad(format!("memoryMib {m}: 128..={}", shape.max_mem_mib)));
            }
        }
        if let Some(d) = self.disk_mib {
            if !(64..=shape.max_disk_mib).contains(&d) {
                return Err(bad(format!("diskMib {d}: 64..={}", shape.max_disk_mib)));
            }
        }
        let network = match self.network.as_deref() {
            None | Some("none") => BuildNetwork::None,
            Some("host") => BuildNetwork::Host,
            Some(n) => return Err(bad(format!("network {n:?}: none or host"))),
        };
        let spec = BuildSpec {
            name: self.name,
            from: self.from,
            dockerfile: None,
            context,
            display_name: self.display_name,
            description: self.description,
            tools: self.tools,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
            network,
            insecure_registry: self.insecure_registry,
        };
        Ok((spec, self.dockerfile))
    }
}

impl Ops {
    fn builds(&self) -> OpsResult<std::sync::Arc<crate::sandbox::builds::Builds>> {
        self.mgr.factory.builds().ok_or_else(|| {
            OpsError::NotSupported(
                "this daemon builds no templates (it needs root, the qemu or firecracker backend and an agent from `agent-sandbox image build`)".into(),
            )
        })
    }

    /// `POST /v1/templates`: starts a build and answers at once.
    pub fn template_build(&self, p: &Principal, req: TemplateBuildRequest) -> OpsResult<BuildView> {
        if !p.is_admin() {
            return Err(OpsError::Forbidden(
                "template builds need an admin key".into(),
            ));
        }
        let (spec, dockerfile) = req.validate(&self.cfg)?;
        if self.mgr.factory.is_builtin_template(&spec.name) {
            return Err(OpsError::TemplateBusy {
                name: spec.name,
                why: "a built-in template has that name".into(),
            });
        }
        let b = self.builds()?;
        b.start_build(spec.clone(), dockerfile)
            .map_err(|why| OpsError::TemplateBusy {
                name: spec.name,
                why,
            })
    }

    /// `GET /v1/templates/builds/:id`.
    pub fn template_build_status(&self, p: &Principal, id: &str) -> OpsResult<BuildView> {
        if !p.is_admin() {
            return Err(OpsError::Forbidden(
                "template builds need an admin key".into(),
            ));
        }
        if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(OpsError::BuildNotFound {
                id: id.chars().take(64).collect(),
            });
        }
        self.builds()?
            .get(id)
            .ok_or_else(|| OpsError::BuildNotFound { id: id.to_string() })
    }

    /// `DELETE /v1/templates/:name`: refused while a session (running or
    /// paused) uses it or it is being built.
    pub fn template_delete(&self, p: &Principal, name: &str) -> OpsResult<()> {
        if !p.is_admin() {
            return Err(OpsError::Forbidden(
                "deleting templates needs an admin key".into(),
            ));
        }
        if !crate::ops::validate::template_name_ok(name) {
            return Err(OpsError::TemplateNotFound {
                name: name.chars().take(64).collect(),
            });
        }
        let users = self
            .mgr
            .list(None)
            .iter()
            .filter(|s| s.spec.template == name)
            .count();
        if users > 0 {
            return Err(OpsError::TemplateBusy {
                name: name.into(),
                why: format!("{users} session(s) use it: delete them first"),
            });
        }
        match self.mgr.factory.delete_template(name) {
            Ok(true) => Ok(()),
            Ok(false) => Err(OpsError::TemplateNotFound { name: name.into() }),
            Err(crate::sandbox::SandboxError::Unsupported(why)) => Err(OpsError::TemplateBusy {
                name: name.into(),
                why,
            }),
            Err(e) => Err(OpsError::TemplateBusy {
                name: name.into(),
                why: e.to_string(),
            }),
        }
    }
}
