"""What a kernel costs a GPU beyond its bytes, read from optimised LLVM IR.

The compiler (_compiler.py) optimises the shader's uninstrumented IR once
more, for this analysis only, the way a GPU compiler would treat it: every
function inlined into the kernel, loops over small private arrays unrolled
(LLVM's AMDGPU backend raises its unroll threshold to 2000 for loops that
index private arrays, so that they stay in registers; the same threshold is
used here), no vectorisation (an Apple GPU runs each lane as scalar code).
For each kernel entry function (`__mx_entry_N`) it computes:

registers
    The most 32-bit registers per thread that are live at one point:
    liveness of the SSA values over the kernel's control-flow graph, each
    value counted by its 32-bit words (a float4 is 4, a long or a pointer 2,
    half, bfloat, short, char and bool 0.5: Apple GPUs address the 16-bit
    halves of their registers), except what is an artefact of the CPU's IR
    (see _Kernel.weight: 64-bit integers used only as indices and per-thread
    device pointers are one register, a 32-bit offset; comparisons that only
    decide branches and selects none). Values that are the same for every thread of
    the dispatch (buffer addresses, parameters loaded from `constant`
    buffers, threads_per_grid and other grid sizes, and whatever is computed
    from those alone) live in uniform registers on Apple GPUs and are
    counted apart, as `uniform_registers`. Ignored: register allocation
    itself (coalescing, rematerialisation, spilling), instruction
    scheduling, the registers a GPU reserves (the execution mask stack), and
    values of the executor's own machinery (the simd-operation calls).
private_bytes
    Bytes of thread-private arrays that stay in memory after optimisation:
    an array indexed by a value known only at run time cannot live in
    registers, so the GPU keeps it in stack memory. Locals whose address (or
    the address of a field at a constant offset) only goes to the executor's
    simd and barrier calls are not counted (on a GPU those are registers).
loads_in_flight, hot_loop
    The device loads of one iteration of the kernel's hot loop whose
    addresses do not depend on another device load of that iteration: what
    a GPU compiler that schedules every independent load first could have in
    flight before the lane first waits for one. The hot loop is the loop
    with the most device loads in its own blocks (those of no loop nested in
    it); without one, the whole kernel counts as one iteration. An upper
    bound: register limits are ignored, and loads on both sides of a branch
    count as if both ran. `constant` buffers, threadgroup and thread-private
    memory are not device memory. hot_loop is the loop's source position.
loads_after_barrier
    The most device loads of an iteration of a loop (any loop, not only the
    hot one) that follow a threadgroup barrier of that iteration and are used
    in it: latency that follows every barrier instead of overlapping its wait.

The IR is the CPU's (x86-64 or arm64 data layout): LLVM may widen 32-bit loop
counters to 64 bits there (two words here, one on a GPU), and its inlining
and unrolling decisions are a CPU compiler's, not Apple's.
"""

from __future__ import annotations

import dataclasses
import math
import re

from . import _instrument as _ir

__all__ = ["KernelCosts", "kernel_costs", "ANALYSIS_FLAGS"]

# Passed to clang with the front end's IR (see the module's doc).
ANALYSIS_FLAGS = ["-O2", "-fno-vectorize", "-fno-slp-vectorize",
                  "-mllvm", "-inline-threshold=100000", "-mllvm", "-unroll-threshold=2000",
                  "-mllvm", "-unroll-runtime=false", "-mllvm", "-unroll-allow-partial=false"]

# mx_thread_info (mx_abi.h): byte ranges of fields that are the same for
# every thread of a dispatch (the sizes of the threadgroup and the grid),
# and the two tables of buffer addresses.
_INFO_TABLES = {0: "buffers", 8: "threadgroup"}
_INFO_UNIFORM = [(52, 100), (112, 116)]


@dataclasses.dataclass
class KernelCosts:
    registers: int = 0
    uniform_registers: int = 0
    private_bytes: int = 0
    loads_in_flight: int = 0
    hot_loop: str = ""
    loads_after_barrier: int = 0


_VALUE_RE = re.compile(r'%[-a-zA-Z$._0-9]+|%"[^"]*"')
_LABEL_OPERAND_RE = re.compile(r'label %[-a-zA-Z$._0-9]+|label %"[^"]*"')
_TRAILING_MD_RE = re.compile(r",\s*![-a-zA-Z._0-9]+ (![0-9]+|!\{[^}]*\})")
_BINARY = {"add", "sub", "mul", "shl", "lshr", "ashr", "and", "or", "xor", "udiv", "sdiv", "urem", "srem",
           "fadd", "fsub", "fmul", "fdiv", "frem"}
_CASTS = {"trunc", "zext", "sext", "fptrunc", "fpext", "fptoui", "fptosi", "uitofp", "sitofp", "ptrtoint",
          "inttoptr", "bitcast", "addrspacecast"}
