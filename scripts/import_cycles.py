#!/usr/bin/env python3
"""Fails when the files of src/ import each other in a circle.

Each file of src/ is a module (src/a/mod.rs and src/a.rs are `crate::a`, src/a/b.rs is
`crate::a::b`). Every path a file names that starts with `crate::`, `super::` or `self::` (in
`use` lines, groups expanded, and in code) is followed down the module files as far as they go;
so is a path through a module the file declares (`mod run;` ... `run::RunArgs`); the file
it ends in is what the first file imports. A test module at the end of a file
(`#[cfg(test)] mod tests { ... }`, whose `super` is the file itself) is left out, and so are
comments. Prints each circle with the names that tie it and exits 1; prints the number of files
and imports and exits 0 when there is none.

Usage: python3 scripts/import_cycles.py [SRC_DIR]
"""

import os
import re
import sys

SRC = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "src")
SRC = os.path.normpath(SRC)


def module_of(path):
    """The module path (a tuple) of a file under SRC."""
    rel = os.path.relpath(path, SRC)[: -len(".rs")].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


files = {}
for root, _, names in os.walk(SRC):
    for name in names:
        if name.endswith(".rs"):
            path = os.path.join(root, name)
            files[path] = module_of(path)
by_module = {}
for path, module in files.items():
    if not path.endswith("main.rs"):
        by_module[module] = path


def strip(text):
    """The text without comments, string contents and the trailing test module."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def expand(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = tree.strip()
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix, inner, rest = tree[:start], tree[start + 1 : i], tree[i + 1 :]
                parts, d, last = [], 0, 0
                for j, c in enumerate(inner):
                    if c == "{":
                        d += 1
                    elif c == "}":
                        d -= 1
                    elif c == "," and d == 0:
                        parts.append(inner[last:j])
                        last = j + 1
                parts.append(inner[last:])
                out = []
                for part in parts:
                    if part.strip():
                        out.extend(expand(prefix + part.strip() + rest))
                return out
    return [tree]


def resolve(module, path):
    """The file a path named in `module`'s file ends in, or None outside src/."""
    segments = [s for s in re.split(r"::", path) if s]
    if not segments:
        return None
    if segments[0] == "crate":
        base, segments = (), segments[1:]
    elif segments[0] in ("super", "self"):
        base = module
        while segments and segments[0] in ("super", "self"):
            if segments[0] == "super":
                base = base[:-1]
            segments = segments[1:]
    else:
        return None
    found = by_module.get(base)
    current = base
    for segment in segments:
        segment = re.sub(r"\W.*", "", segment)
        current = current + (segment,)
        if current in by_module:
            found = by_module[current]
        else:
            break
    return found


edges = {}
for path, module in files.items():
    if path.endswith("main.rs"):
        continue
    text = strip(open(path, encoding="utf-8").read())
    named = []
    for use in re.findall(r"\buse\s+([^;]+);", text):
        named.extend(expand(use))
    named.extend(re.findall(r"\b(?:crate|super|self)(?:::\w+)+", text))
    # A module this file declares is named without a prefix too (`mod run;` ... `run::RunArgs`).
    for child in re.findall(r"\bmod\s+(\w+)\s*;", text):
        named.extend("self::" + p for p in re.findall(rf"(?<![\w:]){child}(?:::\w+)+", text))
        named.extend("self::" + u for u in list(named) if u.startswith(child + "::"))
    for name in named:
        target = resolve(module, re.sub(r"\s+as\s+\w+$", "", name.strip()))
        if target and target != path:
            edges.setdefault(path, {}).setdefault(target, set()).add(name.strip().split("::")[-1])

# Tarjan's strongly connected components.
index, low, stack, on_stack, sccs, counter = {}, {}, [], set(), [], [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in edges.get(v, {}):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop()
            on_stack.discard(w)
            component.append(w)
            if w == v:
                break
        if len(component) > 1:
            sccs.append(sorted(component))


sys.setrecursionlimit(10000)
for v in sorted(files):
    if v not in index:
        visit(v)

rel = lambda p: os.path.relpath(p, os.path.dirname(SRC))
if sccs:
    for component in sccs:
        print("import cycle among: " + ", ".join(rel(p) for p in component))
        for a in component:
            for b, names in sorted(edges.get(a, {}).items()):
                if b in component:
                    print(f"  {rel(a)} -> {rel(b)}: {', '.join(sorted(names))}")
    sys.exit(1)
print(f"no import cycle among the {len(files)} files of {rel(SRC)} ({sum(len(t) for t in edges.values())} file-to-file imports)")
