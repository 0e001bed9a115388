"""Instrument the LLVM IR of a shader library for the CPU Metal executor.

Every load, store, atomic and memory intrinsic whose address is not plainly a
local variable of the function (an alloca) gets a call

    call void @__mx_access(ptr %address, i64 <bytes>, i32 <flags>)

in front of it. At run time the engine tells device buffers, threadgroup
memory and thread-private memory apart by address, checks bounds, counts
bytes per buffer and looks for races on threadgroup memory (see
csrc/cpu_metal/engine.cpp). The flags carry read/write/atomic, the alignment
the compiler assumed (a Metal vector load must be aligned) and an index into
a table of source positions, so an error can name the line.

Integer division by zero (or INT_MIN / -1) would trap on the CPU; the GPU
gives an unspecified value. Such divisions are made to divide by 1 instead.

The IR is the output of clang -O2 -gline-tables-only on the translated
shader. The instrumenter insists on understanding every memory instruction:
an unknown one is an error, not a silent gap in the checks.
"""

from __future__ import annotations

import re

__all__ = ["instrument", "InstrumentError"]

# Keep in step with mx_abi.h.
ACC_READ, ACC_WRITE, ACC_ATOMIC = 1, 2, 4
ALIGN_SHIFT, SITE_SHIFT = 4, 8
MAX_SITES = 1 << 24


class InstrumentError(Exception):
    pass


_NAME = r"%[-a-zA-Z$._0-9]+|%\"[^\"]*\""
_DEFINE_RE = re.compile(r"^define\b.*?@(\"[^\"]+\"|[-a-zA-Z$._0-9]+)\(")
_ASSIGN_RE = re.compile(rf"^\s*({_NAME}) = (.*)$")
_DBG_RE = re.compile(r", !dbg (![0-9]+)")
_ALIGN_RE = re.compile(r"\balign ([0-9]+)")
_MEMINTR_RE = re.compile(r"call void @llvm\.(memcpy|memmove|memset)(?:\.inline)?\.[^(]*\((.*)\)")
_DIV_RE = re.compile(rf"^(sdiv|udiv|srem|urem)( exact)? (.+?) ({_NAME}|-?[0-9]+), ({_NAME})$")


def _split_top(s: str) -> list[str]:
    """Split at commas outside (), [], {}, <>."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur).strip())
    return parts


def _first_type(s: str) -> tuple[str, str]:
    """Split 'TYPE rest' where TYPE may be bracketed: <4 x half>, { ... }, [N x T]."""
    s = s.strip()
    if s[0] in "<{[":
        depth = 0
        for i, ch in enumerate(s):
            if ch in "<{[":
                depth += 1
            elif ch in ">}]":
                depth -= 1
                if depth == 0:
                    return s[: i + 1], s[i + 1 :].strip()
    m = re.match(r"(ptr(?: addrspace\(\d+\))?|[^\s,]+)\s*(.*)$", s)
    return m.group(1), m.group(2)


def _sizeof(ty: str) -> str:
    return f"ptrtoint (ptr getelementptr ({ty}, ptr null, i32 1) to i64)"


def _align_bits(text: str) -> int:
    m = _ALIGN_RE.search(text)
    align = int(m.group(1)) if m else 1
    return min(align.bit_length() - 1, 15)


class _Metadata:
    """Source positions from the debug metadata."""

    def __init__(self, lines: list[str]):
        self.nodes: dict[str, str] = {}
        for line in lines:
            m = re.match(r"^(![0-9]+) = (?:distinct )?(.*)$", line)
            if m:
                self.nodes[m.group(1)] = m.group(2)

    def _field(self, node: str, name: str):
        m = re.search(rf"\b{name}: (\"(?:[^\"\\]|\\.)*\"|[^,)]+)", self.nodes.get(node, ""))
        return m.group(1) if m else None

    def _file_of(self, scope: str | None) -> str:
        seen = 0
        while scope and seen < 64:
            f = self._field(scope, "file")
            if f and f.startswith("!"):
                name = self._field(f, "filename") or '"?"'
                return name.strip('"').rsplit("/", 1)[-1]
            scope = self._field(scope, "scope")
            seen += 1
        return "?"

    def position(self, dbg: str) -> str | None:
        """'file:line:col' of a location, preferring the innermost frame that
        is shader code rather than the executor's stand-in headers."""
        frames, node = [], dbg
        while node and node in self.nodes and len(frames) < 64:
            line = self._field(node, "line")
            col = self._field(node, "column") or "0"
            frames.append((self._file_of(self._field(node, "scope")), line, col))
            node = self._field(node, "inlinedAt")
        for file, line, col in frames:
            if not file.startswith("mx_") and line:
                return f"{file}:{line}:{col}"
        if frames and frames[0][1]:
            return f"{frames[0][0]}:{frames[0][1]}:{frames[0][2]}"
        return None