_FLAGS = {"nuw", "nsw", "exact", "disjoint", "nneg", "fast", "nnan", "ninf", "nsz", "arcp", "contract", "afn",
          "reassoc", "inbounds", "nusw", "volatile", "atomic", "tail", "musttail", "notail", "samesign"}
_RET_ATTRS = {"noundef", "nonnull", "zeroext", "signext", "inreg", "noalias", "fastcc", "ccc", "coldcc",
              "swiftcc", "preserve_mostcc", "preserve_allcc"}


class AnalysisError(Exception):
    pass


# ------------------------------------------------------------------ types --
class _Types:
    def __init__(self, lines: list[str]):
        self.sizes = _ir._TypeSizes(lines)

    def body(self, ty: str) -> str:
        ty = ty.strip()
        seen = 0
        while ty.startswith("%") and seen < 16:
            ty = self.sizes.named.get(ty, "opaque")
            seen += 1
        return ty

    def words(self, ty: str) -> float:
        """32-bit registers a value of this type takes."""
        ty = self.body(ty)
        if ty in ("void", "label", "metadata", "token", "opaque", ""):
            return 0.0
        if ty in ("half", "bfloat"):
            return 0.5
        if ty == "float":
            return 1.0
        if ty in ("double", "ptr") or ty.startswith("ptr "):
            return 2.0
        m = re.fullmatch(r"i([0-9]+)", ty)
        if m:
            bits = int(m.group(1))
            return 0.5 if bits <= 16 else float(math.ceil(bits / 32))
        m = re.fullmatch(r"[<\[]([0-9]+) x (.*)[>\]]", ty)
        if m:
            return int(m.group(1)) * self.words(m.group(2))
        if ty.startswith("<{") or ty.startswith("{"):
            inner = ty[2:-2] if ty.startswith("<{") else ty[1:-1]
            return sum(self.words(f) for f in _ir._split_top(inner)) if inner.strip() else 0.0
        return 1.0

    def field(self, ty: str, index: int) -> str:
        ty = self.body(ty)
        m = re.fullmatch(r"[<\[]([0-9]+) x (.*)[>\]]", ty)
        if m:
            return m.group(2)
        if ty.startswith("<{") or ty.startswith("{"):
            inner = ty[2:-2] if ty.startswith("<{") else ty[1:-1]
            return _ir._split_top(inner)[index]
        raise AnalysisError(f"cannot index type {ty}")


# ----------------------------------------------------------- instructions --
@dataclasses.dataclass
class _Inst:
    lhs: str | None
    op: str
    ty: str  # result type ("void" if none)
    uses: list[str]
    text: str
    incoming: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # phi: (value, block)
    callee: str | None = None  # direct calls: the function; indirect: the callee value
    dbg: str | None = None  # the !dbg location


def _strip_words(s: str, words: set[str]) -> str:
    """Drop leading keywords and attributes such as `nuw`, `align 8`,
    `dereferenceable(16)`, `range(i32 0, 4)`."""
    while True:
        s = s.lstrip()
        m = re.match(r"([a-z_]+)(\s|\(|$)", s)
        if not m:
            return s
        word = m.group(1)
        if word in words:
            s = s[len(word):]
            continue
        if word in ("align", "dereferenceable", "dereferenceable_or_null", "range", "nofpclass", "cc"):
            rest = s[len(word):].lstrip()
            if rest.startswith("("):
                depth = 0
                for i, ch in enumerate(rest):
                    depth += ch == "("
                    depth -= ch == ")"
                    if depth == 0:
                        s = rest[i + 1:]
                        break
            else:
                s = re.sub(r"^[0-9]+", "", rest)
            continue
        return s


def _values(text: str, named_types: dict) -> list[str]:
    text = _LABEL_OPERAND_RE.sub("", text)
    return [v for v in _VALUE_RE.findall(text) if v not in named_types]


