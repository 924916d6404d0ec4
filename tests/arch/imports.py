#!/usr/bin/env python3
"""Checks that imports go one way inside the proxy and the executor.

A crate's modules are read from its `src/` folder: `src/a.rs` and
`src/a/mod.rs` are module `a`, `src/a/b.rs` is `a::b` (`lib.rs` is the
root; `main.rs`, a binary of its own that sees the crate only through its
public paths, is left out). A *room* is a top-level module: a file at the
top of `src/`, or a folder with everything in it. Every path a module names,
`crate::…` or `super::…` (grouped `use` trees included, comments and string
literals left out, test modules included), is resolved to the module that
holds it, which gives a graph of modules and, above it, of rooms.

It fails (exit status 1, one line per problem) when:

- two rooms import each other, directly or through others (a cycle);
- a room imports one on a higher layer of the crate's order (`LAYERS`
  below), or on its own layer where the crate allows none (`SAME_LAYER`),
  or a room is on no layer (a new room gets its place in the order first);
- inside a room, modules import each other in a cycle. An import of the
  `mod.rs` of a folder the importer lives in is not counted: a folder's
  children extend the type their `mod.rs` defines (more `impl` blocks), and
  that is one way by construction.

Usage: python3 tests/arch/imports.py [--graph] [ROOT]   (ROOT: the repository
root, by default this file's). `--graph` prints each crate's room graph.
Standard library only.
"""

import os
import re
import sys

# Each crate's rooms, top layer first. A room may import rooms of the layers
# below its own, never above. Within one layer, `SAME_LAYER` says whether its
# rooms may import each other one way ("one way": a cycle still fails) or not
# at all ("never"). docs/architecture.md states the same orders; change both
# together (a room added to a crate fails here until it has its place).
LAYERS = {
    # api → invoke → session → pool → process / proxy → confine → the shared leaves.
    "executor/src": [
        ["api"],  # the HTTP API
        ["invoke"],  # an invocation: dispatch, idempotency, journal, owner lease
        ["session"],  # MCP servers' sessions: their stdio, the JSON-RPC read strictly
        ["pool"],  # pools and one child's life: start, converse, the child protocol
        ["process", "proxy"],  # processes; where the executor talks to the proxy
        ["confine"],  # one file per confinement mechanism, the plan, doctor's mapping
        ["metrics"],  # shared leaves, used by several stages
        ["kill"],
        ["error", "config", "sys"],  # sys: all the unsafe
    ],
    # server → the planes (data, control) → state, listener → facts, runs,
    # metrics, deny, as docs/architecture.md states it; learn sits with the
    # planes (control serves it, it replays through data's policy), and the
    # proxy's other shared modules with the bottom layer.
    "proxy/src": [
        ["server"],
        ["data", "control", "learn"],
        ["state", "listener"],
        ["facts", "runs", "metrics", "deny", "ca", "dns", "admission", "addrs", "time", "creds"],
    ],
}
SAME_LAYER = {"executor/src": "never", "proxy/src": "one way"}

# Inside a room: its parts (the folders or files right under it), top layer
# first, checked as the rooms are (a part imports parts of lower layers
# only; the room's own `mod.rs` is its face and is left out). The proxy's
# data plane is many entrances around one decider: an entrance imports the
# decider and the carriers; a carrier may import the decider (the `Fetch`
# context it carries for, the canonical target, `policy::contains`), never
# an entrance; the decider imports nothing of the data plane.
PARTS = {
    "proxy/src": {
        "data": [
            ["entrance"],  # parses its input, calls decide, carries the answer
            ["carry"],  # upstream, forward, tunnel, body, inject, scrub, frames, ...
            ["decide"],  # the Fetch context, the pure policy, target, auth
        ],
    },
}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
STRIP = re.compile(
    r"//[^\n]*"  # line and doc comments
    r"|/\*.*?\*/"  # block comments
    r"|b?r(#*)\".*?\"\1"  # raw strings
    r"|b?\"(?:\\.|[^\"\\])*\""  # strings
    r"|b?'(?:\\.|[^'\\\n])'",  # char literals (a lifetime has no closing quote)
    re.DOTALL,
)
TOKENS = re.compile(r"\bmod\s+(" + IDENT + r")\s*\{|\b(crate|super)\s*::|[{}]")


