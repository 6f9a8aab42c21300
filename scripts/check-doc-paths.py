#!/usr/bin/env python3
"""Check that every repository path and every crate a document names exists.

Rules (what counts as a name, and where it must exist):

* A *path* is an inline code span (`...`, outside fenced blocks) with no space, no
  `:` and no leading `/` (so no URL, NQN, API route or absolute path) that either
  ends in .rs, .md, .sh, .py or .toml, or starts with a top-level directory of the
  repository (`crates/`, `docs/`, `scripts/`, `bench/`, ...) or with a crate's folder
  name (`tessera-pool/...`). A trailing `/` names a directory. Data files the node
  writes (`DATA_DIR/pools.json`, `nvmf.json`) match neither and are not checked.
  The path exists when a file or directory of the repository (outside .git/ and
  target/) is that path, relative to the root, or ends with `/` + it:
  `crates/tessera-pool/src/chain.rs`, `tessera-pool/src/chain.rs`, `src/chain.rs`
  and `chain.rs` all name it. Write the fuller form where a short one is ambiguous.
* A *crate* is every `tessera-NAME` in the text (diagrams included), and every
  `tessera_NAME::` (a Rust path). It exists when crates/tessera-NAME/Cargo.toml does.
* The fenced block after a line `<!-- check-doc-paths: dependencies -->` lists every
  crate's direct dependencies on other crates of the workspace, one line each:
  `NAME → DEP, DEP` (names without `tessera-`; `—` for none). It must name every crate
  under crates/, and each line must equal the `tessera-*` entries of the `[dependencies]`
  table of that crate's Cargo.toml (dev- and build-dependencies are not listed).

Usage: scripts/check-doc-paths.py [DOC ...]   (default: docs/architecture.md)
Prints each name that does not exist, with its line, and exits 1 if there is one.
"""
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
EXTENSIONS = (".rs", ".md", ".sh", ".py", ".toml")
SPAN = re.compile(r"`([^`\n]+)`")
CRATE = re.compile(r"(?<![A-Za-z0-9_.:/-])tessera-([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
BARE = r"(?<![A-Za-z0-9_.:/`-])((?:{})/[A-Za-z0-9_./{{}}-]*[A-Za-z0-9_/}}])"
RUST_CRATE = re.compile(r"(?<![A-Za-z0-9_])tessera_([a-z][a-z0-9_]*)::")


def repo_entries():
    """Every file and directory of the repository, as paths relative to the root."""
    out = set()
    for root, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".git", "target")]
        rel = os.path.relpath(root, ROOT)
        base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for d in dirs:
            out.add(base + d + "/")
        for f in files:
            out.add(base + f)
    return out


def is_path(token, prefixes):
    if " " in token or ":" in token or token.startswith("/"):
        return False
    if token.endswith(EXTENSIONS):
        return True
    return "/" in token and token.split("/", 1)[0] + "/" in prefixes


def exists(token, entries):
    token = token[2:] if token.startswith("./") else token
    candidates = {token} if token.endswith("/") else {token, token + "/"}
    for c in candidates:
        if c in entries:
            return True
        for e in entries:
            if e.endswith("/" + c):
                return True
    return False


MARKER = "<!-- check-doc-paths: dependencies -->"
DEP_LINE = re.compile(r"^\s*([a-z][a-z0-9-]*)\s*→\s*(.*?)\s*$")


def cargo_deps(crate):
    """The workspace crates (short names) in a crate's [dependencies] table."""
    deps, section = set(), None
    with open(os.path.join(ROOT, "crates", "tessera-" + crate, "Cargo.toml"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            head = re.match(r"^\[(.*)\]$", line)
            if head:
                section = head.group(1).strip()
                sub = re.match(r"^dependencies\.(tessera-[a-z0-9-]+)$", section)
                if sub:
                    deps.add(sub.group(1)[len("tessera-"):])
                continue
            target_deps = (section or "").startswith("target.") and section.endswith(".dependencies")
            if section == "dependencies" or target_deps:
                m = re.match(r"^(tessera-[a-z0-9-]+)\s*[.=]", line)
                if m:
                    deps.add(m.group(1)[len("tessera-"):])
    return deps


def check_dependencies(lines, crates):
    """Problems with the dependency list after MARKER, as (line, kind, text)."""
    try:
        at = next(i for i, l in enumerate(lines) if l.strip() == MARKER)
    except StopIteration:
        return []
    bad, listed, i = [], set(), at + 1
    while i < len(lines) and not lines[i].lstrip().startswith("```"):
        i += 1
    i += 1
    while i < len(lines) and not lines[i].lstrip().startswith("```"):
        m = DEP_LINE.match(lines[i])
        if m:
            name, rhs = m.group(1), m.group(2)
            said = set() if rhs in ("—", "-", "") else {d.strip() for d in rhs.split(",")}
            listed.add(name)
            if name not in crates:
                bad.append((i + 1, "no such crate", "tessera-" + name))
            else:
                real = cargo_deps(name)
                for d in sorted(said - real):
                    bad.append((i + 1, "dependency not in Cargo.toml", f"tessera-{name} → tessera-{d}"))
                for d in sorted(real - said):
                    bad.append((i + 1, "dependency in Cargo.toml, not listed", f"tessera-{name} → tessera-{d}"))
        elif lines[i].strip():
            bad.append((i + 1, "not a dependency line", lines[i].strip()))
        i += 1
    for c in sorted(crates - listed):
        bad.append((at + 1, "crate missing from the dependency list", "tessera-" + c))
    return bad


def check(doc, entries, crates, prefixes):
    top = sorted(p[:-1] for p in prefixes if not p.startswith("tessera-"))
    bare = re.compile(BARE.format("|".join(map(re.escape, top))))
    bad = []
    fenced = False
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines, 1):
        for m in CRATE.finditer(line):
            if m.group(1) not in crates:
                bad.append((n, "no such crate", "tessera-" + m.group(1)))
        for m in RUST_CRATE.finditer(line):
            if m.group(1).replace("_", "-") not in crates:
                bad.append((n, "no such crate", "tessera_" + m.group(1)))
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in SPAN.finditer(line):
            token = m.group(1).strip()
            if is_path(token, prefixes) and not exists(token, entries):
                bad.append((n, "no such path", token))
        for m in bare.finditer(SPAN.sub(" ", line)):
            if not exists(m.group(1), entries):
                bad.append((n, "no such path", m.group(1)))
    return sorted(bad + check_dependencies(lines, crates))


def main():
    docs = sys.argv[1:] or [os.path.join(ROOT, "docs", "architecture.md")]
    entries = repo_entries()
    crates = {
        c[len("tessera-"):]
        for c in os.listdir(os.path.join(ROOT, "crates"))
        if c.startswith("tessera-") and os.path.isfile(os.path.join(ROOT, "crates", c, "Cargo.toml"))
    }
    prefixes = {e for e in entries if e.endswith("/") and e.count("/") == 1}
    prefixes |= {"tessera-" + c + "/" for c in crates}
    failed = False
    for doc in docs:
        bad = check(doc, entries, crates, prefixes)
        name = os.path.relpath(doc, ROOT)
        for n, kind, token in bad:
            print(f"{name}:{n}: {kind}: {token}")
        if bad:
            failed = True
        else:
            print(f"{name}: every path and crate it names exists")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