def _parse_inst(line: str, types: _Types) -> _Inst | None:
    s = line.strip()
    if not s or s.startswith(";") or s.startswith("#dbg_"):
        return None
    s = _TRAILING_MD_RE.sub("", s)
    s = re.sub(r"\s+#[0-9]+\s*$", "", s)  # an attribute group on a call
    m = _ir._ASSIGN_RE.match("  " + s)
    lhs, rhs = (m.group(1), m.group(2)) if m else (None, s)
    named = types.sizes.named
    op = rhs.split(None, 1)[0]
    rest = rhs[len(op):].strip()
    if op in ("tail", "musttail", "notail"):
        op, rest = "call", re.sub(r"^call\b", "", rest).strip()
    if op == "call":
        if re.search(r"@llvm\.dbg\.", rest) or "@llvm.lifetime." in rest or "@llvm.assume" in rest:
            return _Inst(lhs, "call", "void", [], s, callee="@llvm.lifetime")
        after = _strip_words(rest, _FLAGS | _RET_ATTRS)
        ty, after = _ir._first_type(after)
        if after.startswith("("):  # a function type: `float (ptr, ...) @f(`
            depth = 0
            for i, ch in enumerate(after):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    after = after[i + 1:].strip()
                    break
        cm = re.match(r'(@"[^"]+"|@[-a-zA-Z$._0-9]+|%[-a-zA-Z$._0-9]+|%"[^"]*")\s*\(', after)
        callee = cm.group(1) if cm else None
        return _Inst(lhs, "call", ty if lhs else "void", _values(rhs, named), s, callee=callee)
    if lhs is None:
        return _Inst(None, op, "void", _values(rhs, named), s)
    body = _strip_words(rest, _FLAGS)
    if op in _BINARY or op in ("fneg", "freeze"):
        ty, _ = _ir._first_type(body)
    elif op in ("icmp", "fcmp"):
        body = re.sub(r"^[a-z]+\s+", "", body)  # the predicate
        ty, _ = _ir._first_type(body)
        vec = re.match(r"<([0-9]+) x ", ty)
        ty = f"<{vec.group(1)} x i1>" if vec else "i1"
    elif op in _CASTS:
        ty = rhs.rsplit(" to ", 1)[1].strip()
    elif op in ("load", "phi"):
        ty, body2 = _ir._first_type(body)
        if op == "phi":
            inc = []
            for part in _ir._split_top(body2):
                part = part.strip()
                if part.startswith("[") and part.endswith("]"):
                    v, b = part[1:-1].rsplit(",", 1)
                    inc.append((v.strip(), b.strip()))
            return _Inst(lhs, op, ty, [], s, incoming=inc)
    elif op == "select":
        ops = _ir._split_top(body)
        ty, _ = _ir._first_type(ops[1])
    elif op in ("getelementptr", "alloca", "inttoptr"):
        ty = "ptr"
    elif op == "extractelement":
        vty, _ = _ir._first_type(body)
        ty = types.field(vty, 0)
    elif op == "insertelement":
        ty, _ = _ir._first_type(body)
    elif op == "shufflevector":
        ops = _ir._split_top(body)
        vty, _ = _ir._first_type(ops[0])
        mty, _ = _ir._first_type(ops[2])
        n = re.match(r"<([0-9]+) x", mty).group(1)
        ty = f"<{n} x {types.field(vty, 0)}>"
    elif op == "extractvalue":
        ops = _ir._split_top(body)
        ty, _ = _ir._first_type(ops[0])
        for idx in ops[1:]:
            ty = types.field(ty, int(idx))
    elif op == "insertvalue":
        ty, _ = _ir._first_type(body)
    elif op == "atomicrmw":
        ops = _ir._split_top(re.sub(r"^[a-z]+\s+", "", body))
        ty, _ = _ir._first_type(ops[1])
    elif op == "cmpxchg":
        ops = _ir._split_top(body)
        vty, _ = _ir._first_type(ops[1])
        ty = f"{{ {vty}, i1 }}"
    else:
        raise AnalysisError(f"the executor cannot analyse this instruction: {s[:200]}")
    return _Inst(lhs, op, ty, _values(rhs, named), s)


