//! The MCP tools: definitions (JSON Schema in and out, fixed order) and
//! handlers that call the operations ([`crate::ops`]) like the REST API
//! does.
//!
//! Tool names and argument names follow the seed (`sessionId`, `command`,
//! `args`, `cwd`, `timeout`, `template`, `path`, `content`) so existing agent
//! configs keep working.

use super::Host;
use crate::ops::exec::{self as ops_exec, Captured, ExecEvent, ExecSpec, Prepared};
use crate::ops::sessions::{
    self as ops_sessions, check_range, Span, DISK_MIB, HOST_MEM_PERCENT, MEM_MIB, VCPUS,
};
use crate::ops::validate;
use crate::ops::{
    files as ops_files, procs, OpsError, Principal, Session, SessionSpec, SessionView, SnapshotView,
};
use crate::ops::{EgressMode, EgressPolicy};
use crate::proto::{signal, Response, Signal};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod args;
mod exec;
mod files;
mod schema;
mod sessions;
mod state;

use args::*;
use exec::*;
use files::*;
use schema::*;
use sessions::*;
use state::*;

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
            Other tools take that sessionId. Sessions are removed when idle for long (or paused, with \
            onIdle=pause), or with destroy_session. fromSnapshot starts it from a checkpoint; count \
            starts several (listed in sessions).",
        input: create_session_in,
        output: create_session_out,
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
    Tool {
        name: "pause_session",
        title: "Pause session",
        description: "Save a session's whole state (processes, files, memory) and stop its VM; it \
            stays listed as paused until resume_session, or any command or file call, restores it \
            where it was. Refused while a command runs (background processes are kept).",
        input: session_id_in,
        output: session_out,
        read_only: false,
        destructive: false,
        run: pause_session,
    },
    Tool {
        name: "resume_session",
        title: "Resume session",
        description: "Restore a paused session where it was (a running session: nothing to do).",
        input: session_id_in,
        output: session_out,
        read_only: false,
        destructive: false,
        run: resume_session,
    },
    Tool {
        name: "checkpoint_session",
        title: "Checkpoint session",
        description: "Save a running session's whole state as a snapshot (it runs on) and return its \
            snapshot id: create_session with fromSnapshot starts new sessions from it, as it was. \
            Refused while a command runs.",
        input: checkpoint_in,
        output: snapshot_out,
        read_only: false,
        destructive: false,
        run: checkpoint_session,
    },
    Tool {
        name: "fork_session",
        title: "Fork session",
        description: "Checkpoint a session and start count copies of it (each its own VM and network, \
            with the source's files, processes and memory); the source runs on. Returns the copies' \
            sessionIds. Refused while a command runs.",
        input: fork_in,
        output: fork_out,
        read_only: false,
        destructive: false,
        run: fork_session,
    },
    Tool {
        name: "list_snapshots",
        title: "List snapshots",
        description: "List the snapshots this caller owns (from checkpoint_session and fork_session), \
            with their size and whether this host can restore them.",
        input: empty_in,
        output: list_snapshots_out,
        read_only: true,
        destructive: false,
        run: list_snapshots,
    },
    Tool {
        name: "delete_snapshot",
        title: "Delete snapshot",
        description: "Delete a snapshot; sessions started from it run on.",
        input: snapshot_id_in,
        output: delete_snapshot_out,
        read_only: false,
        destructive: true,
        run: delete_snapshot,
    },
    Tool {
        name: "expose_port",
        title: "Expose a guest port",
        description: "Open a TCP port of the session's guest (a dev server, a web app) to the \
            outside and return its preview URL, which works for ttl seconds (default an hour). \
            Not public (default): the owner's API key is needed too.",
        input: expose_port_in,
        output: expose_port_out,
        read_only: false,
        destructive: false,
        run: expose_port,
    },
];

pub fn find(name: &str) -> Option<&'static Tool> {
    TOOLS.iter().find(|t| t.name == name)
}

// ---- schemas ----------------------------------------------------------------

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
            serde_yaml_ng::from_str(include_str!("../../../docs/openapi.yaml")).unwrap();
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