def modules(src):
    """{module path (tuple): file} for every .rs file under `src`."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts in (["lib"], ["main"]):
                if parts == ["lib"]:
                    out[()] = os.path.join(dirpath, f)
                continue
            if parts[-1] == "mod":
                parts = parts[:-1]
            out[tuple(parts)] = os.path.join(dirpath, f)
    return out


def blank(m):
    """A comment or literal replaced by spaces, newlines kept."""
    return re.sub(r"[^\n]", " ", m.group(0))


def use_tree(text, i):
    """Parses the path (or grouped use tree) starting at text[i] (just after
    `crate::` or `super::`): a list of segment lists, and where it ends."""
    paths = []
    seg = []
    n = len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i < n and text[i] == "{":
            i += 1
            while True:
                sub, i = use_tree(text, i)
                paths += [seg + p for p in sub]
                while i < n and text[i].isspace():
                    i += 1
                if i < n and text[i] == ",":
                    i += 1
                    while i < n and text[i].isspace():
                        i += 1
                    if i < n and text[i] == "}":
                        return paths, i + 1
                    continue
                if i < n and text[i] == "}":
                    return paths, i + 1
                return paths, i
        m = re.compile(IDENT + "|\\*").match(text, i)
        if not m:
            break
        seg.append(m.group(0))
        i = m.end()
        m2 = re.compile(r"\s*::\s*").match(text, i)
        if not m2:
            break
        i = m2.end()
    if seg:
        paths.append(seg)
    return paths, i


def references(path, module):
    """The module paths `path` (module `module`) names through crate:: and super::."""
    text = STRIP.sub(blank, open(path, encoding="utf-8").read())
    found = []
    stack = []  # (inline module name, brace depth at its opening)
    depth = 0
    for m in TOKENS.finditer(text):
        if m.group(1):
            stack.append((m.group(1), depth))
            depth += 1
        elif m.group(0) == "{":
            depth += 1
        elif m.group(0) == "}":
            depth -= 1
            if stack and stack[-1][1] == depth:
                stack.pop()
        else:
            here = list(module) + [s for s, _ in stack]
            base = [] if m.group(2) == "crate" else here[:-1]
            i = m.end()
            # super::super::…
            while m.group(2) == "super":
                s = re.compile(r"\s*super\s*::").match(text, i)
                if not s:
                    break
                base = base[:-1]
                i = s.end()
            trees, _ = use_tree(text, i)
            for t in trees:
                t = [x for x in t if x != "self"]
                found.append(tuple(base + t))
    return found


def resolve(name, mods):
    """The longest module of `mods` that `name` starts with."""
    for k in range(len(name), -1, -1):
        if name[:k] in mods:
            return name[:k]
    return ()


def cycles(nodes, edges):
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def show(mod):
    return "::".join(mod) or "crate"


def check(root, src, layers, same_layer, graph=False):
    problems = []
    mods = modules(os.path.join(root, src))
    uses = {}  # module -> {module: first importer file}
    for mod, path in mods.items():
        for name in references(path, mod):
            target = resolve(name, mods)
            if target != mod:
                uses.setdefault(mod, set()).add(target)
    rooms = {}
    for mod, targets in uses.items():
        for t in targets:
            if mod and t and mod[0] != t[0]:
                rooms.setdefault(mod[0], {}).setdefault(t[0], set()).add((mod, t))
    layer_of = {r: n for n, layer in enumerate(layers) for r in layer}
    all_rooms = sorted({m[0] for m in mods if m})
    for r in all_rooms:
        if r not in layer_of:
            problems.append(f"{src}: room `{r}` is on no layer of the order: give it its place in LAYERS")
    edges = {a: set(b) for a, b in rooms.items()}
    for comp in cycles(all_rooms, edges):
        ties = []
        for a in comp:
            for b in comp:
                pairs = sorted(rooms.get(a, {}).get(b, ()))
                if pairs:
                    more = f", +{len(pairs) - 1} more" if len(pairs) > 1 else ""
                    ties.append(f"{a} -> {b}: {show(pairs[0][0])} -> {show(pairs[0][1])}{more}")
        ties = "; ".join(ties)
        problems.append(f"{src}: rooms in a cycle: {', '.join(comp)} ({ties})")
    for a, targets in sorted(rooms.items()):
        for b, pairs in sorted(targets.items()):
            if a not in layer_of or b not in layer_of or layer_of[b] > layer_of[a]:
                continue
            if layer_of[a] == layer_of[b] and same_layer == "one way":
                continue
            if layer_of[b] <= layer_of[a]:
                how = "sideways (same layer)" if layer_of[a] == layer_of[b] else "upward"
                for i, t in sorted(pairs):
                    problems.append(f"{src}: {show(i)} imports {show(t)}: {how}, against the order {a} above {b}")
    # Inside a room: its parts in their order (PARTS).
    for room, order in PARTS.get(src, {}).items():
        part_of = {p: n for n, layer in enumerate(order) for p in layer}
        for m in sorted(mods):
            if len(m) < 2 or m[0] != room:
                continue
            if m[1] not in part_of:
                problems.append(f"{src}: `{show(m)}` is in no part of `{room}`: give it its place in PARTS")
                continue
            for t in sorted(uses.get(m, ())):
                if len(t) < 2 or t[0] != room or t[1] == m[1] or t[1] not in part_of:
                    continue
                if part_of[t[1]] > part_of[m[1]]:
                    continue
                problems.append(
                    f"{src}: {show(m)} imports {show(t)}: against the order of `{room}` ({' above '.join(' '.join(l) for l in order)})"
                )
    # Inside a room: modules in no cycle, an import of an enclosing mod.rs aside.
    for room in all_rooms:
        inner = {m for m in mods if m and m[0] == room}
        e = {}
        for m in inner:
            for t in uses.get(m, ()):
                if t in inner and not (len(t) < len(m) and m[: len(t)] == t):
                    e.setdefault(m, set()).add(t)
        for comp in cycles(inner, e):
            problems.append(f"{src}: modules in a cycle inside `{room}`: {', '.join(show(c) for c in comp)}")
    if graph:
        for n, layer in enumerate(layers):
            for r in layer:
                print(f"{src} layer {n} {r} -> {', '.join(sorted(rooms.get(r, {}))) or '-'}")
    return problems


def main(argv):
    graph = "--graph" in argv
    args = [a for a in argv if a != "--graph"]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    problems = []
    for src, layers in LAYERS.items():
        problems += check(root, src, layers, SAME_LAYER[src], graph)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} import(s) against the stated direction", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
