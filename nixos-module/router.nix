# services.agent-sandbox.router: HAProxy in front of several agent-sandbox
# hosts (docs/operations.md, "Several hosts"). The HAProxy config is
# rendered by `agent-sandbox router config` (one definition of the routing,
# in src/router.rs) and checked with `haproxy -c` when the system is built.
# Runs on its own or beside the daemon; each host sets
# services.agent-sandbox.hostId to its entry's id.
{ config, lib, pkgs, ... }:
let
  cfg = config.services.agent-sandbox.router;
  cli = import ./cli.nix;
  haproxy = lib.getExe cfg.haproxyPackage;
  argv = cli.router {
    package = config.services.agent-sandbox.package;
    inherit (cfg) listen hosts previewListen sharedKeys statsListen;
  };
  routerConfig = pkgs.runCommand "agent-sandbox-router.cfg" { } ''
    ${lib.escapeShellArgs argv} > $out
    ${haproxy} -c -q -f $out
  '';
  portOf = addr: lib.toInt (lib.last (lib.splitString ":" addr));
in
{
  options.services.agent-sandbox.router = with lib; {
    enable = mkEnableOption "HAProxy routing every session's requests to the agent-sandbox host that holds it";

    listen = mkOption {
      type = types.str;
      default = "0.0.0.0:3000";
      description = "Where clients reach the API (REST, MCP over HTTP) through the router.";
    };

    hosts = mkOption {
      type = types.listOf (types.submodule {
        options = {
          id = mkOption {
            type = types.str;
            example = "h1";
            description = "The host's services.agent-sandbox.hostId.";
          };
          address = mkOption {
            type = types.str;
            example = "10.0.0.11:3000";
            description = "The host's API address (IP:PORT).";
          };
          preview = mkOption {
            type = types.nullOr types.str;
            default = null;
            example = "10.0.0.11:3001";
            description = "The host's preview listener, when the router serves preview URLs.";
          };
        };
      });
      default = [ ];
      description = ''
        The hosts. Sessions a host makes route back to it by the id's host
        tag; names clients choose route by a consistent hash over this list,
        so adding or removing a host moves about 1/N of those names.
      '';
    };

    previewListen = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "0.0.0.0:3001";
      description = "Where clients reach preview URLs (every host's settings.preview_url names it); null: no preview frontend.";
    };

    sharedKeys = mkOption {
      type = types.bool;
      default = false;
      description = "The hosts read one key file on shared storage, so key changes through the router reach all of them (otherwise the router refuses them).";
    };

    statsListen = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "127.0.0.1:8404";
      description = "HAProxy's read-only stats page (/stats) on this address.";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the router's listen (and preview) ports in the firewall.";
    };

    haproxyPackage = mkOption {
      type = types.package;
      default = pkgs.haproxy;
      defaultText = literalExpression "pkgs.haproxy";
      description = "HAProxy, 2.6 or newer (balance hash, wait-for-body, json_query).";
    };
  };

  config = lib.mkIf cfg.enable {
    assertions = [{
      assertion = cfg.hosts != [ ];
      message = "services.agent-sandbox.router.hosts: name at least one host";
    }];

    # At a stable path for `agent-sandbox doctor --router /etc/agent-sandbox/router.cfg`.
    environment.etc."agent-sandbox/router.cfg".source = routerConfig;

    networking.firewall.allowedTCPPorts = lib.mkIf cfg.openFirewall
      ([ (portOf cfg.listen) ] ++ lib.optional (cfg.previewListen != null) (portOf cfg.previewListen));

    systemd.services.agent-sandbox-router = {
      description = "agent-sandbox router: HAProxy in front of the agent-sandbox hosts";
      wantedBy = [ "multi-user.target" ];
      wants = [ "network-online.target" ];
      after = [ "network-online.target" ];
      serviceConfig = {
        ExecStartPre = "${haproxy} -c -q -f ${routerConfig}";
        ExecStart = "${haproxy} -Ws -f ${routerConfig}";
        ExecReload = "${pkgs.coreutils}/bin/kill -USR2 $MAINPID";
        Type = "notify";
        KillMode = "mixed";
        Restart = "always";
        RestartSec = 1;
        DynamicUser = true;
        # Ports below 1024 (80, 443) without root.
        AmbientCapabilities = [ "CAP_NET_BIND_SERVICE" ];
        CapabilityBoundingSet = [ "CAP_NET_BIND_SERVICE" ];
        NoNewPrivileges = true;
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        PrivateDevices = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        LockPersonality = true;
        MemoryDenyWriteExecute = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        RestrictNamespaces = true;
        RestrictAddressFamilies = [ "AF_UNIX" "AF_INET" "AF_INET6" ];
        SystemCallArchitectures = "native";
        SystemCallFilter = [ "@system-service" ];
        LimitNOFILE = 1048576;
      };
    };
  };
}
