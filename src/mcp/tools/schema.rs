//! The tools' JSON Schemas, in and out (the definitions `tools/list`
//! shows; `known_only` checks arguments against the input ones).

use super::*;

pub(super) fn obj(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

pub(super) fn out(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required})
}

pub(super) fn sid() -> Value {
    json!({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$", "description": "Session id"})
}

pub(super) fn empty_in() -> Value {
    obj(json!({}), &[])
}

pub(super) fn session_id_in() -> Value {
    obj(json!({"sessionId": sid()}), &["sessionId"])
}

pub(super) fn create_session_in() -> Value {
    obj(
        json!({
            "sessionId": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$",
                          "description": "Id to give the session (default: generated)"},
            "template": {"type": "string", "description": "Template name (see list_templates)"},
            "limits": {
                "type": "object",
                "additionalProperties": false,
                "properties": {
                    "vcpus": {"type": "integer", "minimum": VCPUS.start(), "maximum": VCPUS.end(),
                              "description": "At most the daemon's max_vcpus and the host's online CPUs"},
                    "memoryMib": {"type": "integer", "minimum": MEM_MIB.start(), "maximum": MEM_MIB.end(),
                                  "description": format!("At most the daemon's max_mem_mib and {HOST_MEM_PERCENT}% of the host's RAM")},
                    "diskMib": {"type": "integer", "minimum": DISK_MIB.start(), "maximum": DISK_MIB.end(),
                                "description": "At most the daemon's max_disk_mib"},
                    "ttl": {"type": "number", "exclusiveMinimum": 0, "description": "Maximum lifetime in seconds"},
                    "idleTimeout": {"type": "number", "exclusiveMinimum": 0, "description": "Idle timeout in seconds"}
                }
            },
            "egress": {
                "description": "Network egress: a mode (internet, none, allowlist, denylist) or a policy object",
                "anyOf": [
                    {"type": "string", "enum": ["internet", "none", "allowlist", "denylist"]},
                    {"type": "object", "properties": {
                        "mode": {"type": "string", "enum": ["internet", "none", "allowlist", "denylist"]},
                        "rules": {"type": "array", "items": {"type": "string"}},
                        "domains": {"type": "array", "items": {"type": "string"}},
                        "deniedDomains": {"type": "array", "items": {"type": "string"}},
                        "bandwidthKbps": {"type": "integer", "minimum": 1},
                        "bandwidthBurstKbit": {"type": "integer", "minimum": 1}
                    }, "additionalProperties": false}
                ]
            },
            "env": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "Environment for every command in the session"},
            "onIdle": {"type": "string", "enum": ["destroy", "pause"],
                       "description": "Idle past its timeout, the session is destroyed (default) or paused"},
            "pausedTtl": {"description": "How long it may stay paused: seconds, or text like 30m",
                          "anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string"}]},
            "fromSnapshot": snapshot_id(),
            "count": count("Start this many sessions (from fromSnapshot); the answer lists them in sessions"),
            "secrets": injected_secrets()
        }),
        &[],
    )
}

/// Credentials the egress proxy injects (net::inject), as REST takes them.
pub(super) fn injected_secrets() -> Value {
    json!({"type": "array", "maxItems": crate::ops::inject_limits::MAX_SECRETS,
           "description": "Credentials the guest never sees: each command gets NAME=<placeholder>; \
                           the egress proxy puts the value in place of the placeholder in `header` \
                           (default Authorization; `format` like \"Bearer {value}\") of HTTPS requests \
                           to `hosts` only",
           "items": {"type": "object", "additionalProperties": false,
                     "required": ["name", "value", "hosts"],
                     "properties": {
                         "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$"},
                         "value": {"type": "string", "minLength": crate::ops::inject_limits::MIN_VALUE_CHARS},
                         "hosts": {"type": "array", "minItems": 1, "maxItems": crate::ops::inject_limits::MAX_HOSTS,
                                   "items": {"type": "string"}},
                         "header": {"type": "string"},
                         "format": {"type": "string"}}}})
}

pub(super) fn snapshot_id() -> Value {
    json!({"type": "string", "pattern": "^snap-([a-z][a-z0-9]{0,15}-)?[0-9a-f]{12}$",
           "description": "Snapshot id (from checkpoint_session or list_snapshots)"})
}

