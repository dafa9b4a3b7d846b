# The guest image templates, read from the same JSON files the Debian build
# uses (images/templates/NAME.json, schema in images/templates/schema.json),
# resolved the way images/template.sh resolves them: `extends` puts the
# parent first; packages are the parent's followed by the child's new ones,
# env and scalar fields of the child override, setup/warm/tests append; the
# listing fields (display_name, version, tools: the daemon reads them from
# the files) are left out, so editing them rebuilds no image.
#
# Builtins only (no nixpkgs lib), so .ci/nix-check can evaluate it without
# nixpkgs.
{ templatesDir
, # Debian package name -> (package set -> [ derivation ]); see debian-packages.nix.
  debianPackages ? import ./debian-packages.nix
}:
let
  files = builtins.readDir templatesDir;
  isTemplate = f: files.${f} == "regular" && builtins.match "(.*)\\.json" f != null && f != "schema.json";
  names = map (f: builtins.head (builtins.match "(.*)\\.json" f)) (builtins.filter isTemplate (builtins.attrNames files));

  read = name:
    let t = builtins.fromJSON (builtins.readFile (templatesDir + "/${name}.json"));
    in
    if (t.name or null) != name
    then throw "agent-sandbox: ${toString templatesDir}/${name}.json: field name must be \"${name}\""
    else t;

  dedupe = builtins.foldl' (acc: x: if builtins.elem x acc then acc else acc ++ [ x ]) [ ];

  resolve = depth: name:
    let
      t = read name;
      own = builtins.removeAttrs t [ "extends" "display_name" "version" "tools" ];
    in
    if depth > 8 then throw "agent-sandbox: template ${name}: extends chain too deep (a cycle?)"
    else if !(t ? extends) then own // { chain = [ name ]; tests = t.tests or [ ]; }
    else
      let p = resolve (depth + 1) t.extends;
      in p // own // {
        packages = dedupe (p.packages ++ t.packages);
        env = p.env // t.env;
        setup = p.setup ++ t.setup;
        warm = p.warm ++ t.warm;
        tests = p.tests ++ (t.tests or [ ]);
        chain = p.chain ++ [ name ];
      };

  resolved = builtins.listToAttrs (map (n: { name = n; value = resolve 0 n; }) names);

  # Every Debian name of a template mapped to nixpkgs packages; evaluation
  # stops with the template and package named if the table lacks one.
  nixPackagesOf = pkgs: name:
    let t = resolved.${name};
    in builtins.concatLists (map
      (d:
        if debianPackages ? ${d} then debianPackages.${d} pkgs
        else
          throw ''
            agent-sandbox: template "${name}" (${builtins.concatStringsSep " -> " t.chain}) names the Debian package "${d}",
            which nixos-module/packages/debian-packages.nix does not map to nixpkgs.
            Add it there (the Debian and Nix image builds share the template files).'')
      t.packages);
in
{
  inherit names resolved nixPackagesOf;
}
