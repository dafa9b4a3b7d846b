//! The MCP tools: definitions (JSON Schema in and out, fixed order) and
//! handlers that call the operations ([`crate::ops`]) like the REST API
//! does.
//!
//! Tool names and argument names follow the seed (`sessionId`, `command`,
//! `args`, `cwd`, `timeout`, `template`, `path`, `content`) so existing agent
//! configs keep working.

use super::Host;
use crate::ops::exec::{self as ops_exec, Captured, ExecEvent, ExecSpec, Prepared};
use crate::ops::sessions::{self, check_range, Span, DISK_MIB, HOST_MEM_PERCENT, MEM_MIB, VCPUS};
use crate::ops::validate;
use crate::ops::{files, procs, OpsError, Principal, Session, SessionSpec, SessionView};
use crate::ops::{EgressMode, EgressPolicy};
use crate::proto::{signal, Response, Signal};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Everything a handler may use besides its arguments.
pub struct ToolCtx<'a> {
    pub host: &'a Host,
    pub caller: &'a Principal,
    /// True once the call should stop (cancelled, or the client is gone).
    pub stop: &'a dyn Fn() -> bool,
    /// Progress notification (`progress` must grow); `None` without a
    /// progress token.
    pub progress: Option<&'a dyn Fn(f64, String)>,
    /// Told about every session the call created.
    pub created: &'a dyn Fn(&str),
}

/// A successful tool answer.
pub struct ToolOut {
    pub structured: Value,
    /// Extra content blocks (binary files); the JSON text block is always added.
    pub extra: Vec<Value>,
}

impl From<Value> for ToolOut {
    fn from(structured: Value) -> Self {
        ToolOut {
            structured,
            extra: Vec::new(),
        }
    }
}

pub type ToolResult = Result<ToolOut, String>;
type Handler = fn(&ToolCtx, &Map<String, Value>) -> ToolResult;

pub struct Tool {
    pub name: &'static str,
    pub title: &'static str,
    pub description: &'static str,
    pub input: fn() -> Value,
    pub output: fn() -> Value,
    pub read_only: bool,
    pub destructive: bool,
    pub run: Handler,
}

impl Tool {
    pub fn definition(&self) -> Value {
        json!({
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "inputSchema": (self.input)(),
            "outputSchema": (self.output)(),
            "annotations": {
                "title": self.title,
                "readOnlyHint": self.read_only,
                "destructiveHint": self.destructive,
                "openWorldHint": false,
            },
        })
    }
}