pub(super) fn count(description: &str) -> Value {
    json!({"type": "integer", "minimum": 1, "maximum": crate::ops::state::MAX_FORK,
           "description": description})
}

fn session_props() -> Value {
    json!({
        "sessionId": {"type": "string"},
        "template": {"type": "string"},
        "state": {"type": "string"},
        "vcpus": {"type": "integer"},
        "memoryMib": {"type": "integer"},
        "diskMib": {"type": "integer"},
        "createdAt": {"type": "integer"},
        "expiresAt": {"type": "integer"},
        "snapshotBytes": {"type": "integer", "description": "While paused: its checkpoint's size on disk"},
        "pausedAt": {"type": "integer", "description": "While paused: when it was paused (ms since the epoch)"},
        "pausedExpiresAt": {"type": "integer", "description": "While paused: when it is removed unless resumed"}
    })
}

pub(super) fn session_out() -> Value {
    out(session_props(), &["sessionId", "template", "state"])
}

/// A session of several started together, or one that failed to start.
fn started_items() -> Value {
    json!({"type": "array", "items": {"type": "object", "properties": {
        "sessionId": {"type": "string"}, "template": {"type": "string"}, "state": {"type": "string"},
        "error": {"type": "string", "description": "Why this one did not start (it is removed)"}
    }, "required": ["sessionId"]}})
}

/// `session_out`, and with `count` every session started.
pub(super) fn create_session_out() -> Value {
    let mut p = session_props();
    p["sessions"] = started_items();
    out(p, &["sessionId", "template", "state"])
}

pub(super) fn checkpoint_in() -> Value {
    obj(
        json!({"sessionId": sid(),
               "name": {"type": "string", "minLength": 1, "maxLength": 64, "description": "A label for listings"}}),
        &["sessionId"],
    )
}

pub(super) fn expose_port_in() -> Value {
    obj(
        json!({"sessionId": sid(),
               "port": {"type": "integer", "minimum": 1, "maximum": 65535,
                        "description": "The guest's TCP port (a server listening on 0.0.0.0 there)"},
               "ttl": {"type": "number", "exclusiveMinimum": 0,
                       "maximum": crate::ops::ports::MAX_TTL.as_secs(),
                       "description": "Seconds the URL works (default 3600)"},
               "public": {"type": "boolean",
                          "description": "Whoever has the URL gets in (default false: the owner's API key is needed too)"}}),
        &["sessionId", "port"],
    )
}

pub(super) fn expose_port_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "port": {"type": "integer"},
               "url": {"type": "string", "description": "Path-form preview URL"},
               "hostUrl": {"type": "string", "description": "Host-form URL (with a preview domain)"},
               "public": {"type": "boolean"},
               "createdAt": {"type": "integer"}, "expiresAt": {"type": "integer"}}),
        &["sessionId", "port", "url", "public", "expiresAt"],
    )
}

pub(super) fn fork_in() -> Value {
    obj(
        json!({"sessionId": sid(), "count": count("How many copies to start")}),
        &["sessionId", "count"],
    )
}

pub(super) fn snapshot_id_in() -> Value {
    obj(json!({"snapshotId": snapshot_id()}), &["snapshotId"])
}

fn snapshot_props() -> Value {
    json!({
        "id": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "sessionId": {"type": "string", "description": "The session it was taken of"},
        "template": {"type": "string"},
        "vcpus": {"type": "integer"},
        "memoryMib": {"type": "integer"},
        "diskMib": {"type": "integer"},
        "sizeBytes": {"type": "integer", "description": "Bytes its files take on disk"},
        "pausedMs": {"type": "integer", "description": "How long the source's guest was stopped to write it"},
        "createdAt": {"type": "integer"},
        "restorable": {"type": "boolean", "description": "Whether this host can start sessions from it"},
        "problem": {"type": "string", "description": "Why not, when restorable is false"}
    })
}

pub(super) fn snapshot_out() -> Value {
    out(
        snapshot_props(),
        &["id", "sessionId", "sizeBytes", "pausedMs", "restorable"],
    )
}

