"""Instrument the LLVM IR of a shader library for the CPU Metal executor.

The IR is clang's front-end output for the translated shader (no LLVM
passes: every function is still a function, every local an alloca), with
line tables. It is instrumented here, then optimised with the
instrumentation in place. The instrumenter insists on understanding every
memory instruction: an unknown one is an error, not a silent gap in the
checks.

Memory. Every load, store, atomic and memory intrinsic whose address is not
plainly a local variable of the function (an alloca) gets a call

    call void @__mx_access(ptr %address, i64 <bytes>, i32 <flags>)

in front of it. At run time the engine tells device buffers, threadgroup
memory and thread-private memory apart by address, checks bounds, counts
bytes per buffer and looks for races on threadgroup memory (see
executor/csrc/engine.cpp). The flags carry read/write/atomic, the alignment
the compiler assumed (a Metal vector load must be aligned) and an index into
a table of source positions, so an error can name the line.

SIMT positions. A simd operation runs over the lanes that are on the same
control-flow path, as on a GPU. Every simd operation and barrier of
mx_metal.h goes through @__mx_simd or @__mx_barrier; a function "reaches" one
if it calls one of them or a function that reaches one. In shader functions
(not the executor's headers) every call of such a function is bracketed by
@__mx_enter(key, site, depth) and @__mx_leave(), and every natural loop that
contains such a call gets @__mx_loop(key, site, depth) at its header. A
lane's position is then its stack of calls and loop iterations (engine.cpp
compares positions). `key` numbers the calls and loops of a function in
reverse post-order of its control-flow graph (so a key comes after every key
that can run before it in one pass through the function, and a loop's key
before everything in and after the loop); `depth` counts the enclosing
instrumented loops of the function, so the engine can drop the frames of
loops that were left without instrumenting loop exits.

Also:
- Multiply-adds: `a * b + c` within one statement is contracted to one
  fma (fuse_multiply_adds), as Metal's Safe math mode does; across
  statements nothing is fused (docs/dev/contributing.md, "Math mode").
- A vector comparison's result (clang: `sext <N x i1>`, -1 for true)
  becomes `zext` (1 for true): Metal's comparison gives a bool vector, and
  bool converts to 1.
- Integer division by zero (or INT_MIN / -1) would trap on the CPU; the GPU
  gives an unspecified value (MSL 3.1 of the specification), so in shader
  code it is an error naming the line (@__mx_arith_check), as is `%` with a
  negative operand, which Metal leaves undefined. Executor code divides by 1
  instead.
- Shifts: Metal shifts by the low log2(N) bits of the amount (N the width
  of the left operand, or of its elements; MSL 3.1), where C++ is
  undefined, so shader code's shift amounts are masked to that.
- A float-to-integer conversion (fptosi/fptoui) in shader code is checked:
  NaN or a value outside the integer's range is undefined in Metal, and the
  engine reports it with the line (@__mx_convert_check).
- float -> bfloat conversions (fptrunc) flush a denormal input to a zero of
  its sign, as Apple GPUs do: the CPU's conversion is integer rounding,
  which the executor's denormal flushing (engine.cpp) does not reach. The
  test is `x == 0`, so with MPS_EXT_EXECUTOR_DENORMALS=keep denormals stay.
- The thread-private memory each kernel may need (its allocas, along the
  deepest chain of calls) is exported as mx_library_frames, so the engine can
  give fibers stacks large enough.

After optimisation, count_ops adds counters of the 64-bit integer
divisions and multiplications, 32-bit integer divisions by run-time values
and IEEE float divisions that are left (see _counted_op), and
kernel_info_table the static costs of each kernel (_analysis.py) as
mx_library_kernel_info. count_ops also counts the instructions of shader
code each thread executes (_issued), for the issue-slot estimate of the
compute counters (docs/dev/contributing.md, "Compute efficiency").
"""

from __future__ import annotations

import functools
import re
import struct

__all__ = ["instrument", "count_ops", "kernel_info_table", "InstrumentError"]

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
_DIV_CHECK_RE = re.compile(rf"^(sdiv|udiv|srem|urem)( exact)? (.+?) ({_NAME}|-?[0-9]+), ({_NAME}|-?[0-9]+)$")


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


@functools.lru_cache(maxsize=None)
def _field_re(name: str) -> re.Pattern:
    """A debug-info node's field `name: value` (a quoted string or up to the next , or ))."""
    return re.compile(rf"\b{name}: (\"(?:[^\"\\]|\\.)*\"|[^,)]+)")


class _Metadata:
    """Source positions from the debug metadata."""

    def __init__(self, lines: list[str]):
        self.nodes: dict[str, str] = {}
        for line in lines:
            m = re.match(r"^(![0-9]+) = (?:distinct )?(.*)$", line)
            if m:
                self.nodes[m.group(1)] = m.group(2)
        # The nodes do not change: each lookup is answered once. count_ops
        # asks the file of every instruction's location (about 260,000 in a
        # large library, over far fewer distinct locations), and these
        # lookups were most of its time.
        self._fields: dict[tuple[str, str], str | None] = {}
        self._files: dict[str | None, str] = {}

    def _field(self, node: str, name: str):
        key = (node, name)
        if key not in self._fields:
            m = _field_re(name).search(self.nodes.get(node, ""))
            self._fields[key] = m.group(1) if m else None
        return self._fields[key]

    def _file_of(self, scope: str | None) -> str:
        if scope not in self._files:
            self._files[scope] = self._find_file(scope)
        return self._files[scope]

    def _find_file(self, scope: str | None) -> str:
        seen = 0
        while scope and seen < 64:
            f = self._field(scope, "file")
            if f and f.startswith("!"):
                name = self._field(f, "filename") or '"?"'
                return name.strip('"').rsplit("/", 1)[-1]
            scope = self._field(scope, "scope")
            seen += 1
        return "?"

    def file_of_node(self, node: str) -> str:
        """The file a debug-info node (a function's DISubprogram) is in."""
        return self._file_of(node)

    def innermost_file(self, dbg: str) -> str:
        """The file of a location's own scope (after inlining, the function
        the instruction was written in)."""
        return self._file_of(self._field(dbg, "scope"))

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


