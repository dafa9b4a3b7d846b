# `nix run`: a one-shot host on 127.0.0.1 with the kernel, root filesystems,
# Firecracker and jailer (and QEMU, for hosts without usable KVM) baked in.
# The state directory holds the config, the API key file and the snapshots;
# the daemon makes each template's snapshot on its first start there.
{ lib
, writeShellApplication
, writeText
, coreutils
, jq
, agent-sandbox
, cli
, artifacts
, defaults
}:
let
  baseSettings = defaults // artifacts;
  baseConfig = writeText "agent-sandbox-base-config.json" (builtins.toJSON baseSettings);
  # Keys known only at run time, as shell words the script expands
  # (snapshots go in the state dir: the first start makes them there).
  runtimeSettings = {
    state_dir = "$state";
    keys_file = "$state/keys.json";
    snapshot_dir = "$state";
    backend = "$backend";
    listen = "127.0.0.1:$port";
  };
  runtimeKeys = builtins.attrNames runtimeSettings;
  jqArgs = builtins.concatStringsSep " " (map (k: "--arg ${k} \"${runtimeSettings.${k}}\"") runtimeKeys);
  jqFilter = ". + {" + builtins.concatStringsSep ", " (map (k: "${k}: \$${k}") runtimeKeys) + "}";
  configMark = "@CONFIG@";
  serve = map (a: if a == configMark then ''"$state/config.json"'' else lib.escapeShellArg a)
    (cli.serve { package = agent-sandbox; configFile = configMark; });
in
writeShellApplication {
  name = "agent-sandbox-host";
  runtimeInputs = [ coreutils jq ];
  text = ''
    backend=''${AGENT_SANDBOX_BACKEND:-firecracker}
    port=''${AGENT_SANDBOX_PORT:-3000}
    if [ -n "''${AGENT_SANDBOX_STATE_DIR:-}" ]; then
      state=$AGENT_SANDBOX_STATE_DIR
    elif [ "$(id -u)" -eq 0 ]; then
      state=/var/lib/agent-sandbox
    else
      state=''${XDG_STATE_HOME:-$HOME/.local/state}/agent-sandbox
    fi
    if [ "$backend" = firecracker ] && [ "$(id -u)" -ne 0 ]; then
      echo "agent-sandbox: the Firecracker backend runs VMs through the jailer, which needs root." >&2
      echo "  run as root (sudo nix run ...), or AGENT_SANDBOX_BACKEND=qemu for an unjailed QEMU host" >&2
      exit 1
    fi
    mkdir -p "$state"
    chmod 0700 "$state"
    jq ${jqArgs} '${jqFilter}' ${baseConfig} > "$state/config.json.tmp"
    mv "$state/config.json.tmp" "$state/config.json"
    echo "agent-sandbox: listening on http://127.0.0.1:$port ($backend backend)" >&2
    echo "agent-sandbox: API key file: $state/keys.json (made on first start, mode 0600)" >&2
    if ! ls "$state"/snapshots/* >/dev/null 2>&1; then
      echo "agent-sandbox: first start: building snapshots of every template in $state/snapshots" >&2
    fi
    exec ${lib.concatStringsSep " " serve}
  '';
  # The config this script writes, its run-time values still shell words
  # (nixos-module/ci/eval.nix checks it against the daemon's keys).
  passthru.settings = baseSettings // runtimeSettings;
}