/// Every tool, in the order `tools/list` shows them.
pub static TOOLS: &[Tool] = &[
    Tool {
        name: "create_session",
        title: "Create sandbox session",
        description: "Create a new sandbox session (its own microVM) and return its sessionId. \
            Other tools take that sessionId. Sessions are removed when idle for long, or with destroy_session.",
        input: create_session_in,
        output: session_out,
        read_only: false,
        destructive: false,
        run: create_session,
    },
    Tool {
        name: "execute",
        title: "Run a command",
        description: "Run a command in a sandbox session and return its exit code and output. \
            With args, command is the program and args its arguments; without args, command is a \
            shell command line (/bin/sh -c). An unknown sessionId creates that session; without \
            sessionId a new session is made. Output streams as progress notifications when requested.",
        input: execute_in,
        output: execute_out,
        read_only: false,
        destructive: false,
        run: execute,
    },
    Tool {
        name: "run_code",
        title: "Run code in a fresh sandbox",
        description: "Run a python, node or bash program in a new sandbox made for this call and \
            destroyed after it, under limits (timeoutMs, maxMemoryMb, cpuCores, allowNetwork; no \
            network unless allowed). Returns exit code, stdout, stderr, durationMs, timedOut and \
            resourceUsage; a program over its memory limit is killed (oomKilled).",
        input: run_code_in,
        output: run_code_out,
        read_only: false,
        destructive: false,
        run: run_code,
    },
    Tool {
        name: "list_templates",
        title: "List templates",
        description: "List the sandbox templates (images) a session can be created from.",
        input: empty_in,
        output: templates_out,
        read_only: true,
        destructive: false,
        run: list_templates,
    },
    Tool {
        name: "write_file",
        title: "Write a file",
        description: "Write a file in a sandbox session (parent directories are created; relative \
            paths are under the workspace). content is text, or base64 with encoding=base64.",
        input: write_file_in,
        output: write_file_out,
        read_only: false,
        destructive: true,
        run: write_file,
    },
    Tool {
        name: "read_file",
        title: "Read a file",
        description: "Read a file from a sandbox session. Text comes back as text; binary content \
            comes back base64-encoded (and as an embedded resource blob).",
        input: path_in,
        output: read_file_out,
        read_only: true,
        destructive: false,
        run: read_file,
    },
    Tool {
        name: "list_files",
        title: "List files",
        description: "List a directory in a sandbox session (default: the workspace), optionally recursively.",
        input: list_files_in,
        output: list_files_out,
        read_only: true,
        destructive: false,
        run: list_files,
    },
    Tool {
        name: "ping",
        title: "Ping",
        description: "Check that the server (and, with sessionId, that session's sandbox) answers.",
        input: ping_in,
        output: ping_out,
        read_only: true,
        destructive: false,
        run: ping,
    },
    Tool {
        name: "reset_session",
        title: "Reset session",
        description: "Destroy a session's sandbox and start a fresh one with the same id and settings.",
        input: session_id_in,
        output: session_out,
        read_only: false,
        destructive: true,
        run: reset_session,
    },
    Tool {
        name: "list_sessions",
        title: "List sessions",
        description: "List the sandbox sessions this caller owns.",
        input: empty_in,
        output: list_sessions_out,
        read_only: true,
        destructive: false,
        run: list_sessions,
    },
    Tool {
        name: "destroy_session",
        title: "Destroy session",
        description: "Destroy a sandbox session and everything in it.",
        input: session_id_in,
        output: destroy_out,
        read_only: false,
        destructive: true,
        run: destroy_session,
    },
    Tool {
        name: "start_process",
        title: "Start background process",
        description: "Start a command in the background (a server, a watcher) and return its procId \
            at once. Read its output with read_process, feed stdin with write_process, stop it with kill_process.",
        input: start_process_in,
        output: start_process_out,
        read_only: false,
        destructive: false,
        run: start_process,
    },
    Tool {
        name: "read_process",
        title: "Read process output",
        description: "Read a background process's output from offset (0 = its start; pass the \
            returned nextOffset next time), waiting up to waitMs for more, and whether it still runs.",
        input: read_process_in,
        output: read_process_out,
        read_only: true,
        destructive: false,
        run: read_process,
    },
    Tool {
        name: "write_process",
        title: "Write process input",
        description: "Write text to a background process's stdin; eof=true closes it afterwards.",
        input: write_process_in,
        output: write_process_out,
        read_only: false,
        destructive: false,
        run: write_process,
    },
    Tool {
        name: "kill_process",
        title: "Signal process",
        description: "Send a signal (default SIGTERM) to a background process and its process group.",
        input: kill_process_in,
        output: kill_process_out,
        read_only: false,
        destructive: true,
        run: kill_process,
    },
    Tool {
        name: "kill_all_processes",
        title: "Kill all processes",
        description: "SIGKILL every process in a session's sandbox (commands, background processes and \
            whatever they left running); files and the session stay. For a runaway or forgotten process \
            when reset_session would lose too much.",
        input: session_id_in,
        output: kill_all_out,
        read_only: false,
        destructive: true,
        run: kill_all_processes,
    },
    Tool {
        name: "get_process",
        title: "Get process",
        description: "One process of a session's sandbox (a background process or a command): \
            its argv, tag, whether it still runs, and its exit code or signal once it ended.",
        input: get_process_in,
        output: get_process_out,
        read_only: true,
        destructive: false,
        run: get_process,
    },
];

pub fn find(name: &str) -> Option<&'static Tool> {
    TOOLS.iter().find(|t| t.name == name)
}

// ---- schemas ----------------------------------------------------------------

fn obj(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

fn out(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required})
}

fn sid() -> Value {
    json!({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$", "description": "Session id"})
}

fn empty_in() -> Value {
    obj(json!({}), &[])
}

fn session_id_in() -> Value {
    obj(json!({"sessionId": sid()}), &["sessionId"])
}

fn create_session_in() -> Value {
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
                    "description": "Environment for every command in the session"}
        }),
        &[],
    )
}

fn session_out() -> Value {
    out(
        json!({
            "sessionId": {"type": "string"},
            "template": {"type": "string"},
            "state": {"type": "string"},
            "vcpus": {"type": "integer"},
            "memoryMib": {"type": "integer"},
            "diskMib": {"type": "integer"},
            "createdAt": {"type": "integer"},
            "expiresAt": {"type": "integer"}
        }),
        &["sessionId", "template", "state"],
    )
}

