"""Python SDK for agent-sandbox: a microVM of its own for each AI-agent session.

```python
from agent_sandbox import Sandbox

with Sandbox.create() as sbx:
    print(sbx.commands.run("echo hello").stdout)
```

Sync: `Sandbox`, `Client`. Async, with the same surface: `AsyncSandbox`,
`AsyncClient`. Errors: `agent_sandbox.errors` (one class per API code,
under `SandboxError`). Configuration: `AGENT_SANDBOX_URL`,
`AGENT_SANDBOX_API_KEY`, or the `url`/`api_key` arguments.
"""

from . import errors
from ._core import Config, Retry
from .aio import (
    AsyncClient,
    AsyncCommands,
    AsyncFiles,
    AsyncKeys,
    AsyncNetwork,
    AsyncPorts,
    AsyncProcess,
    AsyncPty,
    AsyncSandbox,
    AsyncSecrets,
    AsyncSnapshots,
    Opening,
)
from .errors import SandboxError
from .models import (
    CommandResult,
    CreatedKey,
    Dropped,
    Egress,
    EntryInfo,
    Event,
    Exited,
    FailedCopy,
    FileStat,
    KeyRecord,
    Output,
    PortInfo,
    ProcessInfo,
    ResourceUsage,
    RunLimits,
    RunResult,
    Secret,
    SecretInfo,
    SessionInfo,
    Snapshot,
    Started,
    Template,
)
from .sandbox import Client, Commands, Files, Keys, Network, Ports, Process, Pty, Sandbox, Secrets, Snapshots, run

__version__ = "0.1.0"

__all__ = [
    "Sandbox",
    "run",
    "Client",
    "Commands",
    "Process",
    "Pty",
    "Files",
    "Network",
    "Secrets",
    "Ports",
    "Keys",
    "Snapshots",
    "AsyncSandbox",
    "AsyncClient",
    "AsyncCommands",
    "AsyncProcess",
    "AsyncPty",
    "AsyncFiles",
    "AsyncNetwork",
    "AsyncSecrets",
    "AsyncPorts",
    "AsyncKeys",
    "AsyncSnapshots",
    "Opening",
    "Config",
    "Retry",
    "SandboxError",
    "errors",
    "CommandResult",
    "ResourceUsage",
    "Event",
    "Started",
    "Output",
    "Dropped",
    "Exited",
    "ProcessInfo",
    "EntryInfo",
    "FileStat",
    "Egress",
    "Secret",
    "SecretInfo",
    "PortInfo",
    "SessionInfo",
    "FailedCopy",
    "Snapshot",
    "RunLimits",
    "RunResult",
    "KeyRecord",
    "CreatedKey",
    "Template",
]