pub(super) fn list_snapshots_out() -> Value {
    out(
        json!({"snapshots": {"type": "array", "items": {"type": "object", "properties": snapshot_props(),
                                                        "required": ["id", "sessionId", "restorable"]}}}),
        &["snapshots"],
    )
}

pub(super) fn fork_out() -> Value {
    out(
        json!({
            "sourceId": {"type": "string"},
            "pausedMs": {"type": "integer", "description": "How long the source's guest was stopped"},
            "snapshotBytes": {"type": "integer"},
            "sessions": started_items()
        }),
        &["sourceId", "pausedMs", "snapshotBytes", "sessions"],
    )
}

pub(super) fn delete_snapshot_out() -> Value {
    out(
        json!({"snapshotId": {"type": "string"}, "deleted": {"type": "boolean"}}),
        &["snapshotId", "deleted"],
    )
}

pub(super) fn exec_props() -> Map<String, Value> {
    let v = json!({
        "sessionId": sid(),
        "command": {"type": "string", "minLength": 1,
                    "description": "Program (with args) or shell command line (without args)"},
        "args": {"type": "array", "items": {"type": "string"}, "description": "Arguments of command"},
        "cwd": {"type": "string", "description": "Working directory (relative: under the workspace)"},
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "timeout": {"type": "integer", "minimum": 1, "description": "Timeout in milliseconds"},
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

pub(super) fn execute_in() -> Value {
    let mut p = exec_props();
    p.insert(
        "template".into(),
        json!({"type": "string", "description": "Template for a session this call creates"}),
    );
    p.insert(
        "secrets".into(),
        json!({"type": "object", "maxProperties": crate::ops::validate::MAX_SECRETS,
               "propertyNames": {"pattern": "^[A-Za-z0-9_.-]{1,64}$"},
               "additionalProperties": {"type": "string", "minLength": crate::ops::mask::MIN_MASKED_LEN},
               "description": "Files /run/secrets/NAME (mode 0400) for this command only, \
                               removed when it ends; their values are masked (****) in its output"}),
    );
    obj(Value::Object(p), &["command"])
}

pub(super) fn execute_out() -> Value {
    out(
        json!({
            "sessionId": {"type": "string"},
            "exitCode": {"type": "integer"},
            "signal": {"type": ["string", "null"]},
            "timedOut": {"type": "boolean"},
            "stdout": {"type": "string"},
            "stderr": {"type": "string"},
            "truncated": {"type": "boolean"},
            "duration": {"type": "integer", "description": "Milliseconds"},
            "durationMs": {"type": "integer", "description": "The command's own run time in the sandbox, milliseconds"},
            "resourceUsage": resource_usage_schema(),
            "oomKilled": {"type": "boolean", "description": "Ended by the out-of-memory killer"}
        }),
        &[
            "sessionId",
            "exitCode",
            "stdout",
            "stderr",
            "timedOut",
            "duration",
        ],
    )
}

/// `resourceUsage` of an exec result (see `ops::exec::usage_fields`).
pub(super) fn resource_usage_schema() -> Value {
    json!({"type": ["object", "null"], "description": "What the command used, measured in the sandbox (null from an agent that does not measure)",
           "properties": {
               "memoryMb": {"type": "number", "description": "Peak memory, MiB"},
               "cpuPercent": {"type": "number", "description": "CPU time over run time, percent (over 100 on several cores)"},
               "source": {"type": "string", "enum": ["cgroup", "rusage"]}
           }, "required": ["memoryMb", "cpuPercent"]})
}

pub(super) fn run_code_in() -> Value {
    use crate::ops::run::*;
    obj(
        json!({
            "language": {"type": "string", "enum": Language::NAMES},
            "code": {"type": "string", "description": "The program's source"},
            "limits": {"type": "object", "additionalProperties": false, "properties": {
                "timeoutMs": {"type": "integer", "minimum": 1, "default": DEFAULT_TIMEOUT_MS,
                              "description": "The program is killed after this long"},
                "maxMemoryMb": {"type": "integer", "minimum": MIN_MEMORY_MB, "maximum": MEM_MIB.end(),
                                "default": DEFAULT_MAX_MEMORY_MB,
                                "description": "Memory of the program's processes, MiB; over it they are OOM-killed"},
                "cpuCores": {"type": "number", "minimum": MIN_CPU_CORES, "maximum": VCPUS.end(),
                             "default": DEFAULT_CPU_CORES, "description": "CPU quota in cores"},
                "allowNetwork": {"type": "boolean", "default": false,
                                 "description": "false: no network at all; true: the server's default egress policy"}
            }}
        }),
        &["language", "code"],
    )
}

pub(super) fn run_code_out() -> Value {
    out(
        json!({
            "sandboxId": {"type": "string", "description": "The session made for the run (already destroyed)"},
            "language": {"type": "string"},
            "template": {"type": "string"},
            "exitCode": {"type": "integer"},
            "signal": {"type": ["string", "null"]},
            "stdout": {"type": "string"},
            "stderr": {"type": "string"},
            "truncated": {"type": "boolean"},
            "timedOut": {"type": "boolean"},
            "durationMs": {"type": "integer", "description": "The program's run time, milliseconds"},
            "resourceUsage": resource_usage_schema(),
            "oomKilled": {"type": "boolean"}
        }),
        &[
            "sandboxId",
            "exitCode",
            "stdout",
            "stderr",
            "durationMs",
            "timedOut",
            "resourceUsage",
        ],
    )
}

pub(super) fn templates_out() -> Value {
    out(
        json!({"templates": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "displayName": {"type": "string"},
            "version": {"type": "string"}, "description": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "string"}},
            "resources": {"type": "object", "properties": {
                "memSizeMib": {"type": "integer"}, "vcpuCount": {"type": "integer"}
            }},
            "vcpus": {"type": "integer"}, "memoryMib": {"type": "integer"}, "default": {"type": "boolean"},
            "builtin": {"type": "boolean"},
            "source": {"type": "object", "properties": {
                "from": {"type": "string"}, "digest": {"type": "string"}, "builtAt": {"type": "integer"}
            }}
        }, "required": ["name", "displayName", "version", "description", "tools"]}}}),
        &["templates"],
    )
}