fn exec_props() -> Map<String, Value> {
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

fn execute_in() -> Value {
    let mut p = exec_props();
    p.insert(
        "template".into(),
        json!({"type": "string", "description": "Template for a session this call creates"}),
    );
    obj(Value::Object(p), &["command"])
}

fn execute_out() -> Value {
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
fn resource_usage_schema() -> Value {
    json!({"type": ["object", "null"], "description": "What the command used, measured in the sandbox (null from an agent that does not measure)",
           "properties": {
               "memoryMb": {"type": "number", "description": "Peak memory, MiB"},
               "cpuPercent": {"type": "number", "description": "CPU time over run time, percent (over 100 on several cores)"},
               "source": {"type": "string", "enum": ["cgroup", "rusage"]}
           }, "required": ["memoryMb", "cpuPercent"]})
}

fn run_code_in() -> Value {
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

fn run_code_out() -> Value {
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

fn templates_out() -> Value {
    out(
        json!({"templates": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "displayName": {"type": "string"},
            "version": {"type": "string"}, "description": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "string"}},
            "resources": {"type": "object", "properties": {
                "memSizeMib": {"type": "integer"}, "vcpuCount": {"type": "integer"}
            }},
            "vcpus": {"type": "integer"}, "memoryMib": {"type": "integer"}, "default": {"type": "boolean"}
        }, "required": ["name", "displayName", "version", "description", "tools"]}}}),
        &["templates"],
    )
}

fn write_file_in() -> Value {
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

fn write_file_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "path": {"type": "string"}, "bytes": {"type": "integer"}}),
        &["path", "bytes"],
    )
}

fn path_in() -> Value {
    obj(
        json!({"sessionId": sid(), "path": {"type": "string", "minLength": 1}}),
        &["sessionId", "path"],
    )
}

fn read_file_out() -> Value {
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

fn list_files_in() -> Value {
    obj(
        json!({"sessionId": sid(), "path": {"type": "string", "minLength": 1},
               "recursive": {"type": "boolean"}}),
        &["sessionId"],
    )
}

fn list_files_out() -> Value {
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

fn ping_in() -> Value {
    obj(json!({"sessionId": sid()}), &[])
}

fn ping_out() -> Value {
    out(
        json!({"ok": {"type": "boolean"}, "sessionId": {"type": "string"},
               "latencyMs": {"type": "number"}, "version": {"type": "string"}}),
        &["ok"],
    )
}

fn list_sessions_out() -> Value {
    out(
        json!({"sessions": {"type": "array", "items": {"type": "object", "properties": {
            "sessionId": {"type": "string"}, "template": {"type": "string"}, "state": {"type": "string"}
        }, "required": ["sessionId"]}}}),
        &["sessions"],
    )
}

fn destroy_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "destroyed": {"type": "boolean"}}),
        &["sessionId", "destroyed"],
    )
}

fn start_process_in() -> Value {
    let mut p = exec_props();
    p.insert(
        "tag".into(),
        json!({"type": "string", "maxLength": 256, "description": "Label for listings"}),
    );
    obj(Value::Object(p), &["sessionId", "command"])
}

fn start_process_out() -> Value {
    out(
        json!({"sessionId": {"type": "string"}, "procId": {"type": "integer"}, "pid": {"type": "integer"}}),
        &["sessionId", "procId", "pid"],
    )
}

fn proc_id() -> Value {
    json!({"type": "integer", "minimum": 1, "description": "procId from start_process"})
}

fn read_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(),
               "offset": {"type": "integer", "minimum": 0, "description": "Output offset to read from (default 0)"},
               "waitMs": {"type": "integer", "minimum": 0, "maximum": 60000,
                          "description": "How long to wait for output (default 200)"}}),
        &["sessionId", "procId"],
    )
}

fn read_process_out() -> Value {
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

fn write_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(), "input": {"type": "string"},
               "eof": {"type": "boolean", "description": "Close stdin after writing"}}),
        &["sessionId", "procId"],
    )
}

fn write_process_out() -> Value {
    out(
        json!({"procId": {"type": "integer"}, "bytes": {"type": "integer"}, "eof": {"type": "boolean"}}),
        &["procId", "bytes", "eof"],
    )
}

fn kill_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id(),
               "signal": {"description": "Signal name (TERM, KILL, INT, HUP, ...; SIG before it or not, any case) \
                                          or number; default TERM",
                          "anyOf": [{"type": "string", "pattern": Signal::name_pattern()},
                                    {"type": "integer", "minimum": signal::RANGE.start(), "maximum": signal::RANGE.end()}]}}),
        &["sessionId", "procId"],
    )
}

fn kill_process_out() -> Value {
    out(
        json!({"procId": {"type": "integer"}, "signal": {"type": "integer"}, "success": {"type": "boolean"}}),
        &["procId", "signal", "success"],
    )
}

fn get_process_in() -> Value {
    obj(
        json!({"sessionId": sid(), "procId": proc_id()}),
        &["sessionId", "procId"],
    )
}

/// An entry of REST's process list (`ops::procs::proc_json`).
fn get_process_out() -> Value {
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

fn kill_all_out() -> Value {
    out(
        json!({"killed": {"type": "integer", "description": "processes found"},
               "remaining": {"type": "integer", "description": "still there when the sandbox stopped waiting (normally 0)"}}),
        &["killed", "remaining"],
    )
}

// ---- argument helpers ---------------------------------------------------------

fn opt_str(a: &Map<String, Value>, k: &str) -> Result<Option<String>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(format!(
            "argument {k} must be a string, not {}",
            super::jsonrpc::type_name(v)
        )),
    }
}