def instrument(ir: str) -> tuple[str, list[str]]:
    """Return the instrumented IR and the table of source positions."""
    lines = ir.split("\n")
    meta = _Metadata(lines)
    sites: list[str] = ["?"]
    site_index: dict[str, int] = {}
    out: list[str] = []
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return f"%__mx{counter[0]}"

    def site_of(line: str) -> tuple[int, str]:
        m = _DBG_RE.search(line)
        if not m:
            return 0, ""
        pos = meta.position(m.group(1))
        idx = 0
        if pos:
            idx = site_index.get(pos)
            if idx is None and len(sites) < MAX_SITES:
                idx = site_index[pos] = len(sites)
                sites.append(pos)
        return idx or 0, f", !dbg {m.group(1)}"

    in_function = skip_function = False
    private: set[str] = set()

    for line in lines:
        if not in_function:
            m = _DEFINE_RE.match(line)
            if m:
                in_function = True
                name = m.group(1).strip('"')
                # The access hook itself, and the library's glue the engine
                # calls outside any dispatch.
                skip_function = name == "__mx_access" or name.startswith("mx_library_")
                private = set()
            out.append(line)
            continue
        if line.startswith("}"):
            in_function = False
            out.append(line)
            continue
        if skip_function:
            out.append(line)
            continue

        m = _ASSIGN_RE.match(line)
        lhs, rhs = (m.group(1), m.group(2)) if m else (None, line.strip())
        if lhs and (rhs.startswith("alloca ") or rhs.startswith("getelementptr") and _based_on(rhs, private)):
            private.add(lhs)
            out.append(line)
            continue

        try:
            inserted = _instrument_instruction(lhs, rhs, line, private, site_of, fresh)
        except (IndexError, AttributeError, ValueError) as e:
            raise InstrumentError(f"the executor cannot parse this instruction ({e}): {line.strip()[:200]}") from None
        if inserted is None:
            out.append(line)
        else:
            out.extend(inserted)

    _check_nothing_missed(out)
    out.append(_site_table(sites))
    return "\n".join(out), sites


def _based_on(gep: str, private: set[str]) -> bool:
    m = re.search(rf"\bptr ({_NAME})", gep)
    return bool(m and m.group(1) in private)


def _call(ptr: str, size: str, flags: int, dbg: str) -> str:
    return f"  call void @__mx_access(ptr {ptr}, i64 {size}, i32 {flags}){dbg}"


