#!/usr/bin/env python3
"""Fails when the modules inside one crate import each other in a circle.

Usage: scripts/module-cycles.py [CRATE_DIR...]   (default: every workspace member and fuzz/)
       scripts/module-cycles.py --self-test       (the check finds planted cycles and passes clean trees)

A module is a source file (`src/a.rs` or `src/a/mod.rs` is `a`, `src/a/b.rs` is `a::b`, `lib.rs`/`main.rs` is
the crate root; each file under `src/bin/`, `tests/`, `benches/` and `examples/` is a root of its own target).
An arrow runs from a module to each module it names through a path that starts with `crate::`, `super::` or
`self::` (in `use` lines and in code), resolved to the deepest module file the path reaches. Two kinds of arrow are
not counted, because they are how Rust nests modules and carry no dependency of their own:

- to an ancestor (`super::X`, `crate::a::X` from inside `a`): the parent is the child's namespace. When the name
  is one the ancestor re-exports from another module (`pub use self::b::X` / `pub use b::X`), the arrow runs to
  that module instead, so a cycle through a re-export is still found;
- `mod b;` declarations themselves.

A cycle is a strongly connected set of two or more modules of the same target. Each is printed with one arrow of
each edge's evidence (file:line), and the exit status is 1 when any is found.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH_RE = re.compile(r"\b(crate|super|self)((?:::(?:[A-Za-z_][A-Za-z0-9_]*|\{))+)")
USE_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M | re.S)
COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING_RE = re.compile(r'r#*"(?:.|\n)*?"#*|"(?:\\.|[^"\\])*"')


def strip(text):
    """Source without comments and string literals (kept line-aligned)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    text = STRING_RE.sub(blank, text)
    return COMMENT_RE.sub(blank, text)


def targets(crate):
    """Yields (target name, root file, src dir whose files form its module tree)."""
    src = crate / "src"
    for root in ("lib.rs", "main.rs"):
        if (src / root).is_file():
            yield root, src / root, src
    for sub in ("src/bin", "tests", "benches", "examples"):
        d = crate / sub
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.rs")):
            yield f"{sub}/{f.name}", f, None
        for f in sorted(d.glob("*/main.rs")):
            yield f"{sub}/{f.parent.name}", f, f.parent


def module_files(root_file, src):
    """Module path (tuple) -> file, following `mod x;` declarations from the root."""
    mods = {(): root_file}
    todo = [((), root_file)]
    while todo:
        path, f = todo.pop()
        text = strip(f.read_text())
        if f.name in ("lib.rs", "main.rs", "mod.rs") or f == root_file:
            base = f.parent
        else:
            base = f.parent / f.stem
        for m in re.finditer(r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;",
                             text, re.M):
            name = m.group(1)
            attr = re.search(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+' + name + r"\s*;",
                             f.read_text())
            cands = [f.parent / attr.group(1)] if attr else [base / f"{name}.rs", base / name / "mod.rs"]
            for c in cands:
                if c.is_file():
                    mods[path + (name,)] = c
                    todo.append((path + (name,), c))
                    break
    return mods


def expand_use(tree):
    """`a::{b, c::{d}}` -> ["a::b", "a::c::d"] (globs and `self` kept as path ends)."""
    tree = re.sub(r"\s+", "", tree)
    m = re.match(r"^(.*?)\{(.*)\}$", tree)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if not p:
            continue
        for e in expand_use(p):
            out.append(prefix + e if e != "self" else prefix.rstrip(":"))
    return out


def resolve(mods, here, segs):
    """The deepest module a path (segments after crate/super/self handling) reaches, and the rest."""
    best = ()
    for i in range(1, len(segs) + 1):
        if tuple(segs[:i]) in mods:
            best = tuple(segs[:i])
        else:
            break
    return best, segs[len(best):]


