"""Metal rules that C++ would let through: check mode enforces them so that
what Apple's compiler rejects, CI rejects too.

`python -m mps_ext_executor check FILES` runs these on each shader's own
(preprocessed) text, then compiles it as C++14 with Metal's address spaces
as clang address spaces (_compiler.check_address_spaces). Every finding
reads `file:line: message [msl-rule]`; the rules, with where the
Metal Shading Language specification (3.1) states them, are listed in
RULES and in docs/dev/contributing.md (the table of `msl-` rules).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path

from . import _translate

__all__ = ["lint", "lint_includes", "RULES"]

# rule -> what it says (docs/dev/contributing.md lists the same rules and tests).
RULES = {
    "std-header": "no C or C++ standard-library header (<cmath>, <stdint.h>, ...): Metal has only its own (<metal_*>)",
    "double": "no double (MSL 2.1: Metal has no 64-bit floating point)",
    "long-long": "no long long or unsigned long long (MSL 2.1: not Metal types; long and ulong are its 64-bit integers)",  # noqa: E501
    "recursion": "no recursion a kernel reaches (calls to overloaded names are not followed)",
    "kernel-param-attribute": "every kernel parameter has an attribute ([[buffer(i)]], a builtin, ...), except device "
    "and constant pointers and references, which take the lowest free buffer indices",
    "pointer-address-space": "pointer and reference parameters name an address space",
    "kernel-argument-type": "a kernel's [[buffer(i)]] parameter is a device or constant pointer, reference or array, "
    "and a [[threadgroup(i)]] one a threadgroup pointer or reference (the specification's "
    "kernel argument kinds: buffers are not passed by value)",
    "program-scope-variable": "program-scope variables are in the constant address space (MSL 4.2)",
    "static-variable": "static data members and static locals are in the constant address space",
    "constant-initializer": "program-scope constant variables are initialized (MSL 4.2)",
    "threadgroup-variable-scope": "threadgroup variables are declared in kernel functions only (MSL 4.4)",
    "cxx20": "no C++ newer than C++20: Apple's compiler takes C++17 and C++20 features (if constexpr, fold "
    "expressions, designated initializers, ...) as extensions of MSL's C++14, not C++23 ones",
    "virtual": "no virtual functions (MSL 1.4.4 restrictions)",
    "derived-class": "no derived classes: a class or struct has no base-specifier list (MSL 1.4.4 restrictions, 1.5.4 in 3.x; "  # noqa: E501
    'Apple: "derived classes are not supported in Metal"), except inside a '
    "`#pragma METAL internals : enable` region, where Apple's and MLX's own headers write them",
    "exceptions": "no exception handling: try, catch, throw (MSL 1.4.4 restrictions)",
    "new-delete": "no new and delete operators (MSL 1.4.4 restrictions)",
    "rtti": "no dynamic_cast or typeid (MSL 1.4.4 restrictions)",
    "goto": "no goto (MSL 1.4.4 restrictions)",
    "storage-class": "no register or thread_local (MSL 1.4.4 restrictions)",
    "lambda": "no lambda expressions (MSL 1.4.4 restrictions)",
    "noexcept-operator": "no noexcept operator (MSL 1.4.4 restrictions)",
    "function-pointer": "no function pointers (MSL 2.3+ allows them only for [[visible]] functions linked "
    "through MTLLinkedFunctions, which mps_ext does not use)",
    "main": "no function named main (MSL 1.4.4 restrictions)",
    "builtin-type": "a builtin kernel attribute is declared with one of the types the spec lists for it (MSL 5.2.3.6)",
    "builtin-width": "the position and size attributes of one kernel have the same number of components (MSL 5.2.3.6)",
    "builtin-same-type": "[[thread_position_in_grid]] and [[threads_per_grid]] have the same type, and so do "
    "[[thread_position_in_threadgroup]], [[threads_per_threadgroup]] and "
    "[[dispatch_threads_per_threadgroup]] (MSL 5.2.3.6)",
    "thread-index-type": "[[thread_index_in_threadgroup]] is uint when [[thread_position_in_threadgroup]] is "
    "uint, uint2 or uint3 (MSL 5.2.3.6)",
    "builtin-conflict": "[[thread_execution_width]] and [[threads_per_simdgroup]] are not both declared",
    "buffer-index": "[[buffer(i)]] indices of a kernel are distinct and at most 30 (31 buffer argument table entries)",
    "threadgroup-index": "[[threadgroup(i)]] indices of a kernel are distinct and at most 30",
    "kernel-return": "a kernel returns void (MSL 5.1.3)",
    "max-threads": "[[max_total_threads_per_threadgroup(N)]] has 1 <= N <= 1024",
    "threadgroup-memory": "a kernel's threadgroup variables take at most 32 KiB",
    "host-name": "kernel names ([[host_name]] or the function's name) are unique in a library",
    # Checked by the check compile (mx_metal.h's thread_elements() type), not the lint.
    "thread-elements": "simdgroup_matrix::thread_elements() is indexed or reinterpret_cast to vec<T, 2>&, never "
    "assigned or read as a whole vector (Apple does not publish its type)",
}

# The C and C++ standard libraries' headers (C++14 and C11 names, and the
# C++17/20 ones a shader might reach for). Other <...> includes are the
# shader's own headers on the include path (PyTorch's shaders include
# <c10/metal/utils.h>), which Metal finds as any compiler does.
_STD_HEADERS = frozenset("""
algorithm any array atomic bitset cassert ccomplex cctype cerrno cfenv cfloat charconv chrono cinttypes ciso646
climits clocale cmath codecvt complex condition_variable csetjmp csignal cstdalign cstdarg cstdbool cstddef
cstdint cstdio cstdlib cstring ctgmath ctime cuchar cwchar cwctype deque exception execution filesystem
forward_list fstream functional future initializer_list iomanip ios iosfwd iostream istream iterator limits
list locale map memory memory_resource mutex new numeric optional ostream queue random ratio regex
scoped_allocator set shared_mutex sstream stack stdexcept streambuf string string_view strstream
system_error thread tuple type_traits typeindex typeinfo unordered_map unordered_set utility valarray
variant vector bit span concepts numbers ranges format source_location compare version coroutine
assert.h complex.h ctype.h errno.h fenv.h float.h inttypes.h iso646.h limits.h locale.h math.h setjmp.h
signal.h stdalign.h stdarg.h stdatomic.h stdbool.h stddef.h stdint.h stdio.h stdlib.h stdnoreturn.h
string.h tgmath.h threads.h time.h uchar.h wchar.h wctype.h
""".split())
_INCLUDE = re.compile(r'^\s*#\s*include\s*<([^>]+)>', re.M)

# Builtin kernel attributes and the types MSL 5.2.3.6 allows for them.
_POSITION_TYPES = {"ushort", "ushort2", "ushort3", "uint", "uint2", "uint3"}
_INDEX_TYPES = {"ushort", "uint"}
_POSITION_ATTRIBUTES = ("thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup",
                        "threads_per_threadgroup", "threadgroup_position_in_grid",
                        "dispatch_threads_per_threadgroup", "threadgroups_per_grid")
_BUILTIN_TYPES = {a: _POSITION_TYPES for a in _POSITION_ATTRIBUTES + ("grid_origin", "grid_size")}
_BUILTIN_TYPES.update({a: _INDEX_TYPES for a in (
    "thread_index_in_threadgroup", "thread_index_in_simdgroup", "thread_index_in_quadgroup",
    "simdgroup_index_in_threadgroup", "quadgroup_index_in_threadgroup", "threads_per_simdgroup",
    "thread_execution_width", "simdgroups_per_threadgroup", "quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup", "dispatch_quadgroups_per_threadgroup")})
_SAME_TYPE = (("thread_position_in_grid", "threads_per_grid"),
              ("thread_position_in_threadgroup", "threads_per_threadgroup", "dispatch_threads_per_threadgroup"))

# Bytes of Metal's scalar types (vectors of 3 take the room of 4).
_SCALAR_SIZE = {"bool": 1, "char": 1, "uchar": 1, "short": 2, "ushort": 2, "half": 2, "bfloat": 2,
                "int": 4, "uint": 4, "float": 4, "long": 8, "ulong": 8, "int8_t": 1, "uint8_t": 1,
                "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8,
                "atomic_int": 4, "atomic_uint": 4, "atomic_float": 4}
_ALIASES = {"uint32_t": "uint", "uint16_t": "ushort", "int32_t": "int", "int16_t": "short", "uint8_t": "uchar",
            "int8_t": "char", "uint64_t": "ulong", "int64_t": "long", "unsigned": "uint", "unsigned int": "uint",
            "unsigned short": "ushort"}
# The address spaces of a kernel's bound arguments, by attribute.
_ARGUMENT_SPACES = {"buffer": ("device", "constant"), "threadgroup": ("threadgroup",)}
_MAX_THREADGROUP_MEMORY = 32 * 1024
_MAX_BINDING_INDEX = 30
_MAX_THREADS_PER_THREADGROUP = 1024

# Keywords of C++ features MSL 1.4.4 lists as not available.
_FORBIDDEN = {
    "virtual": ("virtual", "virtual functions are not available in Metal"),
    "try": ("exceptions", "exception handling ('try') is not available in Metal"),
    "catch": ("exceptions", "exception handling ('catch') is not available in Metal"),
    "throw": ("exceptions", "exception handling ('throw') is not available in Metal"),
    "dynamic_cast": ("rtti", "dynamic_cast is not available in Metal"),
    "typeid": ("rtti", "typeid (type identification) is not available in Metal"),
    "goto": ("goto", "goto is not available in Metal"),
    "thread_local": ("storage-class", "the thread_local storage class is not available in Metal"),
    "register": ("storage-class", "the register storage class is not available in Metal"),
    "new": ("new-delete", "the new operator is not available in Metal"),
    "delete": ("new-delete", "the delete operator is not available in Metal"),
}


def _finding(file: str, line: int, message: str, rule: str) -> str:
    assert rule in RULES, rule
    return f"{file}:{line}: {message} [msl-{rule}]"


def lint_includes(source: str, filename: str) -> list[str]:
    """C and C++ standard-library headers: Metal has only its own."""
    findings = []
    for m in _INCLUDE.finditer(source):
        header = m.group(1).strip()
        if header in _STD_HEADERS:
            line = source.count("\n", 0, m.start()) + 1
            findings.append(_finding(filename, line, f"<{header}> is not a Metal header; Metal has no C or C++ "
                                     "standard library", "std-header"))
    return findings


@dataclasses.dataclass
class _Body:
    open: int  # token index of '{'
    close: int  # token index of the matching '}'
    function: _translate.Function
    start: int = 0  # first token of the definition
    attributes: tuple = ()  # Metal attributes before the body, for kernels


class _Reader(_translate._Translator):
    """The translator's walk over the shader's own text, keeping what the
    rules need: function bodies, parameter types, threadgroup variables."""

    def __init__(self, text: str):
        super().__init__(text)
        self.bodies: list[_Body] = []
        self.kernel_attributes: dict[int, tuple] = {}  # '{' index of a kernel -> its Metal attributes
        self.threadgroup_vars: list[tuple[int, list[int]]] = []  # ('threadgroup' index, declaration tokens)
        self.param_types: dict[int, str] = {}  # id(Param) -> type text
        self.kernel_files: list[str] = []  # file of each of self.kernels

    def _function_definition(self, start, brace, is_kernel):
        n = len(self.functions)
        super()._function_definition(start, brace, is_kernel)
        if len(self.functions) > n:
            self.bodies.append(_Body(brace, self.match(brace, "{", "}"), self.functions[-1], start))

    def _kernel_definition(self, start, brace, scopes, attrs):
        self.kernel_attributes[brace] = tuple(attrs)
        self._note_kernel_file(start, super()._kernel_definition, start, brace, scopes, attrs)

    def _explicit_instantiation(self, i, scopes):
        return self._note_kernel_file(i, super()._explicit_instantiation, i, scopes)

    def _note_kernel_file(self, at, method, *args):
        n = len(self.kernels)
        result = method(*args)
        if len(self.kernels) > n:
            self.kernel_files.append(self.where(self.toks[at].start)[0])
        return result

    def _param(self, ptoks, kernel):
        p = super()._param(ptoks, kernel)
        words, k = [], 0
        while k < len(ptoks):
            a = self.attribute_at(ptoks[k])
            if a:
                while k < len(ptoks) and ptoks[k] < a[0]:
                    k += 1
                continue
            words.append(self.t(ptoks[k]))
            k += 1
        if words and words[-1] == p.name:
            words.pop()
        words = [w for w in words if w not in ("const", "volatile", "metal", "::")]
        self.param_types[id(p)] = " ".join(words)
        return p

    def _threadgroup_declaration(self, i):
        j, depth, pointer, brackets = i, 0, False, _translate._Brackets()
        while j < len(self.toks) and not (self.t(j) == ";" and depth == 0):
            pointer = pointer or (depth == 0 and self.t(j) in ("*", "&", "&&"))
            depth = brackets.step(self.t(j))
            j += 1
        if not pointer:  # `threadgroup T* p = ...;` is a thread's pointer into threadgroup memory
            self.threadgroup_vars.append((i, list(range(i + 1, j))))
        return super()._threadgroup_declaration(i)


def _read(preprocessed: str) -> _Reader:
    r = _Reader(preprocessed)
    r.run()
    for b in r.bodies:
        b.attributes = r.kernel_attributes.get(b.open, ())
    return r


@functools.lru_cache(maxsize=None)
def _library_functions() -> frozenset[str]:
    """Names the executor's Metal standard library declares as functions: a
    shader's function of the same name may be an overload of it, so a call
    to that name from inside is not known to be recursive."""
    text = (Path(__file__).resolve().parent / "include" / "mx_metal.h").read_text()
    return frozenset(re.findall(r"\b([A-Za-z_]\w*)\s*\(", text) + re.findall(r"\bMX_\w+\((\w+)", text))


def _reached_from_kernels(functions: list[_translate.Function]) -> set[tuple[str, str]]:
    """(owner, name) of the functions a kernel may call, directly or not. A
    function no kernel calls (a template especially) is never compiled to
    GPU code, and Apple's compiler builds headers whose unused functions
    recurse (PyTorch's c10/metal/special_math.h). Without types a call may
    go to any definition of its name, in any class: all are taken as
    reached. Operators are called without their name, so they count as
    entry points too."""
    by_name: dict[str, list[tuple[str, str]]] = {}
    for f in functions:
        by_name.setdefault(f.name, []).append((f.owner, f.name))
    called: dict[tuple[str, str], set[str]] = {}
    for f in functions:
        called.setdefault((f.owner, f.name), set()).update({n for _, n in f.calls} | f.method_calls)
    todo = [(f.owner, f.name) for f in functions if f.is_kernel or f.name.startswith("operator")]
    reached = set(todo)
    while todo:
        for name in called.get(todo.pop(), ()):
            for key in by_name.get(name, ()):
                if key not in reached:
                    reached.add(key)
                    todo.append(key)
    return reached


def _find_cycles(functions: list[_translate.Function]) -> list[list[str]]:
    """Cycles of calls between functions a call surely names, among those a
    kernel reaches. Without types, a call to a name with several definitions
    (overloads, specialisations, the same method of several classes) could
    go to any: such calls are left out, so overloads calling each other are
    not taken for recursion."""
    defs: dict[tuple[str, str], int] = {}
    for f in functions:
        defs[(f.owner, f.name)] = defs.get((f.owner, f.name), 0) + 1
    library = _library_functions()

    def target(f: _translate.Function, qualifier: str, name: str):
        if qualifier and qualifier != "::":
            key = (qualifier, name)
        elif not qualifier and f.owner and (f.owner, name) in defs:
            key = (f.owner, name)
        else:
            key = ("", name)
        if defs.get(key) != 1 or (not key[0] and name in library):
            return None
        return key

    def label(key):
        return f"{key[0]}::{key[1]}" if key[0] else key[1]

    reached = _reached_from_kernels(functions)
    graph = {(f.owner, f.name): sorted({t for q, n in f.calls if (t := target(f, q, n))})
             for f in functions if defs[(f.owner, f.name)] == 1 and (f.owner, f.name) in reached}
    cycles, seen_cycles = [], set()
    state: dict[tuple, int] = {}

    def visit(node, path: list):
        state[node] = 1
        for callee in graph.get(node, ()):
            if callee not in graph:
                continue
            if state.get(callee) == 1:
                cyc = path[path.index(callee):] + [callee]
                key = frozenset(cyc)
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    cycles.append([label(c) for c in cyc])
            elif state.get(callee) is None:
                visit(callee, path + [callee])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    return cycles


# ------------------------------------------------------ token-level rules --
_SUBSCRIPTABLE = {"ident", "number", "string", "char"}


def _token_rules(r: _Reader, out: list[str]):
    toks = r.toks
    for i, tok in enumerate(toks):
        s = tok.text
        if not (tok.kind == "ident" and (s in ("double", "long", "noexcept") or s in _FORBIDDEN)) \
                and s not in ("[", "("):
            continue  # most tokens: no rule looks at them
        file, line = r.where(tok.start)
        if tok.kind == "ident":
            if s == "double":
                out.append(_finding(file, line, "Metal has no double; use float", "double"))
            elif s == "long":
                if r.t(i + 1) == "long" and r.t(i - 1) != "long":
                    out.append(_finding(file, line, "Metal has no long long; use long (64 bits) or int64_t",
                                        "long-long"))
            elif s in _FORBIDDEN:
                if s == "delete" and r.t(i - 1) == "=":
                    continue  # a deleted function, not the operator
                rule, message = _FORBIDDEN[s]
                out.append(_finding(file, line, message, rule))
            elif s == "noexcept" and r.t(i + 1) == "(" and r.t(i - 1) not in (")", "]", "const", "&", "&&"):
                out.append(_finding(file, line, "the noexcept operator is not available in Metal",
                                    "noexcept-operator"))
        elif s == "[" and r.t(i + 1) != "[" and r.t(i - 1) != "[":
            prev = toks[i - 1] if i else None
            subscript = prev is not None and (prev.kind in _SUBSCRIPTABLE or prev.text in (")", "]"))
            if subscript and prev.text not in ("return", "co_return"):
                continue  # a subscript or an array declarator
            close = r.match(i, "[", "]")
            if r.t(close + 1) in ("(", "{", "mutable", "->", "<"):
                out.append(_finding(file, line, "lambda expressions are not available in Metal", "lambda"))
        elif s == "(" and r.t(i + 1) in ("*", "&") and r.t(i + 2) != ")":
            # `(*name)(` or `(*)(`: a pointer or reference to a function.
            k = i + 2
            while k < len(toks) and (toks[k].kind == "ident" or r.t(k) == "::"):
                k += 1
            if r.t(k) == ")" and r.t(k + 1) == "(" and (k > i + 2 or r.t(i + 1) == "*") \
                    and not _in_parameter_list(r, i):
                out.append(_finding(file, line, "function pointers are not available here (Metal allows them "
                                    "only for [[visible]] functions linked at pipeline creation)",
                                    "function-pointer"))
    for f in r.functions:
        if f.name == "main":
            out.append(_finding(f.file, f.line, "a Metal function cannot be named main", "main"))


# `#pragma METAL internals : enable` ... `: disable`: what Apple's own
# headers (metal_stdlib) and MLX's (steel/utils/type_traits.h,
# integral_constant.h, atomic.h: always paired) write beyond the rules of
# user code, derived classes among it. The preprocessed text keeps pragmas
# (clang -E writes `_Pragma("...")` as a `#pragma` line too); their state
# runs on in text order, through the end of a header, until the next one.
_INTERNALS = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+METAL[ \t]+internals[ \t]*:[ \t]*(enable|disable)\b", re.M)


def _internals_regions(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the text in `#pragma METAL internals` regions."""
    regions, start = [], None
    for m in _INTERNALS.finditer(text):
        if m.group(1) == "enable" and start is None:
            start = m.end()
        elif m.group(1) == "disable" and start is not None:
            regions.append((start, m.start()))
            start = None
    if start is not None:
        regions.append((start, len(text)))
    return regions


def _class_head_base(r: _Reader, i: int) -> tuple[str, int] | None:
    """For `struct`/`class` at token i, (the class's name, '{' of its body)
    if it opens a definition with a base-specifier list (`struct S : B {`,
    `template <...> struct S<float> final : public A, B<S> {`, `struct : B {`),
    else None: an elaborated type (`struct S* p`), a forward declaration, a
    definition without bases, `enum class E : uint`, or a template's `class T`
    parameter (no ':' follows its name)."""
    toks = r.toks
    if r.t(i - 1) == "enum":
        return None
    k = i + 1
    while k < len(toks):  # attributes and alignment before the name
        a = r.attribute_at(k)
        if a:
            k = a[0]
        elif r.t(k) in ("alignas", "__attribute__", "__declspec") and r.t(k + 1) == "(":
            k = r.match(k + 1, "(", ")") + 1
        else:
            break
    name = ""
    while k < len(toks) and toks[k].kind == "ident":
        name = r.t(k)
        k += 1
        if r.t(k) == "<":  # a specialisation's arguments
            k = r.match(k, "<", ">") + 1
        if r.t(k) != "::":
            break
        k += 1
    if r.t(k) == "final":
        k += 1
    if r.t(k) != ":":
        return None
    j = k + 1
    while j < len(toks):  # the base clause runs to the body's '{'
        s = r.t(j)
        if s == "{":
            return name, j
        if s in (";", "}", ")", "="):
            return None
        if s in ("<", "("):  # template arguments, decltype(...)
            j = r.match(j, s, ">" if s == "<" else ")")
        j += 1
    return None


def _class_rules(r: _Reader, out: list[str]):
    """Derived classes, outside `#pragma METAL internals` regions."""
    regions = _internals_regions(r.text)
    for i, tok in enumerate(r.toks):
        if tok.kind != "ident" or tok.text not in ("struct", "class"):
            continue
        head = _class_head_base(r, i)
        if head is None or any(a <= tok.start < b for a, b in regions):
            continue
        name, brace = head
        colon = next(k for k in range(i + 1, brace) if r.t(k) == ":")
        bases = " ".join(r.text[r.toks[colon + 1].start : r.toks[brace - 1].end].split())
        file, line = r.where(tok.start)
        out.append(_finding(file, line, f"{tok.text} '{name or '(anonymous)'}' derives from {bases}: derived classes "
                            "are not supported in Metal (hold the base as a member, or write one flat struct)",
                            "derived-class"))


def _in_parameter_list(r: _Reader, i: int) -> bool:
    """Whether the declarator starting at token i declares a parameter (what
    precedes its type is '(' or ','). Apple's compiler takes a function
    pointer parameter of a function it inlines: PyTorch's c10/metal/atomic.h
    passes the operation of its atomic read-modify-write loops so."""
    depth = 0
    for k in range(i - 1, -1, -1):
        s = r.t(k)
        if s in (">", ">>", ")", "]"):
            depth += 2 if s == ">>" else 1
        elif s in ("<", "(", "[") and depth > 0:
            depth -= 1
        elif depth == 0 and s in ("(", ","):
            return True
        elif depth == 0 and s in (";", "{", "}", "="):
            return False
    return False


# ---------------------------------------------------- static storage rules --
def _declaration_kind(r: _Reader, idx: list[int]) -> tuple[str, int | None]:
    """('variable', name token) or ('other', None) for a namespace- or
    class-scope statement (token indices, attributes removed)."""
    words = [r.t(k) for k in idx]
    while len(words) >= 2 and words[0] in ("public", "private", "protected") and words[1] == ":":
        idx, words = idx[2:], words[2:]
    if not words:
        return "other", None
    if words[0] == "template":
        if len(words) > 1 and words[1] == "<":
            close = r.match(idx[1], "<", ">")
            rest = [k for k in idx if k > close]
            return _declaration_kind(r, rest)
        return "other", None  # explicit instantiation
    if words[0] in ("typedef", "using", "static_assert", "friend", "namespace", "enum", "extern"):
        return "other", None
    if words.count("}") > words.count("{"):  # `struct S {...} s;`: what follows the class body (its '{' is not here)
        after = [k for k in idx[len(words) - words[::-1].index("}"):] if r.toks[k].kind == "ident"]
        return ("variable", after[0]) if after else ("other", None)
    if words[0] in ("struct", "class", "union") and len(words) <= 3:
        return "other", None  # a forward declaration or an elaborated type
    if "operator" in words:
        return "other", None
    depth, name, brackets = 0, None, _translate._Brackets()
    for k in idx:
        s = r.t(k)
        if depth == 0:
            if s == "=":
                return "variable", name
            if s == "(":
                return "other", None  # a function
            if s in ("[", "{"):
                return "variable", name
            if r.toks[k].kind == "ident":
                name = k
        depth = brackets.step(s)
    return "variable", name


def _storage_rules(r: _Reader, out: list[str]):
    """Variables with static storage live in the constant address space."""
    toks = r.toks
    bodies = {b.open: b for b in r.bodies}
    attr_ranges = set()
    function_constants = set()  # attribute tokens of [[function_constant(N)]]
    for i in range(len(toks)):
        a = r.attribute_at(i)
        if a:
            attr_ranges.update(range(i, a[0]))
            if any(n == "function_constant" for n, _ in a[1]):
                function_constants.update(range(i, a[0]))

    def check(stmt: list[int], scope: str):
        # A function constant's value comes from the pipeline (MSL 5.8.1).
        initialized_by_pipeline = any(k in function_constants for k in stmt)
        stmt = [k for k in stmt if k not in attr_ranges]
        kind, name_at = _declaration_kind(r, stmt)
        if kind != "variable":
            return
        words = {r.t(k) for k in stmt}
        if scope == "class" and "static" not in words:
            return
        file, line = r.where(toks[stmt[0]].start)
        name = r.t(name_at) if name_at is not None else "?"
        if "constant" not in words:
            if scope == "ns":
                out.append(_finding(file, line, f"program-scope variable '{name}' must be in the constant address "
                                    "space (declare it `constant`)", "program-scope-variable"))
            else:
                out.append(_finding(file, line, f"static member '{name}' must be in the constant address space "
                                    "(`static constant constexpr`), or use an enum", "static-variable"))
        elif scope == "ns" and not ({"=", "{"} & {r.t(k) for k in stmt}) and "extern" not in words \
                and not initialized_by_pipeline:
            out.append(_finding(file, line, f"constant variable '{name}' must be initialized where it is declared",
                                "constant-initializer"))

    scopes = ["ns"]
    heads: list[list[int]] = []  # statement heads of the open namespace and class bodies
    stmt: list[int] = []
    i = 0
    while i < len(toks):
        s = r.t(i)
        scope = scopes[-1]
        if scope in ("ns", "class"):
            if s == "{":
                if i in bodies:  # a function definition: skip its body
                    _function_body_rules(r, bodies[i], out)
                    i = bodies[i].close + 1
                    stmt = []
                    continue
                kind = r._classify_brace(stmt[0] if stmt else i, i) if stmt else "init"
                if kind in ("ns", "class"):
                    scopes.append(kind)
                    heads.append(stmt)  # `typedef struct` or `struct S`: the statement goes on after the body
                    stmt = []
                else:  # a braced initializer belongs to the statement
                    close = r.match(i, "{", "}")
                    stmt += list(range(i, close + 1))
                    i = close + 1
                    continue
            elif s == "}":
                scopes.pop()
                stmt = heads.pop() + [i] if scopes[-1] in ("ns", "class") and heads else []
                if stmt and r.t(stmt[0]) in ("namespace", "extern", "inline"):
                    stmt = []
            elif s == ";":
                check(stmt, scope)
                stmt = []
            else:
                stmt.append(i)
        i += 1


def _function_body_rules(r: _Reader, body: _Body, out: list[str]):
    f = body.function
    for k in range(body.open + 1, body.close):
        s = r.t(k)
        if s == "static" and r.t(k - 1) in (";", "{", "}", ")", ":"):
            j = k
            words = set()
            while j < body.close and r.t(j) != ";":
                words.add(r.t(j))
                j += 1
            if "constant" not in words:
                file, line = r.where(r.toks[k].start)
                out.append(_finding(file, line, f"static local variable in '{f.name}' must be in the constant "
                                    "address space (declare it `constant`)", "static-variable"))
    if not f.is_kernel:
        for tg, _decl in r.threadgroup_vars:
            if body.open < tg < body.close:
                file, line = r.where(r.toks[tg].start)
                out.append(
                    _finding(
                        file,
                        line,
                        f"threadgroup variable declared in '{f.name}', which is not a "
                        "kernel: declare it in the kernel and pass a pointer",
                        "threadgroup-variable-scope",
                    )
                )


# ------------------------------------------------------------ kernel rules --
def _components(type_text: str) -> tuple[str, int] | None:
    """('uint', 2) for 'uint2'; None if not a Metal scalar or vector type."""
    m = re.fullmatch(r"(bool|char|uchar|short|ushort|int|uint|long|ulong|half|bfloat|float)([234]?)", type_text)
    if not m:
        return None
    return m.group(1), int(m.group(2) or 1)


_INTEGER_EXPR = re.compile(r"^[\d\s+\-*/%()uUlL]+$")


def _evaluate(expr: str) -> int | None:
    """An integer constant written with literals and + - * / % only."""
    expr = expr.strip()
    if not expr or not _INTEGER_EXPR.match(expr):
        return None
    expr = re.sub(r"(\d+)[uUlL]+", r"\1", expr).replace("/", "//")
    try:
        value = eval(compile(ast.parse(expr, mode="eval"), "<expr>", "eval"), {"__builtins__": {}})
    except Exception:
        return None
    return value if isinstance(value, int) else None


def _threadgroup_bytes(r: _Reader, decl: list[int]) -> int | None:
    """Bytes of `threadgroup T a[N]...;` when T and N are known here."""
    parts = r._split_top_level(decl[0], decl[-1] + 1) if decl else []
    total = 0
    type_size = None
    for n, part in enumerate(parts):
        words = [r.t(k) for k in part]
        if "[" in words:
            head, dims_at = words[: words.index("[")], words.index("[")
        else:
            head, dims_at = words, len(words)
        if n == 0:
            type_words = [w for w in head[:-1] if w not in ("const", "volatile", "metal", "::")]
            if len(type_words) != 1:
                return None
            tt = type_words[0]
            c = _components(tt)
            if tt in _SCALAR_SIZE:
                type_size = _SCALAR_SIZE[tt]
            elif c and c[0] in _SCALAR_SIZE:
                type_size = _SCALAR_SIZE[c[0]] * (4 if c[1] == 3 else c[1])
            else:
                return None
        count = 1
        rest = part[dims_at:]
        k = 0
        while k < len(rest):
            if r.t(rest[k]) != "[":
                return None
            close = r.match(rest[k], "[", "]")
            v = _evaluate(r.text[r.toks[rest[k]].end : r.toks[close].start])
            if v is None:
                return None
            count *= v
            k = next((m for m, t in enumerate(rest) if t == close), len(rest)) + 1
        total += count * type_size
    return total


def _kernel_rules(r: _Reader, out: list[str]):
    for body in r.bodies:
        f = body.function
        if not f.is_kernel:
            continue
        where = f"kernel '{f.name}'"
        sig = r._signature(body.start, body.open)
        if sig:
            k = body.start
            if r.t(k) == "template":
                k = r.match(k + 1, "<", ">") + 1
            words = []
            while k < sig[0]:
                a = r.attribute_at(k)
                if a:
                    k = a[0]
                    continue
                if r.toks[k].kind == "ident" and r.t(k) not in ("kernel", "inline", "static", "metal"):
                    words.append(r.t(k))
                k += 1
            if words != ["void"]:
                out.append(_finding(f.file, f.line, f"{where} returns '{' '.join(words)}'; a kernel returns void",
                                    "kernel-return"))
        for name, arg in body.attributes:
            if name == "max_total_threads_per_threadgroup":
                v = _evaluate(arg)
                if v is not None and not 1 <= v <= _MAX_THREADS_PER_THREADGROUP:
                    out.append(_finding(f.file, f.line, f"{where}: [[max_total_threads_per_threadgroup({arg})]] is "
                                        f"{v}; Apple GPUs run 1 to {_MAX_THREADS_PER_THREADGROUP} threads per "
                                        "threadgroup", "max-threads"))
        _builtin_rules(r, f, where, out)
        _binding_rules(f, where, out)
        total, known = 0, True
        for tg, decl in r.threadgroup_vars:
            if body.open < tg < body.close:
                b = _threadgroup_bytes(r, decl)
                if b is None:
                    known = False  # checked when the kernel is dispatched
                else:
                    total += b
        if total > _MAX_THREADGROUP_MEMORY:
            out.append(_finding(f.file, f.line, f"{where} declares {total} bytes of threadgroup variables"
                                f"{'' if known else ' or more'}; Metal allows {_MAX_THREADGROUP_MEMORY}",
                                "threadgroup-memory"))


def _builtin_rules(r: _Reader, f: _translate.Function, where: str, out: list[str]):
    types = {}
    for p in f.params:
        if p.attribute not in _BUILTIN_TYPES:
            continue
        t = r.param_types.get(id(p), "")
        t = _ALIASES.get(t, t)
        c = _components(t)  # None: a template parameter or another name, not checked here
        if c is not None and t not in _BUILTIN_TYPES[p.attribute]:
            out.append(_finding(f.file, p.line, f"{where}: [[{p.attribute}]] parameter '{p.name}' is {t}; Metal "
                                f"allows {', '.join(sorted(_BUILTIN_TYPES[p.attribute]))}", "builtin-type"))
            continue
        if c is not None:
            types[p.attribute] = (t, c, p)
    widths = {a: v for a, v in types.items() if a in _POSITION_ATTRIBUTES}
    if len({c[1] for _, c, _ in widths.values()}) > 1:
        listing = ", ".join(f"{t} {p.name} [[{a}]]" for a, (t, _, p) in widths.items())
        line = max(p.line for _, _, p in widths.values())
        out.append(_finding(f.file, line, f"{where} mixes vector widths of position and size attributes ({listing}); "
                            "Metal requires them all scalar or all with the same number of components",
                            "builtin-width"))
    for group in _SAME_TYPE:
        present = [(a, types[a]) for a in group if a in types]
        if len({t for _, (t, _, _) in present}) > 1:
            listing = ", ".join(f"{t} [[{a}]]" for a, (t, _, _) in present)
            line = max(p.line for _, (_, _, p) in present)
            out.append(_finding(f.file, line, f"{where}: {listing} must have the same type", "builtin-same-type"))
    pos, idx = types.get("thread_position_in_threadgroup"), types.get("thread_index_in_threadgroup")
    if pos and idx and pos[1][0] == "uint" and idx[0] != "uint":
        out.append(_finding(f.file, idx[2].line, f"{where}: [[thread_index_in_threadgroup]] must be uint when "
                            f"[[thread_position_in_threadgroup]] is {pos[0]}", "thread-index-type"))
    if "thread_execution_width" in {p.attribute for p in f.params} and \
            "threads_per_simdgroup" in {p.attribute for p in f.params}:
        p = next(p for p in f.params if p.attribute == "threads_per_simdgroup")
        out.append(_finding(f.file, p.line, f"{where} declares both [[thread_execution_width]] and "
                            "[[threads_per_simdgroup]]; Metal allows one of them", "builtin-conflict"))


def _binding_rules(f: _translate.Function, where: str, out: list[str]):
    for attribute, rule in (("buffer", "buffer-index"), ("threadgroup", "threadgroup-index")):
        seen: dict[int, str] = {}
        for p in f.params:
            if p.attribute != attribute:
                continue
            v = _evaluate(p.argument)
            if v is None:
                continue
            if not 0 <= v <= _MAX_BINDING_INDEX:
                out.append(_finding(f.file, p.line, f"{where}: [[{attribute}({p.argument})]] of '{p.name}' is out of "
                                    f"range; Metal has indices 0 to {_MAX_BINDING_INDEX}", rule))
            if v in seen:
                out.append(_finding(f.file, p.line, f"{where}: '{p.name}' and '{seen[v]}' both use "
                                    f"[[{attribute}({v})]]", rule))
            seen.setdefault(v, p.name)


def _host_name_rules(r: _Reader, out: list[str]):
    first: dict[str, tuple[str, int]] = {}
    for k, file in zip(r.kernels, r.kernel_files):
        if k.host_name in first:
            out.append(_finding(file, k.line, f"kernel name '{k.host_name}' is already used at "
                                f"{':'.join(map(str, first[k.host_name]))}", "host-name"))
        first.setdefault(k.host_name, (file, k.line))


def lint(preprocessed: str) -> list[str]:
    """Findings in the preprocessed shader, as 'file:line: message [msl-rule]'."""
    r = _read(preprocessed)
    findings: list[str] = []
    _token_rules(r, findings)
    _class_rules(r, findings)
    _storage_rules(r, findings)
    _kernel_rules(r, findings)
    _host_name_rules(r, findings)

    by_name = {(f"{f.owner}::{f.name}" if f.owner else f.name): f for f in r.functions}
    for cyc in _find_cycles(r.functions):
        f = by_name[cyc[0]]
        findings.append(_finding(f.file, f.line, f"recursion is not allowed in Metal: {' -> '.join(cyc)}", "recursion"))

    for f in r.functions:
        for p in f.params:
            if f.is_kernel and not p.attribute:
                findings.append(_finding(
                    f.file, p.line, f"parameter '{p.name}' of kernel '{f.name}' has no attribute "
                    "([[buffer(i)]], [[threadgroup(i)]] or a builtin such as [[thread_position_in_grid]])",
                    "kernel-param-attribute"))
            if f.is_kernel and p.attribute in _ARGUMENT_SPACES:
                spaces = _ARGUMENT_SPACES[p.attribute]
                by_address = p.is_pointer or p.is_reference or (p.is_array and p.attribute == "buffer")
                if not by_address or (p.address_space and p.address_space not in spaces):
                    findings.append(_finding(
                        f.file, p.line, f"[[{p.attribute}({p.argument})]] parameter '{p.name}' of kernel '{f.name}' "
                        f"must be a {' or '.join(spaces)} pointer or reference"
                        f"{' (or array)' if p.attribute == 'buffer' else ''}: Metal passes no buffer by value",
                        "kernel-argument-type"))
            pointer = p.is_pointer or (f.is_kernel and p.is_reference)
            if pointer and not p.address_space:
                findings.append(_finding(
                    f.file, p.line, f"parameter '{p.name}' of '{f.name}' is a pointer or reference without an "
                    "address space (device, constant, threadgroup or thread)", "pointer-address-space"))

    def key(s: str):
        parts = s.split(":")
        return parts[0], int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0, s
    return sorted(set(findings), key=key)