# ------------------------------------------------------------------ module --
_LABEL_RE = re.compile(r'^([-a-zA-Z$._0-9]+|"[^"]*"):(\s*;.*)?$')
_SUCC_RE = re.compile(r'label %([-a-zA-Z$._0-9]+|"[^"]*")')
_CALL_RE = re.compile(r'\bcall\b[^@]*@("[^"]+"|[-a-zA-Z$._0-9]+)\(')
_F2I_RE = re.compile(r"^(fptosi|fptoui) (.+) to (i[0-9]+|<[0-9]+ x i[0-9]+>)$")
_SHIFT_RE = re.compile(r"^(shl|lshr|ashr)((?: nuw| nsw| exact)*) (.*)$")
_F2BF_RE = re.compile(r"^fptrunc ((?:float|<[0-9]+ x float>) .+) to (bfloat|<[0-9]+ x bfloat>)$")
_SEXT_MASK_RE = re.compile(r"^sext (<[0-9]+ x i1>) ")
_LOOP_MD_RE = re.compile(r"!llvm\.loop (![0-9]+)")
_TERMINATORS = ("br ", "switch ", "ret", "unreachable", "indirectbr ", "invoke ", "callbr ", "resume ")

# The executor's own entry functions (mx_metal.h): never instrumented.
_HOOKS = {"__mx_access", "__mx_enter", "__mx_leave", "__mx_loop", "__mx_convert_check", "__mx_arith_check",
          "__mx_simd", "__mx_barrier", "__mx_op_counts"}
# Every simd operation and barrier of mx_metal.h goes through one of these.
_SYNC = {"__mx_simd", "__mx_barrier"}
# Files whose functions are the executor's, not the shader's.
_EXECUTOR_FILES = ("mx_metal.h", "mx_abi.h", "<executor entry points>")


class _Block:
    def __init__(self, label: str, label_line: str | None):
        self.label = label
        self.label_line = label_line
        self.insts: list[list[str]] = []  # each instruction's lines (a switch spans several)

    def terminator(self) -> str:
        return " ".join(self.insts[-1]) if self.insts else ""

    def successors(self) -> list[str]:
        t = self.terminator().strip()
        if not t.startswith(_TERMINATORS):
            return []
        return _SUCC_RE.findall(t)


class _Function:
    def __init__(self, header: str):
        self.header = header
        m = _DEFINE_RE.match(header)
        self.name = m.group(1).strip('"')
        d = re.search(r"!dbg (![0-9]+)", header)
        self.dbg = d.group(1) if d else None
        self.blocks: list[_Block] = []
        self.file = "?"

    def lines(self) -> list[str]:
        out = [self.header]
        for i, b in enumerate(self.blocks):
            if i:
                out.append("")
            if b.label_line is not None:
                out.append(b.label_line)
            for inst in b.insts:
                out.extend(inst)
        out.append("}")
        return out


def _parse(lines: list[str]) -> list:
    """The module as a list of plain lines and _Function objects."""
    items: list = []
    fn: _Function | None = None
    block: _Block | None = None
    pending: list[str] | None = None  # an instruction spanning lines
    for line in lines:
        if fn is None:
            if _DEFINE_RE.match(line) and line.rstrip().endswith("{"):
                fn = _Function(line)
                block = _Block("%entry", None)
                fn.blocks.append(block)
            else:
                items.append(line)
            continue
        if pending is not None:
            pending.append(line)
            if line.strip().startswith("]"):
                pending = None
            continue
        if line.startswith("}"):
            fn.blocks = [b for b in fn.blocks if b.insts or b.label_line is not None]
            items.append(fn)
            fn = block = None
            continue
        s = line.strip()
        if not s or s.startswith(";"):
            continue
        m = _LABEL_RE.match(s)
        if m and not line.startswith(" "):
            block = _Block(m.group(1), line)
            fn.blocks.append(block)
            continue
        inst = [line]
        block.insts.append(inst)
        if s.startswith("switch ") or re.search(r"= switch ", s):
            if s.endswith("["):
                pending = inst
    if fn is not None:
        raise InstrumentError("the IR ends inside a function")
    return items


def _callee(inst: list[str]) -> str | None:
    m = _CALL_RE.search(inst[0])
    return m.group(1).strip('"') if m else None


# --------------------------------------------------------------- analysis --
def _reverse_postorder(fn: _Function) -> list[_Block]:
    by_label = {b.label: b for b in fn.blocks}
    seen, post = set(), []
    stack = [(fn.blocks[0], iter(fn.blocks[0].successors()))]
    seen.add(fn.blocks[0].label)
    while stack:
        b, it = stack[-1]
        nxt = next(it, None)
        if nxt is None:
            post.append(b)
            stack.pop()
        elif nxt in by_label and nxt not in seen:
            seen.add(nxt)
            stack.append((by_label[nxt], iter(by_label[nxt].successors())))
    return post[::-1]