def absolute(here, kind, rest):
    if kind == "crate":
        return list(rest)
    base = list(here)
    if kind == "super":
        base = base[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    return base + list(rest)


def reexports(mods):
    """(module, name) -> module it re-exports `name` from."""
    out = {}
    for path, f in mods.items():
        text = strip(f.read_text())
        for m in USE_RE.finditer(text):
            if not re.match(r"\s*pub", m.group(0)):
                continue
            for p in expand_use(m.group(1)):
                p = re.sub(r"\s+as\s+\w+$", "", p)
                segs = p.split("::")
                kind = segs[0] if segs[0] in ("crate", "super", "self") else None
                if kind is None:
                    if tuple(path + (segs[0],)) in mods:
                        kind, segs = "self", ["self"] + segs
                    else:
                        continue
                target, rest = resolve(mods, path, absolute(path, kind, segs[1:]))
                if target != path and rest:
                    out[(path, rest[-1])] = target
    return out


def edges(mods):
    rex = reexports(mods)
    found = {}
    for path, f in mods.items():
        lines = strip(f.read_text())
        uses = []
        for m in USE_RE.finditer(lines):
            line = lines.count("\n", 0, m.start()) + 1
            for p in expand_use(m.group(1)):
                uses.append((line, re.sub(r"\s+as\s+\w+$", "", p)))
        for m in PATH_RE.finditer(lines):
            line = lines.count("\n", 0, m.start()) + 1
            uses.append((line, m.group(0).rstrip(":{")))
        for line, p in uses:
            segs = [s for s in p.split("::") if s]
            if not segs:
                continue
            kind = segs[0]
            if kind not in ("crate", "super", "self"):
                if tuple(path + (kind,)) in mods:  # `use child::X` (edition-2018 relative)
                    kind, segs = "self", ["self"] + segs
                else:
                    continue
            segs = [s for s in segs[1:] if s != "*"]
            if kind == "super":
                segs = ["super"] + segs
            target, rest = resolve(mods, path, absolute(path, kind, segs[1:] if kind == "super" else segs))
            if target == path:
                continue
            if path[: len(target)] == target:  # an ancestor: follow a re-export, else not counted
                if rest and (target, rest[0]) in rex:
                    target = rex[(target, rest[0])]
                elif rest and len(rest) == 1 and (target, rest[-1]) in rex:
                    target = rex[(target, rest[-1])]
                else:
                    continue
                if target == path or path[: len(target)] == target:
                    continue
            found.setdefault((path, target), f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}:{line}")
    return found


def cycles(nodes, found):
    graph = {n: [] for n in nodes}
    for (a, b) in found:
        graph[a].append(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(path):
    return "crate" + "".join("::" + s for s in path)


def main(args):
    if args:
        crates = [Path(a).resolve() for a in args]
    else:
        cargo = (ROOT / "Cargo.toml").read_text()
        members = re.search(r"members\s*=\s*\[([^\]]*)\]", cargo).group(1)
        crates = [ROOT / m for m in re.findall(r'"([^"]+)"', members)] + [ROOT / "fuzz"]
    bad = 0
    checked = 0
    for crate in crates:
        for tname, root, src in targets(crate):
            mods = module_files(root, src) if src else {(): root}
            found = edges(mods)
            checked += len(mods)
            for comp in cycles(list(mods), found):
                bad += 1
                print(f"{crate.name} ({tname}): module cycle among {', '.join(name(c) for c in comp)}")
                members = set(comp)
                for (a, b), where in sorted(found.items()):
                    if a in members and b in members:
                        print(f"    {name(a)} -> {name(b)}    ({where})")
    if bad:
        print(f"module-cycles: {bad} cycle(s) in {len(crates)} crates ({checked} modules)")
        return 1
    print(f"module-cycles: no module cycle in {len(crates)} crates ({checked} modules)")
    return 0


def self_test():
    """Small crates in a temp dir, each with the verdict the check must give."""
    import contextlib
    import io
    import tempfile

    cases = {
        "siblings in a circle": (True, {"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::b::B;\npub struct A;\n",
                                        "b.rs": "pub struct B;\nfn f(_: crate::a::A) {}\n"}),
        "a circle through a parent's re-export": (True, {
            "lib.rs": "mod m;\n", "m/mod.rs": "mod x;\nmod y;\npub use self::y::Y;\n",
            "m/x.rs": "use super::Y;\npub struct X;\n", "m/y.rs": "pub struct Y;\nfn f(_: super::x::X) {}\n"}),
        "a child naming its parent": (False, {"lib.rs": "mod a;\npub struct R;\nfn f(_: a::A) {}\n",
                                              "a.rs": "use crate::R;\npub struct A;\n"}),
        "a chain": (False, {"lib.rs": "mod a;\nmod b;\nmod c;\n", "a.rs": "use crate::b::B;\n",
                            "b.rs": "use crate::c::C;\npub struct B;\n",
                            "c.rs": "// crate::a::A in a comment\nconst S: &str = \"crate::a::A\";\npub struct C;\n"}),
    }
    failed = 0
    for what, (cyclic, files) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            for name, text in files.items():
                f = Path(d) / "src" / name
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                status = main([d])
            if (status == 1) != cyclic:
                failed += 1
                print(f"module-cycles self-test: {what}: expected {'a cycle' if cyclic else 'none'}, got:\n{out.getvalue()}")
    print(f"module-cycles self-test: {len(cases) - failed}/{len(cases)} cases right")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(sys.argv[1:]))
