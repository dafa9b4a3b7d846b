//! The layering rules of `docs/architecture.md`, enforced.
//!
//! Scans `src/**/*.rs` and `guest/src/**/*.rs` for `crate::…`, `super::…`
//! and `sandbox_agent::…` paths (comments and string literals blanked
//! first), builds the dependency graph of the top-level modules and fails
//! on an edge the rules table does not allow. Today's breaches are listed
//! in `DEBT` (issue #20 removes them); that list may only shrink: an entry
//! whose edge no longer exists fails too, so it stays exact. The graph, the
//! submodule graph's cycles and the unsafe-block count are printed as
//! `FIGURE` lines for before/after notes.
//!
//! A second check counts `unsafe` blocks and impls without a `// SAFETY:`
//! comment above them, the way `clippy::undocumented_unsafe_blocks` counts
//! them, against today's exact number: none may be added.
//!
//! Crate roots (`lib.rs`, `main.rs`) are the composition root and are not
//! scanned: they may wire anything together.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Node of the guest crate's wire protocol; the daemon reaches it as
/// `crate::proto` (a re-export) or `sandbox_agent::proto`.
const PROTO: &str = "guest::proto";

/// The poison-tolerant `lock()` (guest crate, re-exported to the daemon
/// as `crate::sync`): one definition every module of both crates may use.
const SYNC: &str = "guest::sync";

/// A submodule counted as a node of its own: the spawner is the
/// privileged process that implements `vm::launch`'s seam, so it sits above
/// `vm`, while the rest of `harden` (thread broker, seccomp, caps) sits
/// below every layer.
const OWN_NODES: &[&str] = &["harden::spawner"];

/// Target rules (issue #20): each module and what it may import. An entry
/// `m` allows all of module `m`; `m::sub` only that submodule. Layers, top
/// to bottom: front ends (api, mcp) -> server -> ops -> session -> sandbox
/// -> vm, net -> agent -> guest::proto; harden, metrics, budget and config
/// are lower layers as listed. `ops`, `server` and `metrics` are the
/// modules issue #20 adds (rename the rows if they get other names). A
/// module without a row fails the test: a new one gets its row, and its
/// place in docs/architecture.md, on purpose.
const RULES: &[(&str, &[&str])] = &[
    // HTTP server (socket, httpd), the shared Ctx, route/`/mcp` dispatch.
    (
        "server",
        &[
            "ops", "config", "budget", "metrics", "harden", "audit", "router",
        ],
    ),
    // Front ends: parse, call one operation, map answer and error at the edge.
    (
        "api",
        &[
            "server", "ops", "config", "budget", "metrics", "harden", "audit", "router", PROTO,
        ],
    ),
    (
        "mcp",
        &[
            "server", "ops", "config", "budget", "metrics", "harden", "router", PROTO,
        ],
    ),
    // Typed operations: validation, limits, ownership, one error enum.
    (
        "ops",
        &[
            "session", "sandbox", "net", "config", "budget", "metrics", "agent", "harden", "audit",
            "router", PROTO,
        ],
    ),
    // Registry, worker threads, pool, reaper: no HTTP statuses, no JSON shapes.
    // `vm::shape`: the one set of session-shape ranges.
    (
        "session",
        &[
            "sandbox",
            "net",
            "config",
            "budget",
            "metrics",
            "agent",
            "harden",
            "audit",
            "vm::shape",
            "router",
            PROTO,
        ],
    ),
    // One sandbox = VM + network + agent connection; wiring builds factories.
    (
        "sandbox",
        &[
            "vm",
            "net",
            "agent",
            "harden",
            "harden::spawner",
            "config",
            "metrics",
            "audit",
            PROTO,
        ],
    ),
    // VM backends and the launch seam (vm::launch) the spawner implements.
    ("vm", &["agent", "net", "harden", "metrics", PROTO]),
    // The privileged spawner: implements vm::launch, nothing else of vm.
    ("harden::spawner", &["harden", "vm::launch"]),
    // Host networking: netns, TAP, nftables, DNS forwarder, egress policy.
    ("net", &["harden", "metrics", "audit"]),
    // The audit log: records of every layer, one writer thread, sinks.
    ("audit", &["harden", "metrics"]),
    // Host side of the wire protocol.
    ("agent", &["harden", PROTO]),
    // Thread broker, seccomp, capabilities: below everything.
    ("harden", &[]),
    // Parsed config: plain data of the layers it configures, no runtime.
    ("config", &["net", "vm", "audit", "router"]),
    // Several hosts behind HAProxy: host-tagged ids and the router's
    // config, one definition of both (a leaf).
    ("router", &[]),
    // Reply-size budget.
    ("budget", &[]),
    // Counters and histograms every layer may use.
    ("metrics", &[]),
    // Admin commands (images, snapshots, doctor): host tooling.
    (
        "admin",
        &["config", "sandbox", "vm", "net", "harden", "router"],
    ),
    // Guest crate: the agent speaks the protocol; the protocol is a leaf.
    ("guest::agent", &[PROTO]),
    (PROTO, &[]),
    // A leaf every module may import (checked below, not listed per row).
    (SYNC, &[]),
];