fn req_str(a: &Map<String, Value>, k: &str) -> Result<String, String> {
    opt_str(a, k)?.ok_or_else(|| format!("argument {k} is required"))
}

fn opt_u64(a: &Map<String, Value>, k: &str) -> Result<Option<u64>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("argument {k} must be a non-negative integer")),
    }
}

fn opt_f64(a: &Map<String, Value>, k: &str) -> Result<Option<f64>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0 && *f < 1e9)
            .map(Some)
            .ok_or_else(|| format!("argument {k} must be a positive number")),
    }
}

fn opt_bool(a: &Map<String, Value>, k: &str) -> Result<Option<bool>, String> {
    match a.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(format!("argument {k} must be a boolean")),
    }
}

fn opt_env(a: &Map<String, Value>) -> Result<BTreeMap<String, String>, String> {
    let env: BTreeMap<String, String> = match a.get("env") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|_| "argument env must be an object of strings".to_string())?,
    };
    validate::env(env).map_err(op_msg)
}

/// Rejects arguments the schema does not name (a typo should not be ignored).
fn known_only(a: &Map<String, Value>, schema: &Value) -> Result<(), String> {
    let props = &schema["properties"];
    for k in a.keys() {
        if props.get(k).is_none() {
            let names: Vec<&String> = props
                .as_object()
                .map(|m| m.keys().collect())
                .unwrap_or_default();
            return Err(format!(
                "unknown argument {k:?} (expected one of {names:?})"
            ));
        }
    }
    Ok(())
}

/// An operation's error as the tools have always worded it; everything
/// else reads as REST's message ([`OpsError::message`]).
fn op_msg(e: impl Into<OpsError>) -> String {
    match e.into() {
        OpsError::SessionNotFound { id } => format!(
            "no session {id:?} (create one with create_session, or list them with list_sessions)"
        ),
        OpsError::TimeoutTooLong { max, .. } => {
            format!("timeout exceeds the maximum of {max} ms")
        }
        OpsError::UnexpectedAnswer(a) => format!("unexpected agent answer {a}"),
        other => other.message(),
    }
}

fn session_id(a: &Map<String, Value>) -> Result<String, String> {
    let id = req_str(a, "sessionId")?;
    validate::session_id(&id).map_err(op_msg)?;
    Ok(id)
}

fn own_session(ctx: &ToolCtx, id: &str) -> Result<Arc<Session>, String> {
    ctx.host.ops.find(ctx.caller, None, id).map_err(op_msg)
}

fn wait(ctx: &ToolCtx) -> Duration {
    ctx.host.ops.cfg.create_timeout
}

/// A session as the tools show it.
fn session_json(v: &SessionView) -> Value {
    json!({
        "sessionId": v.session_id,
        "template": v.template,
        "state": v.state,
        "vcpus": v.vcpus,
        "memoryMib": v.memory_mib,
        "diskMib": v.disk_mib,
        "createdAt": v.created_at,
        "expiresAt": v.expires_at,
    })
}

fn new_id() -> Result<String, String> {
    sessions::new_id().map_err(op_msg)
}

// ---- handlers ---------------------------------------------------------------

/// `egress` as a mode or a policy object (checked by the operation).
fn egress(v: Option<&Value>) -> Result<Option<EgressPolicy>, String> {
    let p = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(m)) => {
            let mode: EgressMode = serde_json::from_value(Value::String(m.clone()))
                .map_err(|_| format!("egress {m:?}: want internet, none, allowlist or denylist"))?;
            EgressPolicy {
                mode,
                ..Default::default()
            }
        }
        Some(o) => serde_json::from_value(o.clone()).map_err(|e| format!("egress: {e}"))?,
    };
    Ok(Some(p))
}

