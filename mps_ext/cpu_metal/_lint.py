"""Checks for Metal rules that C++ would let through.

`python -m mps_ext.cpu_metal check FILES` runs these on each shader, then
compiles it with Metal's address spaces as clang address spaces.
"""

from __future__ import annotations

import re

from . import _translate

__all__ = ["lint"]

_METAL_HEADER = re.compile(r"^metal_[a-z_]+$")
_INCLUDE = re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.M)


def _find_cycles(functions: list[_translate.Function]) -> list[list[str]]:
    graph = {f.name: sorted(c for c in f.calls) for f in functions}
    cycles, seen_cycles = [], set()
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]):
        state[name] = 1
        for callee in graph.get(name, ()):
            if callee not in graph:
                continue
            if state.get(callee) == 1:
                cyc = path[path.index(callee):] + [callee]
                key = frozenset(cyc)
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    cycles.append(cyc)
            elif state.get(callee) is None:
                visit(callee, path + [callee])
        state[name] = 2

    for f in functions:
        if f.name not in state:
            visit(f.name, [f.name])
    return cycles


def lint_includes(source: str, filename: str) -> list[str]:
    """Standard-library headers: Metal has only its own."""
    findings = []
    for m in _INCLUDE.finditer(source):
        header = m.group(1).strip()
        if not _METAL_HEADER.match(header):
            line = source.count("\n", 0, m.start()) + 1
            findings.append(f"{filename}:{line}: <{header}> is not a Metal header; Metal has no C or C++ standard library")
    return findings


def lint(translation: _translate.Translation) -> list[str]:
    """Findings in the preprocessed shader, as 'file:line: message'."""
    findings = []

    # double: Metal has none (and the executor's build turns literals into float).
    text = translation.text
    tr = _translate._Translator(text)  # for positions in the preprocessed text
    for tok in tr.toks:
        if tok.kind == "ident" and tok.text == "double":
            file, line = tr.where(tok.start)
            findings.append(f"{file}:{line}: Metal has no double; use float")

    by_name = {f.name: f for f in translation.functions}
    for cyc in _find_cycles(translation.functions):
        f = by_name[cyc[0]]
        findings.append(f"{f.file}:{f.line}: recursion is not allowed in Metal: {' -> '.join(cyc)}")

    for f in translation.functions:
        for p in f.params:
            if f.is_kernel and not p.attribute:
                findings.append(
                    f"{f.file}:{p.line}: parameter '{p.name}' of kernel '{f.name}' has no attribute "
                    "([[buffer(i)]], [[threadgroup(i)]] or a builtin such as [[thread_position_in_grid]])"
                )
            pointer = p.is_pointer or (f.is_kernel and p.is_reference)
            if pointer and not p.address_space:
                findings.append(
                    f"{f.file}:{p.line}: parameter '{p.name}' of '{f.name}' is a pointer or reference without an "
                    "address space (device, constant, threadgroup or thread)"
                )
    return sorted(set(findings), key=lambda s: (s.split(":")[0], int(s.split(":")[1]) if s.split(":")[1].isdigit() else 0, s))
