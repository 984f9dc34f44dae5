#!/usr/bin/env python3
"""Follow one command's options through the source, statically (issue #50's "stays, rooms,
climbs back"), so two commits can be compared with the same rule:

    scripts/option_trace.py TREE [--command train] [--json]

TREE is a checkout (a `git worktree` of an older commit works). The options are the flags
`docs/cli.md` lists for `dualedit COMMAND` (help and version aside), as the snake_case field
names clap derives them from.

- a **stay** is an (option, file) pair where the file's code, tests and comments left out,
  names the option as a field: `.name` not followed by `(` (a read), or `name:` not followed
  by `:` (a declaration, a struct literal, a pattern);
- a **room** is a file with at least one stay;
- a **climb back** is a stay in a room that lies on an import circle with another room of the
  same option: the option's room imports, directly or through other files, a file that
  imports it back, so following the option down leads back up to where it was. Imports are
  every `crate::` / `super::` / `self::` path in the code (a `use` or a path written inline),
  resolved to the file that defines the module; a parent module's `pub use` of its own child
  is a re-export, not a dependency.

This is a rule written down after the issue counted (its own method was not recorded), so
its counts are comparable between commits, not with the issue's 79 / 19 / 31.
"""
import argparse
import json
import re
import sys
from pathlib import Path


def flags(tree: Path, command: str) -> list:
    text = (tree / "docs" / "cli.md").read_text()
    start = text.index(f"## `dualedit {command}`")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    names = re.findall(r"^\s+(?:-\w, )?--([a-z][a-z0-9-]*)", section, re.M)
    return sorted({n.replace("-", "_") for n in names} - {"help", "version"})


def code_of(text: str) -> str:
    """The file's non-test code without comments or string contents."""
    text = text.split("#[cfg(test)]")[0]
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def module_of(src: Path, f: Path) -> tuple:
    parts = list(f.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def imports(src: Path, files: dict) -> dict:
    modules = set(files.values())
    edges = {m: set() for m in modules}
    path_re = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
    use_re = re.compile(r"^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.M)

    def resolve(me, head, rest):
        if head == "crate":
            base = []
        else:
            base = list(me)
            if head == "super":
                base.pop()
            while rest and rest[0] == "super":
                base.pop()
                rest = rest[1:]
        target = base + rest
        for n in range(len(target), -1, -1):
            if tuple(target[:n]) in modules:
                return tuple(target[:n])
        return None

    def expand(prefix, body, out):
        body = body.strip()
        if "{" not in body or "}" not in body:
            out.append(prefix + body)
            return
        head, inner = body[: body.index("{")], body[body.index("{") + 1 : body.rindex("}")]
        depth, start = 0, 0
        for i, c in enumerate(inner + ","):
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif c == "," and depth == 0:
                if inner[start:i].strip():
                    expand(prefix + head, inner[start:i], out)
                start = i + 1

    for f, me in files.items():
        code = code_of(f.read_text())
        dir_module = f.name in ("mod.rs", "lib.rs")
        reexports = set()
        for m in use_re.finditer(code):
            paths = []
            expand("", m.group(2), paths)
            for p in paths:
                segs = [s.strip() for s in p.split(" as ")[0].split("::") if s.strip()]
                if not segs:
                    continue
                if segs[0] not in ("crate", "super", "self") and (*me, segs[0]) in modules:
                    segs = ["self"] + segs
                if segs[0] not in ("crate", "super", "self"):
                    continue
                rest = [s for s in segs[1:] if s not in ("*", "self")]
                t = resolve(me, segs[0], rest)
                if t is None or t == me or t == ():
                    continue
                if m.group(1) and dir_module and t[: len(me)] == me:
                    reexports.add(t)
                    continue
                edges[me].add(t)
        for m in path_re.finditer(code):
            rest = m.group(2).split("::")[1:]
            t = resolve(me, m.group(1), [s for s in rest if s != "self"])
            if t is not None and t != me and t != () and t not in reexports:
                edges[me].add(t)
    return edges


def reach(edges, start):
    seen, stack = set(), list(edges.get(start, ()))
    while stack:
        m = stack.pop()
        if m not in seen:
            seen.add(m)
            stack.extend(edges.get(m, ()))
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", type=Path)
    ap.add_argument("--command", default="train")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    src = a.tree / "src"
    files = {f: module_of(src, f) for f in sorted(src.rglob("*.rs")) if "tests" not in f.relative_to(src).parts[:-1] and f.name != "tests.rs"}
    edges = imports(src, files)
    reaches = {m: reach(edges, m) for m in edges}
    options = flags(a.tree, a.command)
    codes = {me: code_of(f.read_text()) for f, me in files.items()}
    per_option = {}
    for o in options:
        pat = re.compile(rf"\.{o}\b(?!\s*\()|\b{o}\s*:(?!:)")
        rooms = sorted(me for me, code in codes.items() if pat.search(code))
        climbs = sorted(r for r in rooms if any(q != r and q in reaches[r] and r in reaches[q] for q in rooms))
        per_option[o] = {"rooms": ["::".join(r) for r in rooms], "climbs_back": ["::".join(r) for r in climbs]}
    stays = sum(len(v["rooms"]) for v in per_option.values())
    rooms = len({r for v in per_option.values() for r in v["rooms"]})
    climbs = sum(len(v["climbs_back"]) for v in per_option.values())
    out = {"command": a.command, "options": len(options), "stays": stays, "rooms": rooms, "climbs_back": climbs, "per_option": per_option}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.command}: {len(options)} options, {stays} stays in {rooms} rooms, {climbs} climbs back")
        for o, v in per_option.items():
            if v["climbs_back"]:
                print(f"  {o}: {', '.join(v['climbs_back'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