fn create_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &create_session_in())?;
    let id = opt_str(a, "sessionId")?;
    if let Some(id) = &id {
        validate::session_id(id).map_err(op_msg)?;
    }
    let template = opt_str(a, "template")?;
    let empty = Map::new();
    let limits = match a.get("limits") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err("argument limits must be an object".into()),
    };
    known_only(limits, &create_session_in()["properties"]["limits"])?;
    // Within what any request may ask; the session manager then checks the
    // configured and host maxima.
    let range = |k: &str, r: &std::ops::RangeInclusive<u32>| -> Result<Option<u32>, String> {
        opt_u64(limits, k)?
            .map(|v| check_range(&format!("limits.{k}"), v, r).map_err(op_msg))
            .transpose()
    };
    let spec = SessionSpec {
        id,
        template,
        vcpus: range("vcpus", &VCPUS)?,
        memory_mib: range("memoryMib", &MEM_MIB)?,
        disk_mib: range("diskMib", &DISK_MIB)?,
        ttl: opt_f64(limits, "ttl")?.map(Span::Secs),
        idle_timeout: opt_f64(limits, "idleTimeout")?.map(Span::Secs),
        env: opt_env(a)?,
        egress: egress(a.get("egress"))?,
    };
    let s = ctx.host.ops.create(ctx.caller, spec).map_err(op_msg)?;
    (ctx.created)(&s.id);
    ctx.host.ops.ready(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

/// Validates seed-style arguments as a command ([`ExecSpec::prepare`]).
fn exec_spec(ctx: &ToolCtx, a: &Map<String, Value>, background: bool) -> Result<Prepared, String> {
    let command = req_str(a, "command")?;
    if command.is_empty() {
        return Err("command must not be empty".into());
    }
    let args: Option<Vec<String>> = match a.get("args") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value(v.clone())
                .map_err(|_| "argument args must be an array of strings".to_string())?,
        ),
    };
    let spec = ExecSpec {
        command: Some(command),
        args,
        cwd: opt_str(a, "cwd")?,
        env: Some(opt_env(a)?),
        timeout: opt_u64(a, "timeout")?,
        background: Some(background),
        tag: opt_str(a, "tag")?,
        ..Default::default()
    };
    let mut p = spec.prepare(&ctx.host.ops.cfg).map_err(op_msg)?;
    // No process id in MCP's answers: the guest need not report it.
    p.req.notify_start = false;
    Ok(p)
}

fn execute(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &execute_in())?;
    let id = match opt_str(a, "sessionId")? {
        Some(id) => {
            validate::session_id(&id).map_err(op_msg)?;
            id
        }
        None => new_id()?,
    };
    let template = opt_str(a, "template")?;
    let (s, created) = ctx
        .host
        .ops
        .open(ctx.caller, &id, template)
        .map_err(op_msg)?;
    if created {
        (ctx.created)(&id);
    }
    let prepared = exec_spec(ctx, a, false)?;
    let timeout = prepared.timeout;
    let t0 = Instant::now();
    let mut running = ctx.host.ops.exec_in(&s, prepared).map_err(op_msg)?.running;
    running.set_what("execute");
    let deadline = Instant::now() + timeout + Duration::from_secs(30);
    // Kept well inside one message (clients bound what they buffer).
    let mut output = Captured::new(ctx.host.ops.cfg.max_output.min(super::MAX_MESSAGE / 2));
    let mut seen = 0u64;
    let status = loop {
        if (ctx.stop)() {
            // Cancel in the guest and wait (briefly) for the process to be
            // gone, so a cancelled command never outlives its call.
            running.cancel();
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end {
                match running.poll(Duration::from_millis(50)) {
                    Ok(Some(ExecEvent::Exited(_) | ExecEvent::Background { .. })) | Err(_) => break,
                    _ => {}
                }
            }
            ctx.host
                .ops
                .mgr
                .metrics
                .exec_done("cancelled", t0.elapsed());
            return Err("cancelled".into());
        }
        if Instant::now() > deadline {
            return Err(format!("no answer from the sandbox within {timeout:?}"));
        }
        match running.poll(Duration::from_millis(100)) {
            Ok(Some(ExecEvent::Output { stream, bytes })) => {
                seen += bytes.len() as u64;
                if let Some(p) = ctx.progress {
                    let text: String = String::from_utf8_lossy(&bytes).chars().take(2000).collect();
                    p(seen as f64, text);
                }
                output.push(stream, &bytes);
            }
            Ok(Some(ExecEvent::Exited(st))) => break st,
            Ok(Some(ExecEvent::Background { proc, pid })) => {
                return Err(format!(
                    "unexpected agent answer {:?}",
                    Response::Started { proc, pid }
                ))
            }
            Ok(_) => {}
            Err(e) => return Err(op_msg(e)),
        }
    };
    let took = t0.elapsed();
    ctx.host
        .ops
        .mgr
        .metrics
        .exec_done(ops_exec::outcome(&status), took);
    let mut v = json!({
        "sessionId": id,
        "exitCode": ops_exec::exit_code(&status),
        "signal": status.signal.map(Signal::name_of),
        "timedOut": status.timed_out,
        "stdout": String::from_utf8_lossy(&output.stdout),
        "stderr": String::from_utf8_lossy(&output.stderr),
        "truncated": output.truncated,
        "duration": took.as_millis() as u64,
    });
    for (k, x) in ops_exec::usage_fields(&status) {
        v[k] = x;
    }
    Ok(v.into())
}