def _instrument_instruction(lhs, rhs, line, private, site_of, fresh):
    def wanted(ptr: str) -> bool:
        return ptr.startswith("%") and ptr not in private

    def flags(kind: int, text: str, site: int) -> int:
        return kind | (_align_bits(text) << ALIGN_SHIFT) | (site << SITE_SHIFT)

    body = _DBG_RE.sub("", rhs)
    body = re.sub(r", ![a-z.]+ ![0-9]+", "", body)  # other metadata

    if body.startswith("load "):
        rest = re.sub(r"^load (atomic )?(volatile )?", "", body)
        kind = ACC_READ | (ACC_ATOMIC if " atomic " in f" {body} " else 0)
        ty, after = _first_type(rest)
        ops = _split_top(after.lstrip(", "))
        ptr = ops[0].split()[-1]
        if not wanted(ptr):
            return None
        site, dbg = site_of(line)
        return [_call(ptr, _sizeof(ty), flags(kind, body, site), dbg), line]

    if body.startswith("store "):
        rest = re.sub(r"^store (atomic )?(volatile )?", "", body)
        kind = ACC_WRITE | (ACC_ATOMIC if body.startswith("store atomic") else 0)
        ops = _split_top(rest)
        ty, _ = _first_type(ops[0])
        ptr = ops[1].split()[-1]
        if not wanted(ptr):
            return None
        site, dbg = site_of(line)
        return [_call(ptr, _sizeof(ty), flags(kind, body, site), dbg), line]

    if body.startswith("atomicrmw ") or body.startswith("cmpxchg "):
        rest = re.sub(r"^(atomicrmw|cmpxchg)( weak)?( volatile)?( [a-z_]+(?= ptr))? ", "", body)
        ops = _split_top(rest)
        ptr = ops[0].split()[-1]
        ty, _ = _first_type(ops[1])
        if not wanted(ptr):
            return None
        site, dbg = site_of(line)
        return [_call(ptr, _sizeof(ty), flags(ACC_READ | ACC_WRITE | ACC_ATOMIC, body, site), dbg), line]

    mi = _MEMINTR_RE.search(body)
    if mi:
        which, args = mi.group(1), _split_top(mi.group(2))
        size = args[2].split()[-1]
        size_ty = args[2].split()[0]
        site, dbg = site_of(line)
        result = []
        if size_ty != "i64":
            wide = fresh()
            result.append(f"  {wide} = zext {size_ty} {size} to i64")
            size = wide
        calls = []
        dst = args[0].split()[-1]
        if wanted(dst):
            calls.append(_call(dst, size, flags(ACC_WRITE, args[0], site), dbg))
        if which != "memset":
            src = args[1].split()[-1]
            if wanted(src):
                calls.append(_call(src, size, flags(ACC_READ, args[1], site), dbg))
        return result + calls + [line] if calls else None

    md = _DIV_RE.match(body) if lhs else None
    if md:
        op, exact, ty, num, den = md.groups()
        zero = fresh()
        safe = fresh()
        res = [f"  {zero} = icmp eq {ty} {den}, zeroinitializer" if ty.startswith("<")
               else f"  {zero} = icmp eq {ty} {den}, 0"]
        if ty.startswith("<"):
            one = "<" + ", ".join([f"{_first_type(ty[1:-1].split(' x ', 1)[1])[0]} 1"] * int(ty[1:].split(" x ")[0])) + ">"
            res.append(f"  {safe} = select <{ty[1:].split(' x ')[0]} x i1> {zero}, {ty} {one}, {ty} {den}")
        else:
            if op in ("sdiv", "srem") and num.startswith("%"):
                bits = int(ty[1:])
                minus1, minval, ovf, bad = fresh(), fresh(), fresh(), fresh()
                res += [
                    f"  {minus1} = icmp eq {ty} {den}, -1",
                    f"  {minval} = icmp eq {ty} {num}, {-(1 << (bits - 1))}",
                    f"  {ovf} = and i1 {minus1}, {minval}",
                    f"  {bad} = or i1 {zero}, {ovf}",
                ]
                zero = bad
            res.append(f"  {safe} = select i1 {zero}, {ty} 1, {ty} {den}")
        res.append(f"  {lhs} = {op}{exact or ''} {ty} {num}, {safe}")
        return res

    return None


def _check_nothing_missed(out: list[str]):
    # Intrinsics that touch memory in ways the instrumenter does not model.
    # Vectorisation is off, so these should never appear; if one does, the
    # checks would have a hole, so refuse.
    for line in out:
        s = line.strip()
        if s.startswith("declare"):
            continue
        for name in ("@llvm.masked.", "@llvm.matrix.column.major", "@llvm.experimental.vp."):
            if name in s:
                raise InstrumentError(f"the executor cannot instrument this instruction: {s[:200]}")


def _site_table(sites: list[str]) -> str:
    decls, refs = [], []
    for i, s in enumerate(sites):
        data = s.encode()[:200] + b"\0"
        enc = "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c:02X}" for c in data)
        decls.append(f'@__mx_site_{i} = private unnamed_addr constant [{len(data)} x i8] c"{enc}"')
        refs.append(f"ptr @__mx_site_{i}")
    return "\n".join(
        decls
        + [
            f"@__mx_sites = private constant [{len(sites)} x ptr] [{', '.join(refs)}]",
            "define dso_local ptr @mx_library_sites(ptr %n) {",
            f"  store i32 {len(sites)}, ptr %n",
            "  ret ptr @__mx_sites",
            "}",
            "",
        ]
    )
