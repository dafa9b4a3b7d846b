# Debian package name (as written in images/templates/*.json) -> the nixpkgs
# packages that give a guest the same commands.
#
# The templates are written once, in Debian terms, for the plain-Debian image
# build (images/build-rootfs.sh, mmdebstrap). The Nix build reads the same
# files and translates each name through this table. KEEP IT IN SYNC: a
# template naming a package missing here fails evaluation with a message
# naming the template and the package (see templates.nix), so a new package
# cannot be silently dropped from the Nix images.
#
# A value is a function from the package set to a list: some Debian packages
# have no separate nixpkgs counterpart (their files are part of another
# package) and map to [ ].
{
  # base
  bash = p: [ p.bashInteractive ];
  coreutils = p: [ p.coreutils ];
  curl = p: [ p.curl ];
  git = p: [ p.git ];
  ca-certificates = p: [ p.cacert ];
  iproute2 = p: [ p.iproute2 ];
  procps = p: [ p.procps ];
  less = p: [ p.less ];
  xz-utils = p: [ p.xz ];

  # python: nixpkgs' python3 includes venv (Debian splits it out).
  python3 = p: [ (p.python3.withPackages (ps: [ ps.pip ps.setuptools ])) ];
  python3-pip = _: [ ];
  python3-venv = _: [ ];

  # node: nixpkgs' nodejs ships npm.
  nodejs = p: [ p.nodejs ];
  npm = _: [ ];

  # go: the C toolchain for cgo. nixpkgs' gcc is a wrapper that already
  # knows its libc headers and crt files (Debian's libc6-dev).
  golang-go = p: [ p.go ];
  gcc = p: [ p.gcc ];
  libc6-dev = _: [ ];
  make = p: [ p.gnumake ];

  # rust: gcc (above) is rustc's linker (`cc`); libc6-dev is in its wrapper.
  rustc = p: [ p.rustc ];
  cargo = p: [ p.cargo ];

  # dev: nixpkgs' python3 has `python` too; its gcc wrapper has g++ and
  # binutils (Debian's build-essential is a meta package of those).
  python-is-python3 = _: [ ];
  build-essential = p: [ p.gcc p.gnumake ];
  "g++" = _: [ ];
  pkg-config = p: [ p.pkg-config ];
  patch = p: [ p.gnupatch ];
  wget = p: [ p.wget ];
  openssh-client = p: [ p.openssh ];
  netcat-openbsd = p: [ p.netcat-openbsd ];
  iputils-ping = p: [ p.iputils ];
  dnsutils = p: [ p.dnsutils ];
  jq = p: [ p.jq ];
  ripgrep = p: [ p.ripgrep ];
  file = p: [ p.file ];
  tree = p: [ p.tree ];
  xxd = _: [ ]; # in nixpkgs' vim (vim-tiny)
  htop = p: [ p.htop ];
  sqlite3 = p: [ p.sqlite ];
  zip = p: [ p.zip ];
  unzip = p: [ p.unzip ];
  bzip2 = p: [ p.bzip2 ];
  gzip = p: [ p.gzip ];
  tar = p: [ p.gnutar ];
  vim-tiny = p: [ p.vim ];
  nano = p: [ p.nano ];
}