fn run_code(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    let cfg = &ctx.host.ops.cfg;
    let r = crate::ops::run::RunRequest::parse(&Value::Object(a.clone()), cfg)
        .map_err(|e| e.message())?;
    // Kept well inside one message (clients bound what they buffer).
    let max = cfg.max_output.min(super::MAX_MESSAGE / 2);
    let p = ctx.caller.clone();
    let r = ctx
        .host
        .ops
        .run(&p, r, max, ctx.stop)
        .map_err(|e| e.message())?;
    Ok(r.json().into())
}

fn list_templates(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &empty_in())?;
    Ok(json!({"templates": ctx.host.ops.mgr.templates()}).into())
}

fn write_file(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &write_file_in())?;
    let id = session_id(a)?;
    let path = req_str(a, "path")?;
    validate::path(&path, "path").map_err(op_msg)?;
    let content = req_str(a, "content")?;
    let data = match opt_str(a, "encoding")?.as_deref() {
        None | Some("utf8") => content.into_bytes(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(content.as_bytes())
            .map_err(|e| format!("content is not valid base64: {e}"))?,
        Some(o) => return Err(format!("encoding {o:?}: want utf8 or base64")),
    };
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let n = files::write(&s, &path, &data, None, wait(ctx)).map_err(op_msg)?;
    Ok(json!({"sessionId": id, "path": path, "bytes": n}).into())
}

fn read_file(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &path_in())?;
    let id = session_id(a)?;
    let path = req_str(a, "path")?;
    validate::path(&path, "path").map_err(op_msg)?;
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let mut lease = ctx
        .host
        .ops
        .mgr
        .replies
        .admit()
        .map_err(|e| e.to_string())?;
    // Base64 grows 4/3 and must fit in one message.
    let max = (super::MAX_MESSAGE as u64 / 2).min(ctx.host.ops.cfg.max_file as u64);
    let data = files::read(&s, &mut lease, &path, max, wait(ctx)).map_err(op_msg)?;
    // Text that JSON escapes to more than its base64 (control bytes take
    // six bytes each) goes as base64 too: the answer stays within 4/3.
    let as_text = std::str::from_utf8(&data)
        .is_ok_and(|t| crate::budget::json_len(t) <= files::base64_len(t.len()) + 2);
    let c = files::content(&mut lease, &path, data, !as_text).map_err(op_msg)?;
    // The structured copy and the one in the text block.
    lease
        .grow(2 * c.content.len() as u64)
        .map_err(|e| e.to_string())?;
    if c.encoding == "utf8" {
        return Ok(
            json!({"path": path, "size": c.size, "encoding": "utf8", "content": c.content}).into(),
        );
    }
    let uri = format!("sandbox://{id}/{}", path.trim_start_matches('/'));
    let b64 = c.content;
    Ok(ToolOut {
        structured: json!({"path": path, "size": c.size, "encoding": "base64", "content": b64}),
        extra: vec![json!({"type": "resource", "resource": {
            "uri": uri, "mimeType": "application/octet-stream", "blob": b64}})],
    })
}

fn list_files(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &list_files_in())?;
    let id = session_id(a)?;
    let path = opt_str(a, "path")?.unwrap_or_else(|| ".".into());
    validate::path(&path, "path").map_err(op_msg)?;
    let recursive = opt_bool(a, "recursive")?.unwrap_or(false);
    let s = own_session(ctx, &id)?;
    let _a = s.activity();
    let mut lease = ctx
        .host
        .ops
        .mgr
        .replies
        .admit()
        .map_err(|e| e.to_string())?;
    let l = files::list(&s, &mut lease, &path, recursive, wait(ctx)).map_err(op_msg)?;
    // Sized before it becomes a `Value` (ten times the bytes).
    let len = crate::budget::json_len(&l);
    if len > super::MAX_MESSAGE / 2 {
        return Err(crate::budget::too_large(
            len,
            super::MAX_MESSAGE / 2,
            "list a subdirectory, or without recursive",
        )
        .to_string());
    }
    lease.grow(10 * len as u64).map_err(|e| e.to_string())?;
    Ok(serde_json::to_value(&l)
        .map_err(|e| format!("listing: {e}"))?
        .into())
}

fn ping(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &ping_in())?;
    let version = env!("CARGO_PKG_VERSION");
    match opt_str(a, "sessionId")? {
        None => Ok(json!({"ok": true, "version": version}).into()),
        Some(id) => {
            validate::session_id(&id).map_err(op_msg)?;
            let s = own_session(ctx, &id)?;
            let t = Instant::now();
            ctx.host.ops.ping(&s).map_err(op_msg)?;
            Ok(json!({"ok": true, "sessionId": id, "version": version,
                      "latencyMs": t.elapsed().as_secs_f64() * 1000.0})
            .into())
        }
    }
}

fn reset_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    let old = own_session(ctx, &id)?;
    let s = ctx.host.ops.reset(old, "reset by MCP").map_err(op_msg)?;
    (ctx.created)(&id);
    ctx.host.ops.ready(&s).map_err(op_msg)?;
    Ok(session_json(&SessionView::of(&s)).into())
}