/// Breaches of `RULES` allowed for now (from, to, what and where): none
/// since issue #20. The list may only shrink: an entry whose edge is gone
/// or now allowed fails the test, so it stays exact. One line per entry.
#[rustfmt::skip]
const DEBT: &[(&str, &str, &str)] = &[
];

/// `unsafe` blocks/impls in src/ and guest/src/ without a `// SAFETY:`
/// comment: today's number (clippy's undocumented_unsafe_blocks agrees).
/// Issue #20 brings it to 0; it may only go down.
const UNDOCUMENTED_UNSAFE: usize = 0;

struct SourceFile {
    /// Path relative to the workspace root, for messages.
    rel: String,
    /// Module path inside its crate, crate prefix included for the guest
    /// (`["api", "rest"]`, `["guest", "agent", "conn"]`).
    module: Vec<String>,
    text: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for e in entries {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every non-root source file of both crates with its module path.
fn sources() -> Vec<SourceFile> {
    let root = root();
    let mut out = Vec::new();
    for (dir, prefix) in [("src", None), ("guest/src", Some("guest"))] {
        let base = root.join(dir);
        let mut files = Vec::new();
        rs_files(&base, &mut files);
        files.sort();
        for p in files {
            let rel_in_crate = p.strip_prefix(&base).expect("under base");
            let mut module: Vec<String> = rel_in_crate
                .with_extension("")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if module.last().is_some_and(|m| m == "mod") {
                module.pop();
            }
            if module.len() == 1 && (module[0] == "lib" || module[0] == "main") {
                continue; // crate root: the composition root
            }
            if let Some(pfx) = prefix {
                module.insert(0, pfx.to_string());
            }
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            let rel = p
                .strip_prefix(&root)
                .expect("under root")
                .display()
                .to_string();
            out.push(SourceFile { rel, module, text });
        }
    }
    assert!(
        out.len() > 50,
        "found only {} source files: wrong root?",
        out.len()
    );
    out
}

/// `src` with comments and the contents of string and char literals
/// replaced by spaces (newlines kept, so line numbers stay right).
fn code_only(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |ch: char| if ch == '\n' { '\n' } else { ' ' };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && (i == 0 || !ident(c[i - 1]) || c[i - 1] == 'b')
            && matches!(next, Some('"') | Some('#'))
            && {
                let mut j = i + 1;
                while c.get(j) == Some(&'#') {
                    j += 1;
                }
                c.get(j) == Some(&'"')
            }
        {
            // Raw string r"…" / r#"…"#: ends at '"' and as many '#'.
            let mut hashes = 0;
            i += 1;
            out.push('r');
            while c[i] == '#' {
                hashes += 1;
                out.push('#');
                i += 1;
            }
            out.push('"');
            i += 1;
            while i < c.len() {
                if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                    out.push('"');
                    i += 1;
                    for _ in 0..hashes {
                        out.push('#');
                        i += 1;
                    }
                    break;
                }
                out.push(blank(c[i]));
                i += 1;
            }
        } else if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < c.len() {
                    out.push(blank(c[i]));
                    i += 1;
                }
            }
            out.push('"');
            i += 1;
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // Char literal ('x', '\n', '\''); a lone quote is a lifetime.
            out.push('\'');
            i += 1;
            if c[i] == '\\' {
                out.push(' ');
                i += 1;
            }
            while i < c.len() && c[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push('\'');
            i += 1;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Open,
    Close,
    Comma,
    Other(char),
}

fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::PathSep, line));
            i += 2;
        } else {
            out.push((
                match ch {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    _ => Tok::Other(ch),
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// One use of another module: the full path it names (from the crate root
/// of the daemon, guest paths under `guest`) and where.
struct Use {
    path: Vec<String>,
    line: usize,
}

/// The identifiers `a::b::c` starting at `toks[i]`, and for a `{…}` group
/// there the first identifier of each item (`{x::y, z}` -> x, z).
fn path_tails(toks: &[(Tok, usize)], mut i: usize) -> Vec<Vec<String>> {
    let mut segs = Vec::new();
    loop {
        match toks.get(i) {
            Some((Tok::Ident(s), _)) => {
                segs.push(s.clone());
                if toks.get(i + 1).map(|t| &t.0) == Some(&Tok::PathSep) {
                    i += 2;
                    continue;
                }
                return vec![segs];
            }
            Some((Tok::Open, _)) => {
                let mut out = Vec::new();
                let mut depth = 0;
                let mut item_start = true;
                i += 1;
                while let Some((t, _)) = toks.get(i) {
                    match t {
                        Tok::Open => depth += 1,
                        Tok::Close if depth == 0 => break,
                        Tok::Close => depth -= 1,
                        Tok::Comma if depth == 0 => item_start = true,
                        Tok::Ident(_) if item_start && depth == 0 => {
                            for tail in path_tails(toks, i) {
                                let mut p = segs.clone();
                                p.extend(tail);
                                out.push(p);
                            }
                            item_start = false;
                        }
                        _ => item_start = false,
                    }
                    i += 1;
                }
                return out;
            }
            _ => return vec![segs],
        }
    }
}

/// Every `crate::`, `super::` and `sandbox_agent::` path in one file.
fn uses(f: &SourceFile) -> Vec<Use> {
    let code = code_only(&f.text);
    let toks = tokens(&code);
    let guest = f.module[0] == "guest";
    // The file's module plus the inline `mod x { … }` it is in.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth: usize = 0;
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let (t, line) = &toks[i];
        let prev_is_sep_or_dollar =
            i > 0 && matches!(toks[i - 1].0, Tok::PathSep | Tok::Other('$'));
        match t {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth = depth
                    .checked_sub(1)
                    .unwrap_or_else(|| panic!("{}:{line}: unbalanced `}}`: a scanner bug", f.rel));
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Open, _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                }
            }
            Tok::Ident(kw)
                if !prev_is_sep_or_dollar
                    && matches!(kw.as_str(), "crate" | "super" | "sandbox_agent")
                    && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::PathSep) =>
            {
                let mut base: Vec<String> = match kw.as_str() {
                    "crate" if guest => vec!["guest".into()],
                    "crate" => vec![],
                    "sandbox_agent" if !guest => vec!["guest".into()],
                    "sandbox_agent" => {
                        i += 1;
                        continue;
                    }
                    _ => {
                        let mut cur = f.module.clone();
                        cur.extend(inline.iter().map(|(n, _)| n.clone()));
                        cur
                    }
                };
                let mut j = i;
                if kw == "super" {
                    while let (Some((Tok::Ident(s), _)), Some((Tok::PathSep, _))) =
                        (toks.get(j), toks.get(j + 1))
                    {
                        if s != "super" {
                            break;
                        }
                        base.pop();
                        j += 2;
                    }
                } else {
                    j += 2;
                }
                for tail in path_tails(&toks, j) {
                    let mut path = base.clone();
                    path.extend(tail);
                    // The daemon's `crate::proto` and `crate::sync`
                    // re-export the guest's.
                    if !guest && path.first().is_some_and(|s| s == "proto" || s == "sync") {
                        path.insert(0, "guest".into());
                    }
                    out.push(Use { path, line: *line });
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Node of a module path at `level` (1: top-level module, 2: its
/// submodules), as far as `known` module paths go; `OWN_NODES` count as
/// top-level.
fn node(path: &[String], level: usize, known: &BTreeSet<Vec<String>>) -> Option<String> {
    let joined = path.join("::");
    if level == 1 {
        if let Some(own) = OWN_NODES
            .iter()
            .find(|n| joined == **n || joined.starts_with(&format!("{n}::")))
        {
            return Some(own.to_string());
        }
    }
    let level = if path.first().is_some_and(|s| s == "guest") {
        level + 1
    } else {
        level
    };
    (1..=level.min(path.len()))
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| known.contains(p))
        .map(|p| p.join("::"))
}

/// One cross-module use at top level: its source and target nodes, the
/// target's submodule node, and where it is.
struct Edge {
    from: String,
    to: String,
    to_sub: String,
    site: String,
}

fn edges(files: &[SourceFile], level: usize) -> Vec<Edge> {
    let known: BTreeSet<Vec<String>> = files
        .iter()
        .flat_map(|f| (1..=f.module.len()).map(|n| f.module[..n].to_vec()))
        .collect();
    let mut out = Vec::new();
    for f in files {
        let Some(from) = node(&f.module, level, &known) else {
            continue;
        };
        for u in uses(f) {
            let (Some(to), Some(to_sub)) = (node(&u.path, level, &known), node(&u.path, 2, &known))
            else {
                continue;
            };
            if to != from && to != "guest" {
                let site = format!("{}:{}", f.rel, u.line);
                out.push(Edge {
                    from: from.clone(),
                    to,
                    to_sub,
                    site,
                });
            }
        }
    }
    out
}

type Graph = BTreeMap<(String, String), Vec<String>>;

/// Edges between distinct nodes, each with its sites (deduplicated).
fn graph(edges: &[Edge]) -> Graph {
    let mut g = Graph::new();
    for e in edges {
        let sites = g.entry((e.from.clone(), e.to.clone())).or_default();
        if !sites.contains(&e.site) {
            sites.push(e.site.clone());
        }
    }
    g
}

/// Strongly connected components with more than one node: the cycles.
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = g.keys().flat_map(|(a, b)| [a, b]).collect();
    let reach = |from: &String| {
        let mut seen = BTreeSet::from([from.clone()]);
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for (a, b) in g.keys() {
                if *a == n && seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let reach: BTreeMap<&String, BTreeSet<String>> = nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in &nodes {
        let scc: Vec<String> = nodes
            .iter()
            .filter(|m| reach[*n].contains(**m) && reach[*m].contains(*n))
            .map(|m| (*m).clone())
            .collect();
        if scc.len() > 1 && !out.contains(&scc) {
            out.push(scc);
        }
    }
    out
}

fn print_graph(name: &str, g: &Graph) {
    for ((a, b), sites) in g {
        eprintln!(
            "FIGURE arch_{name}_edge {a} -> {b} ({} sites, first {})",
            sites.len(),
            sites[0]
        );
    }
    let cyc = cycles(g);
    for scc in &cyc {
        let inner: Vec<String> = g
            .keys()
            .filter(|(a, b)| scc.contains(a) && scc.contains(b))
            .map(|(a, b)| format!("{a}->{b}"))
            .collect();
        eprintln!(
            "FIGURE arch_{name}_cycle {} [{}]",
            scc.join(" "),
            inner.join(" ")
        );
    }
    eprintln!("FIGURE arch_{name}_edges {}", g.len());
    eprintln!("FIGURE arch_{name}_cycles {}", cyc.len());
}

/// The target itself has no cycle (a submodule entry counts as its module).
#[test]
fn rules_are_acyclic() {
    let mut g = Graph::new();
    for (from, to) in RULES {
        for t in *to {
            let t = if OWN_NODES.contains(t) {
                t
            } else {
                t.split("::").next().unwrap_or(t)
            };
            let t = if t == "guest" { PROTO } else { t };
            g.entry((from.to_string(), t.to_string()))
                .or_default()
                .push("RULES".into());
        }
    }
    let cyc = cycles(&g);
    assert!(cyc.is_empty(), "RULES allow cycles: {cyc:?}");
}

#[test]
fn module_layering_follows_the_rules() {
    let files = sources();
    let top_edges = edges(&files, 1);
    let top = graph(&top_edges);
    print_graph("top", &top);
    let sub = graph(&edges(&files, 2));
    print_graph("sub", &sub);

    let rules: BTreeMap<&str, &[&str]> = RULES.iter().copied().collect();
    let mut errors = Vec::new();
    let nodes: BTreeSet<&String> = top.keys().flat_map(|(a, b)| [a, b]).collect();
    for n in nodes {
        if !rules.contains_key(n.as_str()) {
            errors.push(format!(
                "module `{n}` has no row in RULES (nor a place in docs/architecture.md)"
            ));
        }
    }
    // Uses the rules do not allow, per edge.
    let mut breaches: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for e in &top_edges {
        let allowed = e.to == SYNC
            || rules
                .get(e.from.as_str())
                .is_some_and(|r| r.contains(&e.to.as_str()) || r.contains(&e.to_sub.as_str()));
        if !allowed {
            let sites = breaches.entry((&e.from, &e.to)).or_default();
            if !sites.contains(&e.site.as_str()) {
                sites.push(&e.site);
            }
        }
    }
    for ((a, b), sites) in &breaches {
        eprintln!("FIGURE arch_breach {a} -> {b} ({} sites)", sites.len());
        if !DEBT.iter().any(|(x, y, _)| x == a && y == b) {
            errors.push(format!("{a} may not import {b}: {}", sites.join(", ")));
        }
    }
    for (a, b, what) in DEBT {
        if !breaches.contains_key(&(*a, *b)) {
            errors.push(format!(
                "DEBT {a} -> {b} ({what}) is gone or now allowed: remove it from DEBT and docs/architecture.md"
            ));
        }
    }
    eprintln!(
        "FIGURE arch_breaches {} (debt {})",
        breaches.len(),
        DEBT.len()
    );
    // No cycle, between top-level modules or between submodules (issue
    // #20 broke the last ones): a new one names its modules here.
    for (what, g) in [("modules", &top), ("submodules", &sub)] {
        for scc in cycles(g) {
            errors.push(format!(
                "a cycle between {what} {{{}}}: move what they share below them",
                scc.join(", ")
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "layering (docs/architecture.md):\n  {}",
        errors.join("\n  ")
    );
}

/// Sites of `unsafe` blocks and impls without a `// SAFETY:` comment on
/// the lines above (blank lines and attributes may sit between), as
/// clippy's undocumented_unsafe_blocks finds them: the comment belongs to
/// the statement the block is in, so a second block in the next statement,
/// or a block in a struct field or match arm on a line of its own, needs
/// its own comment.
fn undocumented_unsafe(f: &SourceFile) -> Vec<usize> {
    let code = code_only(&f.text);
    let code_lines: Vec<&str> = code.lines().collect();
    let raw_lines: Vec<&str> = f.text.lines().collect();
    let toks = tokens(&code);
    let mut out = Vec::new();
    for (k, (t, line)) in toks.iter().enumerate() {
        let is_unsafe = *t == Tok::Ident("unsafe".into());
        let block = matches!(toks.get(k + 1), Some((Tok::Open, _)))
            || matches!(toks.get(k + 1), Some((Tok::Ident(s), _)) if s == "impl");
        if !is_unsafe || !block {
            continue;
        }
        let mut documented = false;
        let mut l = line - 1; // index of the block's line; look above it
        while l > 0 {
            l -= 1;
            let raw = raw_lines[l].trim();
            let code = code_lines.get(l).map_or("", |s| s.trim());
            if raw.is_empty() || raw.starts_with("#[") {
                continue;
            }
            if code.is_empty() {
                // A comment line: part of the comment group above the block.
                if raw.to_ascii_uppercase().contains("SAFETY:") {
                    documented = true;
                    break;
                }
                continue;
            }
            // The block sits in a statement begun above (`let x =` then the
            // block on the next line): the comment goes above that line.
            let continues = (code.ends_with('=') && !code.ends_with("=>"))
                || code.ends_with('(')
                || code.ends_with('[');
            if continues {
                continue;
            }
            break;
        }
        if !documented {
            out.push(*line);
        }
    }
    out
}

#[test]
fn unsafe_blocks_carry_a_safety_comment() {
    let mut sites = Vec::new();
    for f in sources() {
        for line in undocumented_unsafe(&f) {
            sites.push(format!("{}:{line}", f.rel));
        }
    }
    for s in &sites {
        eprintln!("FIGURE arch_unsafe_undocumented_site {s}");
    }
    eprintln!("FIGURE arch_unsafe_undocumented {}", sites.len());
    // Exact: more is an undocumented block, fewer means the constant
    // should come down (it is 0 now that the clippy lint denies them).
    assert_eq!(
        sites.len(),
        UNDOCUMENTED_UNSAFE,
        "unsafe blocks without a `// SAFETY:` comment (expected {UNDOCUMENTED_UNSAFE}):\n  {}",
        sites.join("\n  ")
    );
}