pub(super) fn write_file_in() -> Value {
    obj(
        json!({
            "sessionId": sid(),
            "path": {"type": "string", "minLength": 1},
            "content": {"type": "string"},
            "encoding": {"type": "string", "enum": ["utf8", "base64"]}
        }),
        &["sessionId", "path", "content"],
    )
}

pub(super) fn write_file_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "path": {"type": "string"}, "bytes": {"type": "integer"}}),
        &["path", "bytes"],
    )
}

pub(super) fn path_in() -> Value {
    obj(
        json!({"sessionId": sid(), "path": {"type": "string", "minLength": 1}}),
        &["sessionId", "path"],
    )
}

pub(super) fn read_file_out() -> Value {
    out(
        json!({
            "path": {"type": "string"},
            "size": {"type": "integer"},
            "encoding": {"type": "string", "enum": ["utf8", "base64"]},
            "content": {"type": "string"}
        }),
        &["path", "size", "encoding", "content"],
    )
}

pub(super) fn list_files_in() -> Value {
    obj(
        json!({"sessionId": sid(), "path": {"type": "string", "minLength": 1},
               "recursive": {"type": "boolean"}}),
        &["sessionId"],
    )
}

pub(super) fn list_files_out() -> Value {
    out(
        json!({
            "path": {"type": "string"},
            "files": {"type": "array", "items": {"type": "object", "properties": {
                "path": {"type": "string"}, "name": {"type": "string"}, "type": {"type": "string"},
                "size": {"type": "integer"}, "mode": {"type": "integer"}, "mtime": {"type": "integer"}
            }, "required": ["path", "type"]}},
            "truncated": {"type": "boolean"}
        }),
        &["path", "files"],
    )
}

pub(super) fn ping_in() -> Value {
    obj(json!({"sessionId": sid()}), &[])
}

pub(super) fn ping_out() -> Value {
    out(
        json!({"ok": {"type": "boolean"}, "sessionId": {"type": "string"},
               "latencyMs": {"type": "number"}, "version": {"type": "string"}}),
        &["ok"],
    )
}