fn list_sessions(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &empty_in())?;
    let v: Vec<Value> = ctx
        .host
        .ops
        .list(ctx.caller, false)
        .iter()
        .map(session_json)
        .collect();
    Ok(json!({"sessions": v}).into())
}

fn destroy_session(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    if !ctx.host.ops.delete(&ctx.caller.id, &id, "destroyed by MCP") {
        return Err(format!("no session {id:?}"));
    }
    Ok(json!({"sessionId": id, "destroyed": true}).into())
}

fn start_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &start_process_in())?;
    let id = session_id(a)?;
    let s = own_session(ctx, &id)?;
    let prepared = exec_spec(ctx, a, true)?;
    let mut running = ctx.host.ops.exec_in(&s, prepared).map_err(op_msg)?.running;
    running.set_what("start process");
    loop {
        match running.next(None).map_err(op_msg)? {
            ExecEvent::Background { proc, pid } => {
                return Ok(json!({"sessionId": id, "procId": proc, "pid": pid}).into())
            }
            ExecEvent::Exited(st) => {
                return Err(format!(
                    "unexpected agent answer {:?}",
                    Response::Exited(st)
                ))
            }
            _ => {}
        }
    }
}

fn req_proc(a: &Map<String, Value>) -> Result<u64, String> {
    opt_u64(a, "procId")?
        .filter(|&p| p > 0)
        .ok_or_else(|| "argument procId is required (a positive integer)".to_string())
}

fn read_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &read_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let offset = opt_u64(a, "offset")?.unwrap_or(0);
    let wait_ms = opt_u64(a, "waitMs")?.unwrap_or(200).min(60_000);
    let s = own_session(ctx, &id)?;
    // The agent replays a background process's buffer from its absolute
    // start; we skip what the caller already has.
    let mut running = ctx
        .host
        .ops
        .attach(&s, proc, false, true)
        .map_err(|e| e.message())?;
    running.set_what(format!("process {proc}"));
    let end = Instant::now() + Duration::from_millis(wait_ms);
    let mut pos = 0u64;
    let mut dropped = 0u64;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let cap = (super::MAX_MESSAGE / 4) as u64;
    let mut exit = None;
    loop {
        if (ctx.stop)() {
            return Err("cancelled".into());
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match running.poll(left.min(Duration::from_millis(100))) {
            Ok(None) => {}
            Ok(Some(ExecEvent::Dropped { bytes })) => {
                let lost_end = pos + bytes;
                if lost_end > offset {
                    dropped += lost_end - offset.max(pos);
                }
                pos = lost_end;
            }
            Ok(Some(ExecEvent::Output { stream, bytes })) => {
                let n = bytes.len() as u64;
                if pos + n > offset {
                    let start = pos.max(offset);
                    let piece = &bytes[(start - pos) as usize..];
                    let total = (out.len() + err.len()) as u64;
                    let take = (piece.len() as u64).min(cap.saturating_sub(total)) as usize;
                    let buf = match stream {
                        ops_exec::Stream::Stderr => &mut err,
                        ops_exec::Stream::Stdout => &mut out,
                    };
                    buf.extend_from_slice(&piece[..take]);
                    if take < piece.len() {
                        // The rest is left for the next read.
                        pos = start + take as u64;
                        break;
                    }
                }
                pos += n;
            }
            Ok(Some(ExecEvent::Exited(st))) => {
                exit = Some(st);
                break;
            }
            Ok(Some(ExecEvent::Background { .. })) | Err(OpsError::UnexpectedAnswer(_)) => break,
            Ok(Some(ExecEvent::Started { .. })) => {}
            Err(e) => return Err(e.message()),
        }
    }
    drop(running);
    let (code, signal) = match &exit {
        Some(st) => (
            json!(ops_exec::exit_code(st)),
            json!(st.signal.map(Signal::name_of)),
        ),
        None => (Value::Null, Value::Null),
    };
    Ok(json!({
        "procId": proc,
        "stdout": String::from_utf8_lossy(&out),
        "stderr": String::from_utf8_lossy(&err),
        "nextOffset": pos.max(offset),
        "dropped": dropped,
        "running": exit.is_none(),
        "exitCode": code,
        "signal": signal,
    })
    .into())
}

fn write_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &write_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let input = opt_str(a, "input")?.unwrap_or_default();
    let eof = opt_bool(a, "eof")?.unwrap_or(false);
    let s = own_session(ctx, &id)?;
    let mut running = ctx
        .host
        .ops
        .attach(&s, proc, true, false)
        .map_err(|e| e.message())?;
    running.set_what("write stdin");
    running
        .send_input(input.as_bytes(), eof)
        .map_err(|e| e.message())?;
    // An unknown process fails at once.
    if let Err(e) = running.poll(Duration::from_millis(20)) {
        if e.is_agent_refusal() {
            return Err(e.with_what(format!("process {proc}")).message());
        }
    }
    Ok(json!({"procId": proc, "bytes": input.len(), "eof": eof}).into())
}

