#!/usr/bin/env python3
"""Report import cycles between the files (modules) of each crate under crates/.

A file "imports" another when it names it through a `crate::a::b` or `super::x` path
(in `use` lines or inline). Cycles between a module and its own parent `mod.rs`/`lib.rs`
are normal Rust structure (a parent declares its children, children use the parent's
types) and are not reported; cycles between sibling modules are, where a directory
module counts with all its files (so a cycle through a child file of a sibling is found).

Cycles listed in ALLOWED are mutual recursion of the types themselves, which no split of
files removes; each says why.

Usage: scripts/import-cycles.py [crates/NAME ...]   exit 1 when another cycle is found.
"""
import os
import re
import sys


def modules(src):
    """Map module path (tuple) -> file, for a crate's src dir."""
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main", "mod"):
                rel = rel[:-1]
            if rel and rel[0] == "bin":
                continue
            mods[tuple(rel)] = os.path.join(root, f)
    return mods


ALLOWED = {
    # A core's CoreIo holds a remote completer (its Mailbox); the Mailbox carries spawn
    # functions that run on a CoreIo. One type refers to the other by nature.
    ("tessera-io", ("core_io", "reactor")),
    # A pool owns its volumes; a volume allocates units from its pool's core.
    ("tessera-pool", ("pool", "volume")),
}

PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def resolve(mods, here, head, tail):
    base = () if head == "crate" else here[:-1]
    parts = tail.strip(":").split("::")
    # `super::super::x`
    while parts and parts[0] == "super":
        base = base[:-1]
        parts = parts[1:]
    best = None
    for i in range(1, len(parts) + 1):
        cand = base + tuple(parts[:i])
        if cand in mods:
            best = cand
    return best


def graph(mods):
    g = {m: set() for m in mods}
    for m, f in mods.items():
        # Comments (doc links included) name modules without depending on them.
        text = re.sub(r"//[^\n]*", "", open(f, encoding="utf-8").read())
        # `#[cfg(test)] mod tests` bodies are part of the file: fine, they import too.
        for head, tail in PATH.findall(text):
            t = resolve(mods, m, head, tail)
            if t is not None and t != m:
                g[m].add(t)
    return g


def is_ancestor(a, b):
    return len(a) < len(b) and b[: len(a)] == a


def collapse(m, t):
    """The edge m -> t as seen between siblings: both ends lifted to the children of their
    deepest common ancestor. `volume::first_write -> chain` is an edge `volume -> chain`:
    a directory module and its files are one unit to the modules beside it, so a cycle
    that passes through a child file (chain -> pool -> volume -> volume::first_write ->
    chain) is found. None for an edge between a module and its own ancestor (a parent
    declares its children, children use the parent's types: normal Rust structure)."""
    if is_ancestor(t, m) or is_ancestor(m, t):
        return None
    k = 0
    while k < min(len(m), len(t)) and m[k] == t[k]:
        k += 1
    return m[: k + 1], t[: k + 1]


def cycles(g):
    """Strongly connected components with more than one member, between sibling modules
    (each directory module counted with everything under it; parent edges ignored)."""
    h = {}
    for m, ts in g.items():
        for t in ts:
            e = collapse(m, t)
            if e is not None:
                h.setdefault(e[0], set()).add(e[1])
                h.setdefault(e[1], set())
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in h[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in h:
        if v not in index:
            visit(v)
    return out


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    crates = sys.argv[1:] or sorted(
        os.path.join(root, "crates", c) for c in os.listdir(os.path.join(root, "crates"))
    )
    found = False
    for c in crates:
        src = os.path.join(c, "src")
        if not os.path.isdir(src):
            continue
        name = os.path.basename(os.path.normpath(c))
        for comp in cycles(graph(modules(src))):
            key = (name, tuple("::".join(m) for m in comp))
            if key in ALLOWED:
                continue
            found = True
            names = ", ".join("::".join(m) or "(root)" for m in comp)
            print(f"{name}: cycle between {names}")
    if not found:
        print("no import cycles between sibling files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
