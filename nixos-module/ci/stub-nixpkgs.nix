# A stand-in for nixpkgs, just big enough to evaluate this repository's Nix
# code where nixpkgs cannot be fetched (.ci/nix-check). Derivations are plain
# attribute sets with an outPath, so string interpolation works and build
# scripts can be inspected; nothing is built. It proves the code's logic and
# shape, not that nixpkgs' real functions accept it.
let
  leaf = name: { outPath = "/nix/store/${builtins.substring 0 32 (builtins.hashString "sha256" name)}-${name}"; inherit name; };
  drv = name: attrs: leaf name // attrs // {
    overrideAttrs = f: drv name (attrs // f attrs);
    static = leaf "${name}-static";
  };
  # nixpkgs lib/strings.nix: a string of only [[:alnum:],._+:@%/-] (at
  # least one character) is returned as is, anything else single-quoted
  # with ' written as '\''. (Old nixpkgs always quoted.) ci/eval.nix checks
  # this against nixpkgs' documented examples.
  escapeShellArg = arg:
    let string = toString arg; in
    if builtins.match "[[:alnum:],._+:@%/-]+" string == null
    then "'" + builtins.replaceStrings [ "'" ] [ "'\\''" ] string + "'"
    else string;
  regexSpecials = [ "\\" "[" "]" "{" "}" "(" ")" "^" "$" "?" "*" "+" "|" "." ];
  escapeRegex = builtins.replaceStrings regexSpecials (map (c: "\\" + c) regexSpecials);

  lib = rec {
    inherit (builtins) attrNames mapAttrs concatStringsSep;
    hasInfix = infix: s: builtins.match ".*${escapeRegex infix}.*" s != null;
    inherit escapeShellArg;
    escapeShellArgs = l: concatStringsSep " " (map escapeShellArg l);
    concatLines = l: concatStringsSep "" (map (x: x + "\n") l);
    getAttrs = names: attrs: builtins.listToAttrs (map (n: { name = n; value = attrs.${n}; }) names);
    genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
    optional = c: x: if c then [ x ] else [ ];
    optionalString = c: s: if c then s else "";
    mkIf = condition: content: { _type = "if"; inherit condition content; };
    mkDefault = content: { _type = "override"; priority = 1000; inherit content; };
    mkForce = content: { _type = "override"; priority = 50; inherit content; };
    getLib = p: p.lib or p;
    getExe = p: "${p}/bin/${p.meta.mainProgram or p.pname or p.name}";
    toInt = builtins.fromJSON;
    last = l: builtins.elemAt l (builtins.length l - 1);
    splitString = sep: s: builtins.filter builtins.isString (builtins.split (escapeRegex sep) s);
    mkOption = o: o // { _type = "option"; };
    mkEnableOption = d: mkOption { default = false; description = d; type = types.bool; };
    literalMD = text: { _type = "literalMD"; inherit text; };
    literalExpression = text: { _type = "literalExpression"; inherit text; };
    types = {
      package = "package";
      str = "str";
      port = "port";
      bool = "bool";
      nullOr = t: { nullOr = t; };
      enum = l: { enum = l; };
      attrsOf = t: { attrsOf = t; };
      listOf = t: { listOf = t; };
      submodule = m: { submodule = m; };
      ints = { between = lo: hi: { between = [ lo hi ]; }; positive = "positive"; };
    };
    importTOML = p: builtins.fromTOML (builtins.readFile p);
    fileset = {
      toSource = { root, fileset }: leaf "source" // { inherit root fileset; };
      unions = l: { unions = l; };
      difference = a: b: { difference = [ a b ]; };
      fileFilter = f: p: { fileFilter = p; inherit f; };
      maybeMissing = p: p;
    };
    licenses.asl20 = "asl20";
    platforms.linux = [ "x86_64-linux" "aarch64-linux" ];
  };

  pkgs = {
    inherit lib;
    callPackage = f: args:
      let fn = if builtins.isFunction f then f else import f;
      in fn (builtins.mapAttrs (n: _: args.${n} or pkgs.${n} or (leaf n)) (builtins.functionArgs fn));
    stdenv = {
      mkDerivation = a: drv (a.pname or a.name) a;
      hostPlatform = { system = "x86_64-linux"; isx86_64 = true; };
    };
    rustPlatform.buildRustPackage = a: drv a.pname (a // { nativeBuildInputs = a.nativeBuildInputs or [ ]; });
    linuxManualConfig = a: drv "linux" a;
    runCommand = name: attrs: script: drv name (attrs // { inherit script; });
    writeText = name: text: drv name { inherit text; };
    writeShellScriptBin = name: text: drv name { inherit text; };
    writeShellApplication = a: drv a.name a;
    buildEnv = a: drv a.name a;
    closureInfo = a: drv "closure-info" a;
    mkShell = a: drv "shell" a;
    formats.json = _: {
      type = "json";
      generate = name: value: drv name { json = builtins.toJSON value; };
    };
    python3 = leaf "python3" // { withPackages = f: leaf "python3-env" // { packages = f { mcp = "mcp"; pip = "pip"; setuptools = "setuptools"; }; }; };
    testers.runNixOSTest = t: drv "nixos-test-${t.name}" t;
    # A firecracker package as before nixpkgs PR #460374 (its postPatch
    # without the seccompiler and cpu-template-helper substitutions).
    pkgsStatic = {
      firecracker = drv "firecracker-static" {
        postPatch = ''
          substituteInPlace $cargoDepsCopy/aws-lc-sys-*/aws-lc/crypto/asn1/a_bitstr.c \
            --replace-warn '(len > INT_MAX - 1)' '(len < 0 || len > INT_MAX - 1)'
        '';
      };
      libseccomp = leaf "libseccomp-static-lib";
    };
    qemu_kvm = leaf "qemu";
    haproxy = leaf "haproxy";
    coreutils = leaf "coreutils";
    glibc = drv "glibc" { };
    linux_6_1 = leaf "linux-6.1" // { version = "6.1.999"; src = leaf "linux-6.1-src"; };
  };
in
{
  inherit lib pkgs leaf drv;
  # What flake.nix receives as `nixpkgs`.
  nixpkgs = {
    inherit lib;
    legacyPackages = { x86_64-linux = pkgs; aarch64-linux = pkgs; };
  };
}