/// `kill_process`'s `signal` as REST's `POST .../signal` reads it (the one
/// [`Signal`] table); absent or null: SIGTERM.
pub(crate) fn signal_arg(v: Option<&Value>) -> Result<Signal, String> {
    match v {
        None | Some(Value::Null) => Ok(Signal::TERM),
        Some(v) => Signal::deserialize(v).map_err(|e| e.to_string()),
    }
}

fn kill_all_processes(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &session_id_in())?;
    let id = session_id(a)?;
    let s = own_session(ctx, &id)?;
    // REST's wording throughout, an odd answer too ("unexpected answer").
    let k = ctx.host.ops.kill_all(&s).map_err(|e| e.message())?;
    Ok(json!({"killed": k.processes, "remaining": k.remaining}).into())
}

fn kill_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &kill_process_in())?;
    let id = session_id(a)?;
    let proc = req_proc(a)?;
    let sig = signal_arg(a.get("signal"))?;
    let s = own_session(ctx, &id)?;
    ctx.host
        .ops
        .signal(&s, proc, sig)
        .map_err(|e| e.with_what(format!("signal process {proc}")).message())?;
    Ok(json!({"procId": proc, "signal": sig.number(), "success": true}).into())
}

fn get_process(ctx: &ToolCtx, a: &Map<String, Value>) -> ToolResult {
    known_only(a, &get_process_in())?;
    let s = own_session(ctx, &session_id(a)?)?;
    let p = ctx
        .host
        .ops
        .proc_info(&s, req_proc(a)?)
        .map_err(|e| e.message())?;
    Ok(procs::proc_json(&p).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// REST's `POST .../signal` body and MCP's `kill_process` argument take
    /// and refuse the same inputs, as the same numbers.
    #[test]
    fn rest_and_mcp_read_signals_alike() {
        let cases: &[(Option<Value>, Option<i32>)] = &[
            (None, Some(15)),
            (Some(Value::Null), Some(15)),
            (Some(json!(9)), Some(9)),
            (Some(json!(9.0)), Some(9)),
            (Some(json!(1)), Some(1)),
            (Some(json!(64)), Some(64)),
            (Some(json!("KILL")), Some(9)),
            (Some(json!("SIGKILL")), Some(9)),
            (Some(json!("sigterm")), Some(15)),
            (Some(json!("Usr1")), Some(10)),
            (Some(json!("SIGSEGV")), Some(11)),
            (Some(json!("stop")), Some(19)),
            (Some(json!("9")), None),
            (Some(json!("SIG9")), None),
            (Some(json!("SIGSIGTERM")), None),
            (Some(json!("BOGUS")), None),
            (Some(json!("")), None),
            (Some(json!(0)), None),
            (Some(json!(65)), None),
            (Some(json!(-9)), None),
            (Some(json!(9.5)), None),
            (Some(json!(4_294_967_305_u64)), None),
            (Some(json!(u64::MAX)), None),
            (Some(json!(true)), None),
            (Some(json!(["KILL"])), None),
            (Some(json!({"name": "KILL"})), None),
        ];
        for (case, want) in cases {
            // REST's body field is an optional `Signal`, absent: SIGTERM.
            let rest = match case {
                Some(v) => serde_json::from_value::<Option<Signal>>(v.clone()),
                None => Ok(None),
            }
            .map(|s| s.unwrap_or(Signal::TERM).number());
            let mcp = signal_arg(case.as_ref()).map(Signal::number);
            assert_eq!(rest.as_ref().ok(), want.as_ref(), "REST {case:?}: {rest:?}");
            assert_eq!(mcp.as_ref().ok(), want.as_ref(), "MCP {case:?}: {mcp:?}");
        }
    }

    /// docs/openapi.yaml's signal schema is the table's: its numbers and
    /// the pattern of its names.
    #[test]
    fn openapi_spells_the_signal_table() {
        let spec: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(include_str!("../../docs/openapi.yaml")).unwrap();
        let one_of = &spec["paths"]["/v1/sessions/{session}/processes/{proc}/signal"]["post"]
            ["requestBody"]["content"]["application/json"]["schema"]["properties"]["signal"]
            ["oneOf"];
        let start = i64::from(*signal::RANGE.start());
        let end = i64::from(*signal::RANGE.end());
        assert_eq!(
            (one_of[0]["minimum"].as_i64(), one_of[0]["maximum"].as_i64()),
            (Some(start), Some(end))
        );
        assert_eq!(
            one_of[1]["pattern"].as_str(),
            Some(Signal::name_pattern().as_str())
        );
    }
}