def _dominators(rpo: list[_Block]) -> dict[str, str]:
    """Immediate dominators (Cooper, Harvey and Kennedy)."""
    index = {b.label: i for i, b in enumerate(rpo)}
    preds: dict[str, list[str]] = {b.label: [] for b in rpo}
    for b in rpo:
        for s in b.successors():
            if s in preds:
                preds[s].append(b.label)
    idom = {rpo[0].label: rpo[0].label}

    def intersect(a: str, b: str) -> str:
        while a != b:
            while index[a] > index[b]:
                a = idom[a]
            while index[b] > index[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            new = None
            for p in preds[b.label]:
                if p in idom:
                    new = p if new is None else intersect(p, new)
            if new is not None and idom.get(b.label) != new:
                idom[b.label] = new
                changed = True
    return idom


def _dominates(idom: dict[str, str], a: str, b: str) -> bool:
    while True:
        if a == b:
            return True
        up = idom.get(b)
        if up is None or up == b:
            return False
        b = up


def _natural_loops(fn: _Function, rpo: list[_Block], idom) -> dict[str, set[str]]:
    """Header label -> labels of the loop's blocks. Irreducible control flow
    (a cycle not entered through one header) is an error."""
    index = {b.label: i for i, b in enumerate(rpo)}
    preds: dict[str, list[str]] = {b.label: [] for b in rpo}
    for b in rpo:
        for s in b.successors():
            if s in preds:
                preds[s].append(b.label)
    loops: dict[str, set[str]] = {}
    for b in rpo:
        for h in b.successors():
            if h not in index or index[h] > index[b.label]:
                continue
            if not _dominates(idom, h, b.label):
                raise InstrumentError(f"function {fn.name} has irreducible control flow, which the executor cannot "
                                      "order for simd operations")
            body = loops.setdefault(h, {h})
            work = [b.label]
            while work:
                x = work.pop()
                if x not in body:
                    body.add(x)
                    work.extend(preds[x])
    return loops


# ------------------------------------------------------------ frame sizes --
_PRIM_SIZES = {"half": 2, "bfloat": 2, "float": 4, "double": 8, "ptr": 8, "x86_fp80": 16, "fp128": 16}


class _TypeSizes:
    """Allocation sizes of IR types (x86-64 and arm64 data layouts)."""

    def __init__(self, lines: list[str]):
        self.named: dict[str, str] = {}
        for line in lines:
            m = re.match(r'^(%[-a-zA-Z$._0-9]+|%"[^"]*") = type (.*)$', line)
            if m:
                self.named[m.group(1)] = m.group(2).strip()
        self.cache: dict[str, tuple[int, int]] = {}

    def size_align(self, ty: str) -> tuple[int, int]:
        ty = ty.strip()
        if ty in self.cache:
            return self.cache[ty]
        self.cache[ty] = (8, 8)  # a recursive type refers to itself through a pointer
        r = self._compute(ty)
        self.cache[ty] = r
        return r

    def _compute(self, ty: str) -> tuple[int, int]:
        if ty in _PRIM_SIZES:
            n = _PRIM_SIZES[ty]
            return n, n
        if ty.startswith("ptr"):
            return 8, 8
        m = re.fullmatch(r"i([0-9]+)", ty)
        if m:
            n = max(1, (int(m.group(1)) + 7) // 8)
            p2 = 1 << (n - 1).bit_length()
            return p2, min(p2, 16)
        if ty.startswith("%"):
            body = self.named.get(ty, "opaque")
            return (0, 1) if body == "opaque" else self.size_align(body)
        if ty.startswith("<{") or ty.startswith("{"):
            packed = ty.startswith("<{")
            inner = ty[2:-2] if packed else ty[1:-1]
            off, align = 0, 1
            for field in _split_top(inner) if inner.strip() else []:
                fs, fa = self.size_align(field)
                if not packed:
                    off = (off + fa - 1) // fa * fa
                    align = max(align, fa)
                off += fs
            return (off + align - 1) // align * align, align
        m = re.fullmatch(r"\[([0-9]+) x (.*)\]", ty)
        if m:
            es, ea = self.size_align(m.group(2))
            return int(m.group(1)) * es, ea
        m = re.fullmatch(r"<([0-9]+) x (.*)>", ty)
        if m:
            es, _ = self.size_align(m.group(2))
            n = int(m.group(1)) * es
            p2 = 1 << max(0, (n - 1).bit_length())
            return p2, p2
        return 16, 16  # unknown: count it, generously


def _alloca_bytes(inst: str, sizes: _TypeSizes) -> int:
    m = re.search(r"= alloca (?:inalloca )?(.*)$", inst)
    if not m:
        return 0
    ty, rest = _first_type(m.group(1))
    size, align = sizes.size_align(ty)
    count = re.match(r",\s*i[0-9]+ ([0-9]+)", rest)
    if count:
        size *= int(count.group(1))
    a = re.search(r"\balign ([0-9]+)", rest)
    return size + (int(a.group(1)) if a else align)


# Bytes of stack a call costs beyond the callee's allocas: return address,
# saved registers, spills of the optimised code.
_CALL_OVERHEAD = 256


def _frames(functions: dict[str, _Function], sizes: _TypeSizes) -> dict[str, int]:
    own = {n: sum(_alloca_bytes(i[0], sizes) for b in f.blocks for i in b.insts if " alloca " in i[0])
           for n, f in functions.items()}
    callees = {n: {c for b in f.blocks for i in b.insts if (c := _callee(i)) in functions}
               for n, f in functions.items()}
    memo: dict[str, int] = {}

    def frame(n: str, active: frozenset) -> int:
        if n in memo:
            return memo[n]
        deepest = max((frame(c, active | {n}) for c in callees[n] if c not in active), default=0)
        memo[n] = own[n] + _CALL_OVERHEAD + deepest
        return memo[n]

    return {n: frame(n, frozenset()) for n in functions}


# ------------------------------------------------------------- instrument --
_FMULADD_CALL = re.compile(r"@llvm\.fmuladd\.")
_FMULADD_DECLARE = re.compile(r"^declare .*@llvm\.fmuladd\.(\S+)\(")


def fuse_multiply_adds(ir: str) -> str:
    """Every multiply-add clang contracted (llvm.fmuladd: `a * b + c` within
    one statement, as Metal's Safe math mode contracts it) becomes llvm.fma,
    one rounding on every CPU: left as fmuladd, the CPU backend would fuse it
    only where the CPU has an FMA instruction."""
    have = set(re.findall(r"^declare .*@llvm\.fma\.(\S+)\(", ir, re.M))
    out = []
    for line in ir.split("\n"):
        m = _FMULADD_DECLARE.match(line)
        if m and m.group(1) in have:
            continue  # llvm.fma of this type is declared already
        out.append(_FMULADD_CALL.sub("@llvm.fma.", line))
    return "\n".join(out)


def instrument(ir: str) -> tuple[str, list[str]]:
    """Return the instrumented IR and the table of source positions."""
    ir = fuse_multiply_adds(ir)
    lines = ir.split("\n")
    meta = _Metadata(lines)
    items = _parse(lines)
    functions = {it.name: it for it in items if isinstance(it, _Function)}
    for f in functions.values():
        f.file = meta.file_of_node(f.dbg) if f.dbg else "?"

    sites: list[str] = ["?"]
    site_index: dict[str, int] = {}
    counter = [0]
    declares: set[str] = set()

    def fresh() -> str:
        counter[0] += 1
        return f"%__mx{counter[0]}"

    def site_at(dbg: str | None) -> int:
        pos = meta.position(dbg) if dbg else None
        if not pos:
            return 0
        idx = site_index.get(pos)
        if idx is None and len(sites) < MAX_SITES:
            idx = site_index[pos] = len(sites)
            sites.append(pos)
        return idx or 0

    def site_of(line: str) -> tuple[int, str]:
        m = _DBG_RE.search(line)
        if not m:
            return 0, ""
        return site_at(m.group(1)), f", !dbg {m.group(1)}"

    # Which functions reach a simd operation or barrier.
    calls = {n: {c for b in f.blocks for i in b.insts if (c := _callee(i))} for n, f in functions.items()}
    reaches = set(_SYNC)
    changed = True
    while changed:
        changed = False
        for n, cs in calls.items():
            if n not in reaches and cs & reaches:
                reaches.add(n)
                changed = True

    for f in functions.values():
        if f.name in _HOOKS or f.name.startswith("mx_library_"):
            continue
        shader = not f.file.startswith(_EXECUTOR_FILES) and f.file != "?"
        if shader and calls[f.name] & reaches:
            _positions(f, reaches, meta, site_of, site_at)
        _instrument_body(f, shader, site_of, fresh, declares)

    out: list[str] = []
    for it in items:
        if isinstance(it, _Function):
            out.extend(it.lines())
        else:
            out.append(it)
    _check_nothing_missed(out)
    existing = {m.group(1) for line in lines if line.startswith("declare")
                for m in [re.search(r"@([-a-zA-Z$._0-9]+)\(", line)] if m}
    out.extend(d for d in sorted(declares) if re.search(r"@([-a-zA-Z$._0-9]+)\(", d).group(1) not in existing)
    out.append(_site_table(sites))
    out.append(_frame_table(_frames(functions, _TypeSizes(lines))))
    return "\n".join(out), sites


def _positions(f: _Function, reaches: set[str], meta: "_Metadata", site_of, site_at):
    """Bracket calls that reach a simd operation or barrier, and mark the
    headers of the loops around them (see the module's doc)."""
    rpo = _reverse_postorder(f)
    idom = _dominators(rpo)
    loops = _natural_loops(f, rpo, idom)
    sync_blocks = {b.label for b in rpo for i in b.insts if _callee(i) in reaches}
    instrumented = {h: body for h, body in loops.items() if body & sync_blocks}

    def depth_of(label: str, exclude: str | None = None) -> int:
        return sum(1 for h, body in instrumented.items() if label in body and h != exclude)

    key = 0
    for b in rpo:
        new: list[list[str]] = []
        insts = b.insts
        if b.label in instrumented:
            key += 1
            k = 0
            while k < len(insts) and re.search(r"= phi ", insts[k][0]):
                new.append(insts[k])
                k += 1
            site, dbg = _loop_site(b.label, instrumented[b.label], rpo, meta, site_at)
            new.append([f"  call void @__mx_loop(i32 {key}, i32 {site}, i32 {depth_of(b.label, b.label)}){dbg}"])
            insts = insts[k:]
        for inst in insts:
            if _callee(inst) in reaches:
                key += 1
                site, dbg = site_of(inst[0])
                new.append([f"  call void @__mx_enter(i32 {key}, i32 {site}, i32 {depth_of(b.label)}){dbg}"])
                new.append(inst)
                new.append([f"  call void @__mx_leave(){dbg}"])
            else:
                new.append(inst)
        b.insts = new


def _loop_site(header: str, body: set[str], rpo: list[_Block], meta: "_Metadata", site_at) -> tuple[int, str]:
    """The loop's source position (the start location clang attaches to the
    back edge as !llvm.loop, else the loop's first line) and a !dbg for the
    call (every call in a function with debug info needs one)."""
    dbg = None
    for b in rpo:
        if b.label in body:
            for inst in b.insts:
                m = _DBG_RE.search(inst[0])
                if m:
                    dbg = dbg or m.group(1)
    for b in rpo:
        if b.label in body and header in b.successors():
            m = _LOOP_MD_RE.search(b.terminator())
            if m:
                for ref in re.findall(r"![0-9]+", meta.nodes.get(m.group(1), "")):
                    if meta.nodes.get(ref, "").startswith("!DILocation("):
                        return site_at(ref), f", !dbg {ref}"
    return (site_at(dbg), f", !dbg {dbg}") if dbg else (0, "")


def _instrument_body(f: _Function, shader: bool, site_of, fresh, declares: set[str]):
    private: set[str] = set()
    for b in f.blocks:
        new: list[list[str]] = []
        for inst in b.insts:
            line = inst[0]
            if len(inst) > 1:
                new.append(inst)
                continue
            m = _ASSIGN_RE.match(line)
            lhs, rhs = (m.group(1), m.group(2)) if m else (None, line.strip())
            if lhs and (rhs.startswith("alloca ") or rhs.startswith("getelementptr") and _based_on(rhs, private)):
                private.add(lhs)
                new.append(inst)
                continue
            if lhs and _SEXT_MASK_RE.match(rhs):
                # A comparison's mask: Metal's bool is 1 where true, not -1.
                new.append([line.replace(" = sext <", " = zext <", 1)])
                continue
            plain = _DBG_RE.sub("", rhs)
            if lhs and (mb := _F2BF_RE.match(plain)):
                new.extend([x] for x in _flush_to_bfloat(lhs, mb, line, fresh, declares))
                continue
            if lhs and shader:
                mc = _F2I_RE.match(plain)
                if mc:
                    new.extend([x] for x in _conversion_check(mc, line, site_of, fresh, declares))
                    new.append(inst)
                    continue
                ms = _SHIFT_RE.match(plain)
                if ms:
                    new.extend([x] for x in _masked_shift(lhs, ms, line, fresh))
                    continue
                md = _DIV_CHECK_RE.match(re.sub(r", ![a-z.]+ ![0-9]+", "", plain))
                if md and not (md.group(5).lstrip("-").isdigit() and int(md.group(5)) not in (0, -1)
                               and md.group(1) != "srem"):
                    new.extend([x] for x in _division_check(md, line, site_of, fresh, declares))
            try:
                inserted = _instrument_instruction(lhs, rhs, line, private, site_of, fresh)
            except (IndexError, AttributeError, ValueError) as e:
                raise InstrumentError(
                    f"the executor cannot parse this instruction ({e}): {line.strip()[:200]}"
                ) from None
            if inserted is None:
                new.append(inst)
            else:
                new.extend([x] for x in inserted)
        b.insts = new


def _double_hex(x: float) -> str:
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", x))[0]


def _vector(ty: str) -> tuple[int, str] | None:
    """(lanes, element type) of '<N x T>', else None."""
    v = re.fullmatch(r"<([0-9]+) x (.*)>", ty.strip())
    return (int(v.group(1)), v.group(2)) if v else None


def _splat(ty: str, value) -> str:
    """`value` as a constant of type ty (each element of a vector)."""
    vec = _vector(ty)
    if not vec:
        return str(value)
    return "<" + ", ".join([f"{vec[1]} {value}"] * vec[0]) + ">"


def _any(ty: str, cond: str, fresh, declares: set[str]) -> tuple[list[str], str]:
    """Lines reducing a comparison of type ty's shape to one i1 that is true
    if any element is."""
    vec = _vector(ty)
    if not vec:
        return [], cond
    n = vec[0]
    declares.add(f"declare i1 @llvm.vector.reduce.or.v{n}i1(<{n} x i1>)")
    r = fresh()
    return [f"  {r} = call i1 @llvm.vector.reduce.or.v{n}i1(<{n} x i1> {cond})"], r


# Keep in step with mx_abi.h (MX_ARITH_*).
ARITH_DIVIDE_BY_ZERO, ARITH_OVERFLOW, ARITH_NEGATIVE_REMAINDER = 0, 1, 2


def _division_check(m, line: str, site_of, fresh, declares: set[str]) -> list[str]:
    """Lines that call __mx_arith_check before an integer division or
    remainder of shader code: false for a zero divisor, for the smallest
    signed value divided by -1, and for `%` of a negative operand (Metal:
    "If one or both operands are negative, the results are undefined")."""
    op, _exact, ty, num, den = m.groups()
    vec = _vector(ty)
    bits = int((vec[1] if vec else ty)[1:])
    signed = op in ("sdiv", "srem")
    cmp_ty = f"<{vec[0]} x i1>" if vec else "i1"
    out: list[str] = []

    def cond(text: str) -> str:
        c = fresh()
        out.append(f"  {c} = {text}")
        lines, r = _any(ty, c, fresh, declares)
        out.extend(lines)
        return r

    zero = cond(f"icmp eq {ty} {den}, {_splat(ty, 0) if vec else 0}")
    bad, kind = zero, str(ARITH_DIVIDE_BY_ZERO)

    def also(flag: str, code: int):
        """`flag` is one more undefined case, named `code` where it holds."""
        nonlocal bad, kind
        k, b = fresh(), fresh()
        out.extend([f"  {k} = select i1 {flag}, i32 {code}, i32 {kind}", f"  {b} = or i1 {bad}, {flag}"])
        bad, kind = b, k

    if signed:
        minus1, minval = fresh(), fresh()
        out.extend([f"  {minus1} = icmp eq {ty} {den}, {_splat(ty, -1)}",
                    f"  {minval} = icmp eq {ty} {num}, {_splat(ty, -(1 << (bits - 1)))}"])
        also(cond(f"and {cmp_ty} {minus1}, {minval}"), ARITH_OVERFLOW)
        if op == "srem":
            nneg, dneg = fresh(), fresh()
            out.extend([f"  {nneg} = icmp slt {ty} {num}, {_splat(ty, 0) if vec else 0}",
                        f"  {dneg} = icmp slt {ty} {den}, {_splat(ty, 0) if vec else 0}"])
            also(cond(f"or {cmp_ty} {nneg}, {dneg}"), ARITH_NEGATIVE_REMAINDER)
        # a zero divisor is the first thing to name
        k3 = fresh()
        out.append(f"  {k3} = select i1 {zero}, i32 {ARITH_DIVIDE_BY_ZERO}, i32 {kind}")
        kind = k3
    ok = fresh()
    site, dbg = site_of(line)
    flags = (0x80 if signed else 0) | bits | (site << SITE_SHIFT)
    out += [f"  {ok} = xor i1 {bad}, true",
            f"  call void @__mx_arith_check(i1 zeroext {ok}, i32 {kind}, i32 {flags}){dbg}"]
    return out


def _masked_shift(lhs: str, m, line: str, fresh) -> list[str]:
    """A shift of shader code by the amount's low log2(N) bits, as Metal
    defines it (C++ leaves a shift by N or more undefined)."""
    op, attrs, rest = m.groups()
    ty, after = _first_type(rest)
    value, amount = _split_top(after)
    vec = _vector(ty)
    bits = int((vec[1] if vec else ty)[1:])
    if re.fullmatch(r"-?[0-9]+", amount) and 0 <= int(amount) < bits:
        return [line]
    masked = fresh()
    dbg = _DBG_RE.search(line)
    return [f"  {masked} = and {ty} {amount}, {_splat(ty, bits - 1)}",
            f"  {lhs} = {op}{attrs} {ty} {value}, {masked}" + (f", !dbg {dbg.group(1)}" if dbg else "")]


def _flush_to_bfloat(lhs: str, m, line: str, fresh, declares: set[str]) -> list[str]:
    """A float -> bfloat conversion whose input compares equal to zero (a
    denormal, while the engine flushes them) converts a zero of its sign."""
    src, dst = m.groups()
    ty, value = _first_type(src)
    vec = _vector(ty)
    suffix = f"v{vec[0]}f32" if vec else "f32"
    cmp_ty = f"<{vec[0]} x i1>" if vec else "i1"
    declares.add(f"declare {ty} @llvm.copysign.{suffix}({ty}, {ty})")
    zero, signed_zero, flushed = fresh(), fresh(), fresh()
    dbg = _DBG_RE.search(line)
    return [f"  {zero} = fcmp oeq {ty} {value}, zeroinitializer",
            f"  {signed_zero} = call {ty} @llvm.copysign.{suffix}({ty} zeroinitializer, {ty} {value})",
            f"  {flushed} = select {cmp_ty} {zero}, {ty} {signed_zero}, {ty} {value}",
            f"  {lhs} = fptrunc {ty} {flushed} to {dst}" + (f", !dbg {dbg.group(1)}" if dbg else "")]


def _conversion_check(m, line: str, site_of, fresh, declares: set[str]) -> list[str]:
    """Lines that call __mx_convert_check before a float-to-integer
    conversion: false for NaN or a value whose truncation is outside the
    integer's range."""
    op, src, dst = m.groups()
    src_ty, value = _first_type(src)
    signed = op == "fptosi"
    bits = int(re.search(r"i([0-9]+)", dst).group(1))
    lo = -(2.0 ** (bits - 1)) if signed else 0.0
    hi = 2.0 ** (bits - 1) if signed else 2.0 ** bits
    site, dbg = site_of(line)
    flags = (0x80 if signed else 0) | bits | (site << SITE_SHIFT)
    vec = re.match(r"<([0-9]+) x (.*)>", src_ty)
    ext, trunc, lo_ok, hi_ok, ok = fresh(), fresh(), fresh(), fresh(), fresh()
    if vec:
        n, elem = int(vec.group(1)), vec.group(2)
        dty, mty = f"<{n} x double>", f"<{n} x i1>"
        splat = lambda x: "<" + ", ".join([f"double {_double_hex(x)}"] * n) + ">"
        trunc_fn = f"llvm.trunc.v{n}f64"
        declares.add(f"declare {dty} @{trunc_fn}({dty})")
        declares.add(f"declare i1 @llvm.vector.reduce.and.v{n}i1({mty})")
        all_ok = fresh()
        ext_line = (f"  {ext} = fpext {src_ty} {value} to {dty}" if elem != "double"
                    else f"  {ext} = fadd {dty} {value}, zeroinitializer")
        return [
            ext_line,
            f"  {trunc} = call {dty} @{trunc_fn}({dty} {ext})",
            f"  {lo_ok} = fcmp oge {dty} {trunc}, {splat(lo)}",
            f"  {hi_ok} = fcmp olt {dty} {trunc}, {splat(hi)}",
            f"  {ok} = and {mty} {lo_ok}, {hi_ok}",
            f"  {all_ok} = call i1 @llvm.vector.reduce.and.v{n}i1({mty} {ok})",
            f"  call void @__mx_convert_check(i1 zeroext {all_ok}, i32 {flags}){dbg}",
        ]
    declares.add("declare double @llvm.trunc.f64(double)")
    ext_line = (f"  {ext} = fpext {src_ty} {value} to double" if src_ty != "double"
                else f"  {ext} = fadd double {value}, 0.0")
    return [
        ext_line,
        f"  {trunc} = call double @llvm.trunc.f64(double {ext})",
        f"  {lo_ok} = fcmp oge double {trunc}, {_double_hex(lo)}",
        f"  {hi_ok} = fcmp olt double {trunc}, {_double_hex(hi)}",
        f"  {ok} = and i1 {lo_ok}, {hi_ok}",
        f"  call void @__mx_convert_check(i1 zeroext {ok}, i32 {flags}){dbg}",
    ]


def _frame_table(frames: dict[str, int]) -> str:
    entries = sorted((int(n[len("__mx_entry_"):]), v) for n, v in frames.items()
                     if re.fullmatch(r"__mx_entry_[0-9]+", n))
    count = entries[-1][0] + 1 if entries else 0
    values = dict(entries)
    body = ", ".join(f"i64 {values.get(i, 0)}" for i in range(count))
    init = f"[{body}]" if count else "zeroinitializer"
    return "\n".join([
        f"@__mx_frames = private constant [{count} x i64] {init}",
        "define dso_local ptr @mx_library_frames(ptr %n) {",
        f"  store i32 {count}, ptr %n",
        "  ret ptr @__mx_frames",
        "}",
        "",
    ])


def _based_on(gep: str, private: set[str]) -> bool:
    m = re.search(rf"\bptr ({_NAME})", gep)
    return bool(m and m.group(1) in private)


def _pointer(operand: str) -> str:
    """The pointer of 'ptr %p', 'ptr addrspace(1) %p' or, in an atomic load
    or store, 'ptr %p syncscope("x") seq_cst'."""
    for word in operand.split():
        if word.startswith(("%", "@")):
            return word
    return operand.split()[-1]


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
        ptr = _pointer(ops[0])
        if not wanted(ptr):
            return None
        site, dbg = site_of(line)
        return [_call(ptr, _sizeof(ty), flags(kind, body, site), dbg), line]

    if body.startswith("store "):
        rest = re.sub(r"^store (atomic )?(volatile )?", "", body)
        kind = ACC_WRITE | (ACC_ATOMIC if body.startswith("store atomic") else 0)
        ops = _split_top(rest)
        ty, _ = _first_type(ops[0])
        ptr = _pointer(ops[1])
        if not wanted(ptr):
            return None
        site, dbg = site_of(line)
        return [_call(ptr, _sizeof(ty), flags(kind, body, site), dbg), line]

    if body.startswith("atomicrmw ") or body.startswith("cmpxchg "):
        rest = re.sub(r"^(atomicrmw|cmpxchg)( weak)?( volatile)?( [a-z_]+(?= ptr))? ", "", body)
        ops = _split_top(rest)
        ptr = _pointer(ops[0])
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
            one = (
                "<"
                + ", ".join([f"{_first_type(ty[1:-1].split(' x ', 1)[1])[0]} 1"] * int(ty[1:].split(" x ")[0]))
                + ">"
            )
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


# ------------------------------------------------------- arithmetic work --
# Keep in step with mx_abi.h.
OPS_INT64_DIVISIONS, OPS_INT64_MULTIPLICATIONS, OPS_INT32_DIVISIONS, OPS_FLOAT_DIVISIONS = 0, 1, 2, 3
OPS_INSTRUCTIONS = 4

# Not issued by a GPU as instructions of their own: phis (register
# assignment), and calls of LLVM's bookkeeping intrinsics.
_NOT_ISSUED_RE = re.compile(r"^\s*(?:%[^=]+= )?(?:phi |(?:tail |musttail |notail )?call [^@]*@llvm\."
                            r"(?:dbg|lifetime|assume|experimental\.noalias|invariant|pseudoprobe)\.?)")


def _issued(inst: list[str], meta: "_Metadata", shader_function: bool) -> bool:
    """Whether count_ops counts the instruction as one issue slot: an
    instruction of the shader's own code (by its location, which inlining
    keeps; without one, by its function's), not of the executor's stand-in
    headers (whose simdgroup_matrix operations the engine counts itself) or
    entry points, nor a call of the executor's hooks, and one a GPU issues
    (not a phi or an LLVM bookkeeping intrinsic)."""
    line = inst[0]
    if _NOT_ISSUED_RE.match(line) or line.strip() == "unreachable":
        return False
    callee = _callee(inst)
    if callee is not None and (callee in _HOOKS or callee.startswith("__mx_")):
        return False
    dbg = _DBG_RE.search(line)
    if not dbg:
        return shader_function
    file = meta.innermost_file(dbg.group(1))
    return not file.startswith(_EXECUTOR_FILES) and file != "?"

_INT_OP_RE = re.compile(rf"^\s*({_NAME}) = (mul|sdiv|udiv|srem|urem)((?: nuw| nsw| exact)*) (.*)$")
_FDIV_RE = re.compile(
    rf"^\s*({_NAME}) = fdiv((?: [a-z]+)*?) ((?:float|half|bfloat|<[0-9]+ x (?:float|half|bfloat)>) .*)$"
)
# Fast-math flags that let a compiler replace a division by a reciprocal
# and a multiply (Metal's fast math; `afn`: approximate functions).
_FAST_DIVISION_FLAGS = {"fast", "arcp", "afn"}


def _power_of_two(operand: str) -> bool:
    try:
        v = int(operand)
    except ValueError:
        return False
    v = abs(v)
    return v > 0 and v & (v - 1) == 0


def _counted_op(line: str) -> tuple[int, int] | None:
    """(counter, count) for an instruction that a GPU runs as a long
    sequence, else None. A vector counts once per element.
    - 64-bit integers: a division or remainder by a run-time value runs in
      software on Apple GPUs (they have no 64-bit divider); by a constant, a
      compiler multiplies by its reciprocal instead (one 64-bit multiply),
      or shifts (a power of two: nothing). A 64-bit mul is several 32-bit
      multiplies.
    - 32-bit (and narrower) integers: Apple GPUs have no integer divider
      either (Dougall Johnson's G13 reference lists no divide instruction;
      Mesa's AGX compiler lowers idiv/imod to a sequence), so a division by
      a run-time value is a software sequence of some tens of instructions;
      by a constant the optimiser has already made it a multiply-high.
    - float and half: an fdiv without fast-math flags is the IEEE-rounded
      division (Metal with fast math off), a reciprocal plus Newton-Raphson
      correction, several times the cost of `fast::divide` (a reciprocal and
      a multiply). LLVM has already made divisions by powers of two
      multiplications."""
    text = _DBG_RE.sub("", re.sub(r", ![a-z.]+ ![0-9]+", "", line))
    f = _FDIV_RE.match(text)
    if f:
        if set(f.group(2).split()) & _FAST_DIVISION_FLAGS:
            return None
        ty, _ = _first_type(f.group(3))
        vec = re.fullmatch(r"<([0-9]+) x .*>", ty)
        return OPS_FLOAT_DIVISIONS, int(vec.group(1)) if vec else 1
    m = _INT_OP_RE.match(text)
    if not m:
        return None
    op, rest = m.group(2), m.group(4)
    ty, after = _first_type(rest)
    vec = re.fullmatch(r"<([0-9]+) x i([0-9]+)>", ty)
    bits_m = re.fullmatch(r"i([0-9]+)", ty)
    if not vec and not bits_m:
        return None
    bits = int(vec.group(2) if vec else bits_m.group(1))
    n = int(vec.group(1)) if vec else 1
    operands = [x.strip() for x in _split_top(after)]
    divisor = operands[1] if len(operands) > 1 else ""
    if bits <= 32:
        return (OPS_INT32_DIVISIONS, n) if op != "mul" and divisor.startswith("%") else None
    if bits != 64:
        return None
    if op == "mul":
        return None if any(_power_of_two(x) for x in operands[:2]) else (OPS_INT64_MULTIPLICATIONS, n)
    if divisor.startswith("%"):
        return OPS_INT64_DIVISIONS, n
    return None if _power_of_two(divisor) else (OPS_INT64_MULTIPLICATIONS, n)


def count_ops(ir: str) -> str:
    """Count the work of _counted_op (64-bit integer divisions and
    multiplications, 32-bit integer divisions by run-time values, IEEE float
    divisions) every thread executes. Runs on the optimised (instrumented) IR, so that what is
    counted is what the optimiser left: constant divisions folded, invariant
    work hoisted out of loops. The shader's own code counts; the executor's
    stand-in library (mx_*.h) does not (its 64-bit arithmetic is a GPU
    instruction or not there at all). Address arithmetic of getelementptr
    is not a multiply instruction and is not counted: scaling an index by an
    element size is a shift or part of the load's addressing.

    It also counts, per basic block of shader code, the instructions the
    block issues (_issued) into OPS_INSTRUCTIONS, before the block's
    terminator: one count per executed IR instruction of the optimised
    shader, the estimate of issue slots (an IR instruction is not one GPU
    instruction; docs/dev/contributing.md, "Compute efficiency", says how
    far the estimate goes).

    Each function that has such work calls @__mx_op_counts() once (the
    running thread's counters, mx_abi.h) and adds to them after each
    instruction."""
    lines = ir.split("\n")
    meta = _Metadata(lines)
    items = _parse(lines)
    ids = [int(m.group(1)) for line in lines for m in [re.match(r"^!([0-9]+) = ", line)] if m]
    next_id = [max(ids, default=-1) + 1]
    new_metadata: list[str] = []
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return f"%__mxc{counter[0]}"

    def add(which: int, n: int) -> list[list[str]]:
        slot, old, total = fresh(), fresh(), fresh()
        return [[f"  {slot} = getelementptr inbounds i64, ptr %__mxops, i64 {which}"],
                [f"  {old} = load i64, ptr {slot}, align 8"],
                [f"  {total} = add i64 {old}, {n}"],
                [f"  store i64 {total}, ptr {slot}, align 8"]]

    for f in items:
        if not isinstance(f, _Function) or f.name in _HOOKS or f.name.startswith("mx_library_"):
            continue
        file = meta.file_of_node(f.dbg) if f.dbg else "?"
        shader = not file.startswith(_EXECUTOR_FILES) and file != "?"
        found = False
        for b in f.blocks:
            new: list[list[str]] = []
            issued = 0
            for inst in b.insts:
                new.append(inst)
                if _issued(inst, meta, shader):
                    issued += 1
                counted = _counted_op(inst[0]) if len(inst) == 1 else None
                if counted is None:
                    continue
                dbg = _DBG_RE.search(inst[0])
                if dbg and meta.innermost_file(dbg.group(1)).startswith(_EXECUTOR_FILES):
                    continue
                new += add(*counted)
                found = True
            if issued:  # before the terminator, which is counted too
                new[-1:-1] = add(OPS_INSTRUCTIONS, issued)
                found = True
            b.insts = new
        if not found:
            continue
        dbg = ""
        if f.dbg:  # a call in a function with debug info needs a location
            new_metadata.append(f"!{next_id[0]} = !DILocation(line: 0, scope: {f.dbg})")
            dbg = f", !dbg !{next_id[0]}"
            next_id[0] += 1
        entry = f.blocks[0]
        k = 0
        while k < len(entry.insts) and re.search(r"= alloca ", entry.insts[k][0]):
            k += 1
        entry.insts.insert(k, [f"  %__mxops = call ptr @__mx_op_counts(){dbg}"])
    out: list[str] = []
    for it in items:
        out.extend(it.lines() if isinstance(it, _Function) else [it])
    return "\n".join(out + new_metadata) + "\n"


def kernel_info_table(costs: list) -> str:
    """The mx_library_kernel_info table (mx_abi.h) of the kernels' static
    costs (_analysis.KernelCosts, in kernel order)."""
    decls, rows = [], []
    for i, c in enumerate(costs):
        data = c.hot_loop.encode()[:200] + b"\0"
        enc = "".join(chr(x) if 32 <= x < 127 and x not in (34, 92) else f"\\{x:02X}" for x in data)
        decls.append(f'@__mx_hot_loop_{i} = private unnamed_addr constant [{len(data)} x i8] c"{enc}"')
        rows.append(f"{{ i32, i32, i32, i32, ptr, i32 }} {{ i32 {c.registers}, i32 {c.uniform_registers}, "
                    f"i32 {c.private_bytes}, i32 {c.loads_in_flight}, ptr @__mx_hot_loop_{i}, "
                    f"i32 {c.loads_after_barrier} }}")
    body = f"[{', '.join(rows)}]" if rows else "zeroinitializer"
    return "\n".join(decls + [
        f"@__mx_kernel_info = private constant [{len(costs)} x {{ i32, i32, i32, i32, ptr, i32 }}] {body}",
        "define dso_local ptr @mx_library_kernel_info(ptr %n) {",
        f"  store i32 {len(costs)}, ptr %n",
        "  ret ptr @__mx_kernel_info",
        "}",
        "",
    ])
