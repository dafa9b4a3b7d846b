# The daemon's command line and config file shape, in ONE place: the NixOS
# module, the `nix run` app and the NixOS test all go through here. If the
# daemon's CLI changes, change it here only.
{
  # argv of the long-running host.
  serve = { package, configFile }: [ "${package}/bin/agent-sandbox" "serve" "--config" configFile ];

  # argv of the stdio MCP server forwarding to a running daemon; the key is
  # read from the file named by AGENT_SANDBOX_KEY_FILE or from
  # AGENT_SANDBOX_API_KEY.
  mcp = { package, url }: [ "${package}/bin/agent-sandbox" "mcp" "--url" url ];

  # The config keys that point at built artifacts. `images` maps a template
  # name to its root filesystem image.
  artifacts = { firecracker, kernel, rootfs, qemu, templatesDir }: {
    firecracker = "${firecracker}/bin/firecracker";
    jailer = "${firecracker}/bin/jailer";
    qemu = "${qemu}/bin/qemu-system-x86_64";
    kernel = "${kernel}/vmlinux";
    images = builtins.mapAttrs (_: r: "${r}/rootfs.erofs") rootfs;
    templates_dir = "${templatesDir}";
  };
}
