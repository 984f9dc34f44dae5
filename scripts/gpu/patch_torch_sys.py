#!/usr/bin/env python3
"""Make a copy of torch-sys compile against a libtorch that lacks some of its operators.

tch 0.26's torch-sys wraps every ATen operator of PyTorch 2.13 in `libtch/torch_api_generated.cpp`
(one `atg_*` C function each). Against an older libtorch (2.11 on the GPU machines used so far)
the wrappers of operators added since then do not compile. This script finds them by compiling
the file against the target headers (`-fsyntax-only`, so no code is generated) and reading the
compiler's errors: every error line inside a wrapper marks that wrapper. The body of each marked
wrapper (what `PROTECT( ... )` guards) becomes a `throw`, so calling it gives tch's usual error
instead of a link failure; dualedit calls none of them. It repeats until the file compiles (a
fixed point: an error outside any wrapper, or one that survives a patch, stops it with the
compiler's message). No hand-kept list: the list it writes (`--list`) is the compiler's verdict.

Usage: patch_torch_sys.py --torch-sys DIR --libtorch DIR/torch [--list FILE] [--cxx g++]
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

GENERATED = "torch_api_generated.cpp"
SIGNATURE = re.compile(r"^[A-Za-z_][\w\s\*]*\batg_\w+\(.*\)\s*\{\s*$")
ERROR = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):\d+: error: (?P<msg>.*)$")


def compile_errors(cxx, libtch, include, source):
    """(line, message) of every error the compiler reports in `source`, and the raw log."""
    cmd = [
        cxx, "-fsyntax-only", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", "-w",
        "-I", str(include), "-I", str(include / "torch/csrc/api/include"), "-I", str(libtch),
        str(libtch / source),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    errors, foreign = [], []
    for raw in proc.stderr.splitlines():
        m = ERROR.match(raw)
        if not m:
            continue
        if Path(m["file"]).name == source:
            errors.append((int(m["line"]), m["msg"]))
        else:
            foreign.append(raw)
    if proc.returncode != 0 and not errors:
        sys.exit(f"patch_torch_sys: {source} does not compile, and not inside a wrapper:\n{proc.stderr[-4000:]}")
    return errors, foreign, proc.stderr


def wrapper_spans(lines):
    """[(name, first line index, last line index)] of the `atg_*` functions, 0-based, inclusive."""
    spans, start, name = [], None, None
    for i, line in enumerate(lines):
        if start is None and SIGNATURE.match(line):
            start, name = i, re.search(r"\b(atg_\w+)\(", line).group(1)
        elif start is not None and line.rstrip() == "}":
            spans.append((name, start, i))
            start = None
    return spans


def neutralise(lines, name, first, last):
    """Replace what PROTECT guards in lines[first..=last] with a throw; returns the new lines."""
    body = lines[first:last + 1]
    try:
        open_at = next(i for i, l in enumerate(body) if l.strip() == "PROTECT(")
        close_at = next(i for i in range(open_at + 1, len(body)) if body[i].strip() == ")")
    except StopIteration:
        sys.exit(f"patch_torch_sys: {name} has no PROTECT( ... ) block; cannot neutralise it")
    msg = f"{name}: this operator is not in the libtorch dualedit was built against (scripts/gpu/build.sh)"
    throw = f'    throw std::runtime_error("{msg}");\n'
    return body[:open_at + 1] + [throw] + body[close_at:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-sys", required=True, type=Path, help="the copy of torch-sys to patch in place")
    ap.add_argument("--libtorch", required=True, type=Path, help="libtorch root holding include/ (the wheel's torch/)")
    ap.add_argument("--list", type=Path, help="write the neutralised wrappers here, one per line")
    ap.add_argument("--cxx", default="g++")
    ap.add_argument("--max-rounds", type=int, default=4)
    args = ap.parse_args()
    libtch = args.torch_sys / "libtch"
    include = args.libtorch / "include"
    src = libtch / GENERATED
    if not src.is_file():
        sys.exit(f"patch_torch_sys: {src} not found (is --torch-sys a torch-sys source copy?)")
    if not (include / "ATen/ATen.h").is_file():
        sys.exit(f"patch_torch_sys: {include}/ATen/ATen.h not found (is --libtorch the wheel's torch/ folder?)")

    patched = []
    for round_ in range(1, args.max_rounds + 1):
        errors, foreign, log = compile_errors(args.cxx, libtch, include, GENERATED)
        if not errors:
            break
        lines = src.read_text().splitlines(keepends=True)
        spans = wrapper_spans(lines)
        marked = {}
        for line, msg in errors:
            hit = next((s for s in spans if s[1] <= line - 1 <= s[2]), None)
            if hit is None:
                sys.exit(f"patch_torch_sys: error outside any wrapper at {GENERATED}:{line}: {msg}")
            if hit[0] in patched:
                sys.exit(f"patch_torch_sys: {hit[0]} still fails after neutralising it: {msg}")
            marked[hit[0]] = hit
        print(f"round {round_}: {len(errors)} errors in {len(marked)} wrappers", file=sys.stderr)
        # Back to front, so earlier spans keep their line numbers.
        for name, first, last in sorted(marked.values(), key=lambda s: -s[1]):
            lines[first:last + 1] = neutralise(lines, name, first, last)
        src.write_text("".join(lines))
        patched.extend(sorted(marked))
    else:
        sys.exit(f"patch_torch_sys: still failing after {args.max_rounds} rounds")
    # The hand-written part must compile as it is.
    errors, foreign, log = compile_errors(args.cxx, libtch, include, "torch_api.cpp")
    if errors or foreign:
        sys.exit(f"patch_torch_sys: torch_api.cpp does not compile against this libtorch:\n{log[-4000:]}")
    if args.list:
        args.list.write_text("".join(f"{p}\n" for p in sorted(patched)))
    print(f"neutralised {len(patched)} wrappers: {' '.join(sorted(patched))}", file=sys.stderr)


if __name__ == "__main__":
    main()