# --------------------------------------------------------------- function --
class _Kernel:
    """One optimised function: blocks, instructions, pointer roots,
    uniform values."""

    def __init__(self, fn: "_ir._Function", types: _Types, buffer_spaces: dict[int, str]):
        self.fn = fn
        self.types = types
        self.buffer_spaces = buffer_spaces
        self.rpo = _ir._reverse_postorder(fn)
        self.label_of = {b.label: b for b in self.rpo}
        self.insts: dict[str, list[_Inst]] = {}
        self.defs: dict[str, _Inst] = {}  # in control-flow order
        self.block_of: dict[str, str] = {}
        for b in self.rpo:
            out = []
            for inst in b.insts:
                p = _parse_inst(" ".join(inst), types)
                if p is not None:
                    dbg = re.search(r"!dbg (![0-9]+)", inst[0])
                    p.dbg = dbg.group(1) if dbg else None
                    out.append(p)
                    if p.lhs:
                        self.defs[p.lhs] = p
                        self.block_of[p.lhs] = b.label
            self.insts[b.label] = out
        args = re.search(r"\((.*)\)", fn.header)
        self.args = {}
        for a in _ir._split_top(args.group(1)) if args and args.group(1).strip() else []:
            ty, _ = _ir._first_type(a)
            name = _VALUE_RE.findall(a)
            if name:
                self.args[name[-1]] = ty
        self.info = next(iter(self.args), None) if fn.name.startswith("__mx_entry_") else None
        self.preds: dict[str, list[str]] = {b.label: [] for b in self.rpo}
        for b in self.rpo:
            for s in b.successors():
                if s in self.preds:
                    self.preds[s].append(b.label)
        self.idom = _ir._dominators(self.rpo)
        self._roots: dict[str, frozenset] = {}
        self.uniform = self._uniform_values()

    # ---- pointers
    def _const_offset(self, gep: _Inst) -> tuple[str, int] | None:
        """(base, byte offset) of `getelementptr i8, ptr %b, i64 C`."""
        m = re.match(r"getelementptr (?:inbounds |nuw |nusw )*i8, ptr (%[^\s,]+), i(?:64|32) (-?[0-9]+)$",
                     gep.text.split(" = ", 1)[1])
        return (m.group(1), int(m.group(2))) if m else None

    def roots(self, v: str) -> frozenset:
        """Where a pointer value comes from: ("info", offset), ("table",
        which), ("buffer", i), ("threadgroup",), ("private",), ("global",),
        ("unknown",)."""
        if v in self._roots:
            return self._roots[v]
        self._roots[v] = frozenset({("unknown",)})  # cycles through phis
        r = self._compute_roots(v)
        self._roots[v] = r
        return r

    def _compute_roots(self, v: str) -> frozenset:
        if v.startswith("@"):
            return frozenset({("global",)})
        if v == self.info:
            return frozenset({("info", 0)})
        d = self.defs.get(v)
        if d is None:
            return frozenset({("unknown",)})
        if d.op == "alloca":
            return frozenset({("private",)})
        if d.op == "getelementptr":
            c = self._const_offset(d)
            base = d.uses[0] if d.uses else None
            m = re.search(r",\s*ptr (%[^\s,]+|@[^\s,]+)", d.text)
            base = m.group(1) if m else base
            if base is None:
                return frozenset({("unknown",)})
            br = self.roots(base)
            if c and all(r[0] == "info" for r in br):
                return frozenset({("info", r[1] + c[1]) for r in br})
            if all(r[0] == "info" for r in br):
                return frozenset({("info", -1)})
            if c and all(r[0] == "table" for r in br):
                return frozenset({("table", r[1], c[1]) for r in br})
            return br
        if d.op in ("bitcast", "addrspacecast", "freeze"):
            m = re.search(r"(%[^\s,]+|@[^\s,]+)", d.text.split(" = ", 1)[1])
            return self.roots(m.group(1)) if m else frozenset({("unknown",)})
        if d.op in ("select", "phi"):
            vals = [x for x, _ in d.incoming] if d.op == "phi" else d.uses[1:]
            out = set()
            for x in vals:
                out |= self.roots(x) if x.startswith(("%", "@")) else {("private",)} if x == "null" else set()
            return frozenset(out) or frozenset({("unknown",)})
        if d.op == "load" and d.ty == "ptr":
            ptr = self.load_pointer(d)
            pr = self.roots(ptr) if ptr else frozenset()
            if len(pr) == 1:
                (r,) = pr
                if r[0] == "info" and r[1] in _INFO_TABLES:
                    return frozenset({("table", _INFO_TABLES[r[1]])})
                if r[0] == "table" and len(r) == 2:  # the first entry
                    r = ("table", r[1], 0)
                if r[0] == "table":
                    if r[1] == "buffers":
                        return frozenset({("buffer", r[2] // 8)})
                    return frozenset({("threadgroup",)})
                if r[0] == "global":
                    return frozenset({("global",)})
            return frozenset({("unknown",)})
        if d.op == "call" and d.ty == "ptr" and d.callee and d.callee.startswith("%"):
            return frozenset({("threadgroup",)})  # __mx_api->threadgroup_variable
        return frozenset({("unknown",)})

    def memory(self, ptr: str) -> str:
        """device, constant, threadgroup, private, info, executor or mixed."""
        kinds = set()
        for r in self.roots(ptr):
            if r[0] == "buffer":
                kinds.add("constant" if self.buffer_spaces.get(r[1]) == "constant" else "device")
            elif r[0] in ("threadgroup", "private", "info"):
                kinds.add(r[0])
            elif r[0] in ("table", "global"):
                kinds.add("executor")
            else:
                kinds.add("device")
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def base_offset(self, ptr: str) -> tuple[str, int]:
        """A pointer as (base, constant byte offset), through
        getelementptrs with constant indices."""
        offset = 0
        for _ in range(64):
            d = self.defs.get(ptr)
            if d is None or d.op != "getelementptr":
                break
            m = re.match(r"getelementptr (?:inbounds |nuw |nusw )*(.+)$", d.text.split(" = ", 1)[1])
            parts = _ir._split_top(m.group(1)) if m else []
            if len(parts) < 2 or not all(re.fullmatch(r"i[0-9]+ -?[0-9]+", p) for p in parts[2:]):
                break
            ty = parts[0]
            idx = [int(p.split()[1]) for p in parts[2:]]
            if not idx:
                break
            offset += idx[0] * self.types.sizes.size_align(ty)[0]
            for j in idx[1:]:
                body = self.types.body(ty)
                if body.startswith("[") or body.startswith("<") and " x " in body:
                    ty = self.types.field(ty, 0)
                    offset += j * self.types.sizes.size_align(ty)[0]
                else:  # a struct field: its offset
                    fields = _ir._split_top(body[2:-2] if body.startswith("<{") else body[1:-1])
                    off = 0
                    for f in fields[:j]:
                        fs, fa = self.types.sizes.size_align(f)
                        off = (off + fa - 1) // fa * fa + fs
                    fa = self.types.sizes.size_align(fields[j])[1]
                    offset += (off + fa - 1) // fa * fa
                    ty = fields[j]
            ptr = parts[1].split()[-1]
        return ptr, offset

    def load_pointer(self, inst: _Inst) -> str | None:
        if inst.op != "load":
            return None
        m = re.search(r",\s*ptr (%[^\s,]+|@[^\s,]+)", inst.text)
        return m.group(1) if m else None

    # ---- uniform values
    def _uniform_values(self) -> set[str]:
        def info_uniform(inst: _Inst) -> bool:
            ptr = self.load_pointer(inst)
            rs = self.roots(ptr) if ptr else frozenset()
            if len(rs) != 1:
                return False
            (r,) = rs
            if r[0] != "info":
                return False
            size = max(1, int(self.types.words(inst.ty) * 4))
            return r[1] in _INFO_TABLES or any(lo <= r[1] and r[1] + size <= hi for lo, hi in _INFO_UNIFORM)

        candidates = set(self.defs) | set(self.args)
        uniform = set(candidates)
        terminators = {b.label: (self.insts[b.label][-1] if self.insts[b.label] else None) for b in self.rpo}

        def is_uniform(v: str) -> bool:
            return not v.startswith("%") or v in uniform

        def branch_uniform(label: str) -> bool:
            t = terminators.get(label)
            if t is None or t.op not in ("br", "switch"):
                return True
            return all(is_uniform(u) for u in t.uses)

        changed = True
        while changed:
            changed = False
            for v, d in self.defs.items():
                if v not in uniform:
                    continue
                ok = True
                if d.op == "load":
                    ptr = self.load_pointer(d)
                    mem = self.memory(ptr) if ptr else "mixed"
                    ok = (mem in ("constant", "executor") or (mem == "info" and info_uniform(d))) and is_uniform(ptr)
                elif d.op == "phi":
                    block = self.block_of[v]
                    ok = all(is_uniform(x) for x, _ in d.incoming)
                    ok = ok and all(branch_uniform(p) for p in self.preds[block])
                    ok = ok and branch_uniform(self.idom.get(block, block))
                elif d.op == "call":
                    ok = bool(d.callee and d.callee.startswith("@llvm.")) and all(is_uniform(u) for u in d.uses)
                    ok = ok or (d.ty == "ptr" and d.callee is not None and d.callee.startswith("%")
                                and all(is_uniform(u) for u in d.uses))  # threadgroup_variable
                elif d.op in ("atomicrmw", "cmpxchg", "alloca"):
                    ok = d.op == "alloca"
                else:
                    ok = all(is_uniform(u) for u in d.uses)
                if not ok:
                    uniform.discard(v)
                    changed = True
        return uniform

    # ---- register weights
    def users(self, v: str) -> list[_Inst]:
        if not hasattr(self, "_users"):
            self._users: dict[str, list[_Inst]] = {}
            for insts in self.insts.values():
                for inst in insts:
                    for u in set(inst.uses) | {x for x, _ in inst.incoming}:
                        self._users.setdefault(u, []).append(inst)
        return self._users.get(v, [])

    def _only(self, v: str, ok, memo: dict, depth: int = 0) -> bool:
        """Whether every use of v satisfies ok(inst) -> True (fine), False
        (not), or None (fine if the instruction's own value is too)."""
        if v in memo:
            return memo[v]
        memo[v] = True  # a cycle through phis: optimistic
        result = True
        for u in self.users(v):
            verdict = ok(u, v)
            if verdict is None:
                verdict = bool(u.lhs) and depth < 32 and self._only(u.lhs, ok, memo, depth + 1)
            if not verdict:
                result = False
                break
        memo[v] = result
        return result

    def address_only(self, v: str) -> bool:
        """An integer used only to form addresses (getelementptr indices),
        directly or through integer arithmetic, phis and comparisons: on a
        GPU an index of 32 bits (a load takes a 64-bit base and a 32-bit
        offset), which the CPU's IR widens to 64 bits."""
        def ok(inst: _Inst, v: str):
            if inst.op == "getelementptr":
                m = re.search(r",\s*ptr (%[^\s,]+|@[^\s,]+)", inst.text)
                return not (m and m.group(1) == v)  # an index, not the base
            if inst.op == "icmp":
                return True
            if inst.op in ("add", "sub", "mul", "shl", "or", "and", "xor", "lshr", "ashr", "phi", "select",
                           "sext", "zext", "trunc", "freeze"):
                return None
            return False
        return self._only(v, ok, self.__dict__.setdefault("_address_memo", {}))

    def predicate_only(self, v: str) -> bool:
        """An i1 used only by branches, selects and logic on other such i1:
        on Apple GPUs a comparison feeds the branch or the select it decides
        (compare-and-select, the execution mask) without a register of its
        own."""
        def ok(inst: _Inst, v: str):
            if inst.op in ("br", "select"):
                return inst.op == "br" or _ir._split_top(inst.text.split("select", 1)[1])[0].split()[-1] == v
            if inst.op in ("and", "or", "xor") and inst.ty == "i1":
                return None
            return False
        return self._only(v, ok, self.__dict__.setdefault("_predicate_memo", {}))

    def weight(self, v: str) -> float:
        """32-bit registers of value v (0 for the executor's own values).
        The CPU's IR has values a GPU would not hold in registers of that
        size: 64-bit integers used only as indices (1 register: a 32-bit
        offset), per-thread pointers into device memory (1: a 32-bit offset
        from a buffer's base, which is uniform), comparisons that only
        decide branches and selects (none)."""
        if v == self.info:
            return 0.0
        d = self.defs.get(v)
        ty = d.ty if d else self.args.get(v, "i32")
        if d and d.op == "alloca":
            return 0.0
        if ty == "ptr":
            mem = self.memory(v)
            if mem in ("private", "info", "executor"):
                return 0.0
            if mem == "threadgroup":
                return 1.0  # threadgroup memory is addressed with 32 bits
            return 2.0 if v in self.uniform else 1.0
        if d and d.op == "load":
            ptr = self.load_pointer(d)
            if ptr and self.memory(ptr) == "executor" and "ptr" in ty:
                return 0.0
        if ty == "i1" and self.predicate_only(v):
            return 0.0
        if ty == "i64" and v not in self.uniform and self.address_only(v):
            return 1.0
        return self.types.words(ty)


# ---------------------------------------------------------------- liveness --
def _peaks(k: _Kernel) -> tuple[float, float]:
    """Peak per-thread and uniform register words over the function."""
    defs_in: dict[str, set[str]] = {}
    phidefs: dict[str, set[str]] = {}
    upward: dict[str, set[str]] = {}
    phi_uses: dict[tuple[str, str], set[str]] = {}  # (pred, block) -> values
    values = set(k.defs) | set(k.args)
    for b in k.rpo:
        d, ph, up = set(), set(), set()
        for inst in k.insts[b.label]:
            if inst.op == "phi":
                ph.add(inst.lhs)
                for v, pred in inst.incoming:
                    if v in values:
                        phi_uses.setdefault((pred, b.label), set()).add(v)
                continue
            for u in inst.uses:
                if u in values and u not in d and u not in ph:
                    up.add(u)
            if inst.lhs:
                d.add(inst.lhs)
        defs_in[b.label], phidefs[b.label], upward[b.label] = d, ph, up
    live_in = {b.label: set() for b in k.rpo}
    live_out = {b.label: set() for b in k.rpo}
    changed = True
    while changed:
        changed = False
        for b in reversed(k.rpo):
            out = set()
            for s in b.successors():
                if s in live_in:
                    out |= live_in[s] - phidefs[s]
                    out |= phi_uses.get((b.label, s), set())
            inn = upward[b.label] | (out - defs_in[b.label]) | phidefs[b.label]
            if out != live_out[b.label] or inn != live_in[b.label]:
                live_out[b.label], live_in[b.label] = out, inn
                changed = True

    weights = {v: k.weight(v) for v in values}

    def measure(live: set[str]) -> tuple[float, float]:
        per, uni = 0.0, 0.0
        for v in live:
            if v in k.uniform:
                uni += weights[v]
            else:
                per += weights[v]
        return per, uni

    best_p, best_u = 0.0, 0.0
    for b in k.rpo:
        live = set(live_out[b.label])
        for inst in reversed(k.insts[b.label]):
            if inst.op == "phi":
                continue
            after = live | ({inst.lhs} if inst.lhs else set())
            p, u = measure(after)
            best_p, best_u = max(best_p, p), max(best_u, u)
            if inst.lhs:
                live.discard(inst.lhs)
            live |= {x for x in inst.uses if x in values}
        p, u = measure(live_in[b.label])
        best_p, best_u = max(best_p, p), max(best_u, u)
    return best_p, best_u


# -------------------------------------------------------- private memory --
def _private_bytes(k: _Kernel) -> int:
    uses: dict[str, list[_Inst]] = {}
    for insts in k.insts.values():
        for inst in insts:
            for u in set(inst.uses):
                uses.setdefault(u, []).append(inst)
    def register_like(v: str, depth: int = 0) -> bool:
        for u in uses.get(v, []):
            if u.op == "getelementptr" and depth < 8 and u.lhs and k.base_offset(u.lhs)[0] == v:
                if not register_like(u.lhs, depth + 1):  # a field at a constant offset
                    return False
            elif not _register_like(v, u):
                return False
        return True

    total = 0
    for v, d in k.defs.items():
        if d.op != "alloca" or register_like(v):
            continue
        m = re.search(r"= alloca (?:inalloca )?(.*)$", d.text)
        ty, rest = _ir._first_type(m.group(1))
        count = re.match(r",\s*i[0-9]+ ([0-9]+)", rest)
        total += k.types.sizes.size_align(ty)[0] * (int(count.group(1)) if count else 1)
    return total


def _register_like(v: str, inst: _Inst) -> bool:
    """A use that a GPU would serve from a register: the value loaded or
    stored whole, a copy or fill of a constant size, or the address handed to
    the executor's simd and barrier calls (indirect calls through its API
    table: a simd operation's value, a simdgroup matrix's elements)."""
    if inst.op == "load":
        return True
    if inst.op == "store":
        ops = _ir._split_top(re.sub(r"^store (volatile )?", "", inst.text.split(" = ", 1)[-1]))
        return len(ops) >= 2 and ops[1].split()[-1] == v and v not in _VALUE_RE.findall(ops[0])
    if inst.op == "call" and inst.callee:
        if inst.callee.startswith(("@llvm.memset.", "@llvm.memcpy.", "@llvm.memmove.")):
            args = _ir._split_top(inst.text[inst.text.index(inst.callee) + len(inst.callee):].strip()[1:-1])
            return len(args) >= 3 and re.fullmatch(r"i[0-9]+ [0-9]+", args[2].strip()) is not None
        return inst.callee == "@llvm.lifetime" or inst.callee.startswith("%")
    return False


# --------------------------------------------------------- loads in flight --
def _loads_in_flight(k: _Kernel, meta: "_ir._Metadata", site_at) -> tuple[int, str]:
    try:
        loops = _ir._natural_loops(k.fn, k.rpo, k.idom)
    except _ir.InstrumentError:
        loops = {}
    device_loads = {b.label: [i for i in k.insts[b.label]
                              if i.op == "load" and k.memory(k.load_pointer(i) or "") in ("device", "mixed")]
                    for b in k.rpo}
    # A loop's own blocks: those of no loop nested in it.
    own = {h: {x for x in body if not any(o != h and o in body and x in loops[o] for o in loops)}
           for h, body in loops.items()}
    best_header, best_count = None, 0
    for b in k.rpo:
        if b.label in own:
            n = sum(len(device_loads[x]) for x in own[b.label])
            if n > best_count:
                best_header, best_count = b.label, n
    if best_header is None:
        region, where = {b.label for b in k.rpo}, ""
    else:
        region = own[best_header]
        where, _ = _ir._loop_site(best_header, loops[best_header], k.rpo, meta, site_at)
    # Values of this iteration computed from a device load of it (a phi
    # starts a new iteration's value, so it breaks the chain).
    loads = {i.lhs for lab in region for i in device_loads[lab] if i.lhs}
    tainted: dict[str, bool] = {}

    def from_load(v: str) -> bool:
        if v in loads:
            return True
        if v in tainted:
            return tainted[v]
        tainted[v] = False
        d = k.defs.get(v)
        if d is None or d.op == "phi" or k.block_of.get(v) not in region:
            return False
        tainted[v] = any(from_load(u) for u in d.uses)
        return tainted[v]

    # Per block, the independent loads as a GPU issues them: loads from one
    # base within 16 bytes are one instruction (a GPU compiler merges them,
    # as LLVM's load-store vectoriser does, and the CPU optimiser may have
    # split a 16-byte load into four). Then the path through the iteration
    # with the most.
    per_block = {}
    for lab in region:
        pieces: dict[str, list[tuple[int, int]]] = {}
        for i in device_loads[lab]:
            if any(from_load(u) for u in i.uses):
                continue
            base, offset = k.base_offset(k.load_pointer(i))
            pieces.setdefault(base, []).append((offset, max(1, int(k.types.sizes.size_align(i.ty)[0]))))
        n = 0
        for parts in pieces.values():
            end = None
            for offset, size in sorted(parts):
                if end is None or offset + size > end:
                    n += 1
                    end = offset + 16
        per_block[lab] = n
    rank = {b.label: n for n, b in enumerate(k.rpo)}
    path: dict[str, int] = {}
    for b in k.rpo:
        if b.label not in region:
            continue
        before = [path[p] for p in k.preds[b.label] if p in path and rank[p] < rank[b.label]]
        path[b.label] = per_block[b.label] + (max(before) if before and b.label != best_header else 0)
    after = max((_loads_after_barrier(k, meta, own[h], h, device_loads) for h in own), default=0)
    return max(path.values(), default=0), where, after


def _is_threadgroup_barrier(inst: _Inst, meta: "_ir._Metadata") -> bool:
    """threadgroup_barrier() as the optimised IR has it: mx_metal.h's
    __mx_barrier inlined into an indirect call of the engine's barrier with
    scope MX_SCOPE_THREADGROUP (0)."""
    if inst.op != "call" or not inst.callee or not inst.callee.startswith("%") or not inst.dbg:
        return False
    scope = meta._field(inst.dbg, "scope")
    seen = 0
    while scope and seen < 8 and meta._field(scope, "name") is None:  # lexical blocks
        scope = meta._field(scope, "scope")
        seen += 1
    if not scope or meta._field(scope, "name") != '"__mx_barrier"':
        return False
    args = inst.text[inst.text.index(inst.callee) + len(inst.callee):]
    return re.match(r"\(\s*i32 (?:noundef )?0\s*,", args) is not None


def _loads_after_barrier(k: _Kernel, meta, region: set, header, device_loads) -> int:
    """The device loads of one iteration of a loop (its own blocks, those of
    no loop nested in it) that come after a threadgroup barrier of that iteration and whose value that iteration
    uses: each waits its full latency after the barrier opens, every
    iteration (issued before the barrier, its latency would overlap the
    barrier's wait). A load whose value only goes to the next iteration (a
    prefetch) does not count."""
    after: set[str] = set()
    starts = []
    for lab in region:
        insts = k.insts[lab]
        for n, inst in enumerate(insts):
            if _is_threadgroup_barrier(inst, meta):
                starts.append((lab, n + 1))
    if not starts:
        return 0
    seen_blocks: set[str] = set()
    work = []
    for lab, n in starts:
        after.update(i.lhs for i in k.insts[lab][n:] if i.lhs and i in device_loads[lab])
        work.extend(s for s in k.label_of[lab].successors() if s in region and s != header)
    while work:
        lab = work.pop()
        if lab in seen_blocks:
            continue
        seen_blocks.add(lab)
        after.update(i.lhs for i in device_loads[lab] if i.lhs)
        work.extend(s for s in k.label_of[lab].successors() if s in region and s != header)

    def used_now(v: str) -> bool:
        return any(not (u.op == "phi" and k.block_of.get(u.lhs) == header) for u in k.users(v))
    return sum(1 for v in after if used_now(v))


# -------------------------------------------------------------- the module --
def kernel_costs(ir: str, kernels: list[dict]) -> list[KernelCosts]:
    """Costs of each kernel (in the order of `kernels`, the translator's,
    whose n-th is the function __mx_entry_n) of an optimised module."""
    lines = ir.split("\n")
    types = _Types(lines)
    meta = _ir._Metadata(lines)
    items = _ir._parse(lines)
    functions = {it.name: it for it in items if isinstance(it, _ir._Function)}
    sites: list[str] = []

    def site_at(dbg):
        pos = meta.position(dbg) if dbg else None
        sites.append(pos or "")
        return pos or ""

    for f in functions.values():
        f.file = meta.file_of_node(f.dbg) if f.dbg else "?"
    shader_functions = {n for n, f in functions.items()
                        if not f.file.startswith(_ir._EXECUTOR_FILES) and f.file != "?"}
    out = []
    for n, k in enumerate(kernels):
        fn = functions.get(f"__mx_entry_{n}")
        if fn is None:
            out.append(KernelCosts())
            continue
        spaces = {}
        for p in k.get("params", []):
            if p.get("attribute") == "buffer":
                try:
                    spaces[int(str(p["argument"]).strip(), 0)] = p.get("address_space", "")
                except ValueError:
                    pass
        kernel = _Kernel(fn, types, spaces)
        per, uni = _peaks(kernel)
        costs = KernelCosts(registers=int(math.ceil(per)), uniform_registers=int(math.ceil(uni)),
                            private_bytes=_private_bytes(kernel))
        # Functions the inliner left (none, usually): their registers come
        # on top of what is live around the call, their arrays on the stack.
        for insts in kernel.insts.values():
            for inst in insts:
                if inst.op == "call" and inst.callee and inst.callee.startswith("@") \
                        and inst.callee[1:].strip('"') in shader_functions:
                    callee = _Kernel(functions[inst.callee[1:].strip('"')], types, spaces)
                    cp, cu = _peaks(callee)
                    costs.registers = max(costs.registers, int(math.ceil(per + cp)))
                    costs.private_bytes += _private_bytes(callee)
        costs.loads_in_flight, costs.hot_loop, costs.loads_after_barrier = _loads_in_flight(kernel, meta, site_at)
        out.append(costs)
    return out