pub(super) fn list_sessions_out() -> Value {
    out(
        json!({"sessions": {"type": "array", "items": {"type": "object", "properties": {
            "sessionId": {"type": "string"}, "template": {"type": "string"}, "state": {"type": "string"}
        }, "required": ["sessionId"]}}}),
        &["sessions"],
    )
}

pub(super) fn destroy_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "destroyed": {"type": "boolean"}}),
        &["sessionId", "destroyed"],
    )
}

pub(super) fn start_process_in() -> Value {
    let mut p = exec_props();
    p.insert(
        "tag".into(),
        json!({"type": "string", "maxLength": 256, "description": "Label for listings"}),
    );
    obj(Value::Object(p), &["sessionId", "command"])
}

pub(super) fn start_process_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "procId": {"type": "integer"}, "pid": {"type": "integer"}}),
        &["sessionId", "procId", "pid"],
    )
}

pub(super) fn proc_id() -> Value {
    json!({"type": "integer", "minimum": 1, "description": "procId from start_process"})
}

pub(super) fn read_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(),
               "offset": {"type": "integer", "minimum": 0, "description": "Output offset to read from (default 0)"},
               "waitMs": {"type": "integer", "minimum": 0, "maximum": 60000,
                          "description": "How long to wait for output (default 200)"}}),
        &["sessionId", "procId"],
    )
}

pub(super) fn read_process_out() -> Value {
    out(
        json!({
            "procId": {"type": "integer"},
            "stdout": {"type": "string"},
            "stderr": {"type": "string"},
            "nextOffset": {"type": "integer"},
            "dropped": {"type": "integer", "description": "Bytes lost before offset was read (buffer overflow)"},
            "running": {"type": "boolean"},
            "exitCode": {"type": ["integer", "null"]},
            "signal": {"type": ["string", "null"]}
        }),
        &["procId", "stdout", "stderr", "nextOffset", "running"],
    )
}

pub(super) fn write_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(), "input": {"type": "string"},
               "eof": {"type": "boolean", "description": "Close stdin after writing"}}),
        &["sessionId", "procId"],
    )
}

pub(super) fn write_process_out() -> Value {
    out(
        json!({"procId": {"type": "integer"}, "bytes": {"type": "integer"}, "eof": {"type": "boolean"}}),
        &["procId", "bytes", "eof"],
    )
}

pub(super) fn kill_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(),
               "signal": {"description": "Signal name (TERM, KILL, INT, HUP, ...; SIG before it or not, any case) \
                                          or number; default TERM",
                          "anyOf": [{"type": "string", "pattern": Signal::name_pattern()},
                                    {"type": "integer", "minimum": signal::RANGE.start(), "maximum": signal::RANGE.end()}]}}),
        &["sessionId", "procId"],
    )
}

pub(super) fn kill_process_out() -> Value {
    out(
        json!({"procId": {"type": "integer"}, "signal": {"type": "integer"}, "success": {"type": "boolean"}}),
        &["procId", "signal", "success"],
    )
}

pub(super) fn get_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id()}),
        &["sessionId", "procId"],
    )
}

/// An entry of REST's process list (`ops::procs::proc_json`).
pub(super) fn get_process_out() -> Value {
    out(
        json!({
            "procId": {"type": "integer"},
            "pid": {"type": "integer"},
            "argv": {"type": "array", "items": {"type": "string"}},
            "tag": {"type": ["string", "null"]},
            "background": {"type": "boolean"},
            "pty": {"type": "boolean"},
            "startedAt": {"type": "integer", "description": "Milliseconds since the epoch"},
            "running": {"type": "boolean"},
            "exitCode": {"type": ["integer", "null"]},
            "signal": {"type": ["string", "null"]}
        }),
        &["procId", "pid", "argv", "running"],
    )
}

pub(super) fn kill_all_out() -> Value {
    out(
        json!({"killed": {"type": "integer", "description": "processes found"},
               "remaining": {"type": "integer", "description": "still there when the sandbox stopped waiting (normally 0)"}}),
        &["killed", "remaining"],
    )
}

// ---- argument helpers ---------------------------------------------------------
