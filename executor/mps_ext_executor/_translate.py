"""Metal Shading Language -> C++ for the CPU Metal executor.

The input is the preprocessed shader (clang -E output, line markers kept). The
rewrite is token based and keeps every newline where it was, so a compiler
message about the rewritten text points at the right line of the shader.

What changes, and why C++ needs it:
- Metal attributes ([[buffer(0)]], [[host_name("x")]], [[kernel]], ...) are
  recorded and removed; `kernel` is removed.
- `threadgroup T x[N];` inside a function becomes a reference to storage the
  engine hands out per threadgroup (a C++ local would be per thread).
- `constant` at program scope becomes `const` (data, not an address space).
- Vector constructors (`float4(a.xy, 0, 1)`) become `__mx_make<float4>(...)`;
  `1.5h` becomes a _Float16 literal; an unsuffixed floating literal becomes a
  float one, because Metal has no double.
- Explicit instantiations (`template [[host_name("k_f32")]] kernel ...;`) are
  removed and recorded: the generated entry point instantiates the template.

Then `entry_points()` generates, per kernel, an extern "C" entry that unpacks
an mx_thread_info into the kernel's parameters, and the table the engine reads
(mx_abi.h).
"""

from __future__ import annotations

import bisect
import dataclasses
import re

__all__ = ["TranslateError", "Kernel", "Param", "Translation", "translate", "entry_points", "VECTOR_TYPES"]


class TranslateError(Exception):
    """The shader uses something the executor cannot translate."""


_SCALARS = ["float", "half", "bfloat", "int", "uint", "short", "ushort", "char", "uchar", "long", "ulong", "bool"]
VECTOR_TYPES = frozenset(
    [f"{s}{n}" for s in _SCALARS for n in (2, 3, 4)]
    + [f"packed_{s}{n}" for s in _SCALARS if s != "bool" for n in (2, 3, 4)]
)

# Attributes C++ itself understands; everything else inside [[ ]] is Metal's.
_STANDARD_ATTRIBUTES = {"maybe_unused", "likely", "unlikely", "nodiscard", "fallthrough", "noreturn", "deprecated"}

# Builtin kernel parameters: attribute -> C++ value from `t` (mx_thread_info*).
BUILTINS = {
    "thread_position_in_grid": "t->thread_position_in_grid",
    "thread_position_in_threadgroup": "t->thread_position_in_threadgroup",
    "threadgroup_position_in_grid": "t->threadgroup_position_in_grid",
    "threads_per_threadgroup": "t->threads_per_threadgroup",
    "dispatch_threads_per_threadgroup": "t->dispatch_threads_per_threadgroup",
    "threadgroups_per_grid": "t->threadgroups_per_grid",
    "threads_per_grid": "t->threads_per_grid",
    "thread_index_in_threadgroup": "t->thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "t->thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "t->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "t->simdgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup": "t->simdgroups_per_threadgroup",
    "threads_per_simdgroup": "32u",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "t->thread_index_in_threadgroup % 4u",
    "quadgroup_index_in_threadgroup": "t->thread_index_in_threadgroup / 4u",
}

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>[ \t\r\f\v]+|\n)
  | (?P<directive>(?<![^\n])[ \t]*\#[^\n]*)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<string>(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*")
  | (?P<char>(?:u8|u|U|L)?'(?:\\.|[^'\\\n])*')
  | (?P<number>\.?[0-9](?:[eEpP][+-]|[0-9A-Za-z_.']|)*)
  | (?P<ident>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<punct>::|->\*?|\.\.\.|<<=|>>=|<=>|[-+*/%&|^!=<>]=|&&|\|\||\+\+|--|<<|>>|\#\#|.)
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclasses.dataclass
class Tok:
    kind: str
    text: str
    start: int
    end: int


def tokenize(text: str) -> list[Tok]:
    toks = []
    for m in _TOKEN_RE.finditer(text):
        kind = m.lastgroup
        if kind in ("ws", "comment", "directive"):
            continue
        toks.append(Tok(kind, m.group(), m.start(), m.end()))
    return toks


@dataclasses.dataclass
class Param:
    name: str
    attribute: str  # e.g. "buffer", "threadgroup", "thread_position_in_grid"
    argument: str  # the attribute's argument, a C++ expression ("" if none)
    address_space: str  # "device", "constant", "threadgroup", "thread" or ""
    is_reference: bool
    line: int
    is_pointer: bool = False
    is_array: bool = False  # `constant int64_t strides[3]`: a pointer into its address space


@dataclasses.dataclass
class Kernel:
    host_name: str
    callee: str  # qualified C++ name to call, e.g. "ns::softmax<float>"
    params: list[Param]
    max_threads: str  # C++ expression, "0" if not given
    line: int


@dataclasses.dataclass
class Function:
    """A function definition, for the lint."""

    name: str
    file: str
    line: int
    is_kernel: bool
    params: list[Param]
    # (qualifier, name) of each call in the body: ("", "f") for `f(`,
    # ("C", "f") for `C::f(` (the last component before the name).
    calls: set[tuple[str, str]]
    owner: str = ""  # the class a member function belongs to, "" for a free function
    # Names called as `x.f(` or `p->f(`: the object's class is not known.
    method_calls: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Translation:
    text: str  # the rewritten shader
    kernels: list[Kernel]
    problems: list[tuple[int, str]]  # (line, message) the translator noticed
    functions: list[Function] = dataclasses.field(default_factory=list)
    # (line, name) of each [[function_constant(N)]] declaration: check mode
    # compiles them (value-initialised); the executor cannot run them, since
    # their values come from the pipeline it does not have.
    function_constants: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # Classes with member functions qualified with an address space: their
    # objects in device, constant or threadgroup memory may call them.
    address_space_classes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _KernelDef:
    name: str
    namespace: tuple[str, ...]
    is_template: bool
    params: list[Param]
    max_threads: str
    line: int
    # (is a type, name, default or "") of a template's parameters.
    template_params: list = dataclasses.field(default_factory=list)


class _Translator:
    def __init__(self, text: str):
        self.text = text
        self.toks = tokenize(text)
        self.edits: list[tuple[int, int, str]] = []
        self.kernel_defs: dict[tuple[tuple[str, ...], str], _KernelDef] = {}
        self.kernels: list[Kernel] = []
        self.problems: list[tuple[int, str]] = []
        self.functions: list[Function] = []
        self.function_constants: list[tuple[int, str]] = []
        # Member functions qualified with an address space (`T get() const device`):
        # (class scope depth, '{' of the class, definition start, '{' of the body, qualifier token).
        self.member_spaces: list[tuple] = []
        self.address_space_classes: set[str] = set()
        self.tg_counter = 0
        self.type_names = self._type_names()
        self.unevaluated = self._unevaluated_operands()
        self._line_cache = self._build_line_map()
        self._line_starts = [m[0] for m in self._line_cache]

    def _type_names(self) -> frozenset:
        """Names that may stand for a vector type: aliases (`using
        complex_T = float2;`, typedefs) and template type parameters, in any
        scope (a name is one or the other throughout the corpora we know)."""
        names, toks = set(), self.toks
        for k, tok in enumerate(toks):
            s = tok.text
            if s == "using" and k + 2 < len(toks) and toks[k + 1].kind == "ident" and toks[k + 2].text == "=":
                names.add(toks[k + 1].text)
            elif s in ("typename", "class") and k > 0 and toks[k - 1].text in ("<", ",") \
                    and k + 1 < len(toks) and toks[k + 1].kind == "ident" \
                    and (k + 2 >= len(toks) or toks[k + 2].text in (",", ">", "=", ">>")):
                names.add(toks[k + 1].text)  # a template type parameter
            elif s == "typedef":
                j, depth, brackets = k + 1, 0, _Brackets()
                while j < len(toks) and not (toks[j].text == ";" and depth == 0) and toks[j].text != "{":
                    depth = brackets.step(toks[j].text)
                    j += 1
                if j < len(toks) and toks[j].text == ";" and toks[j - 1].kind == "ident":
                    names.add(toks[j - 1].text)
        return frozenset(names - VECTOR_TYPES)

    def _unevaluated_operands(self) -> list[tuple[int, int]]:
        """Token ranges of the operands of decltype and sizeof: a constructor
        rewritten there gets a site without its default arguments, which are
        source-location builtins that clang cannot mangle when the operand is
        part of a template's signature (c10/metal/utils.h's `common_dtype =
        decltype(U(0) + V(0))`)."""
        return [(k + 1, self.match(k + 1, "(", ")")) for k, tok in enumerate(self.toks)
                if tok.text in ("decltype", "sizeof") and self.t(k + 1) == "("]

    # ----------------------------------------------------------- positions --
    def _build_line_map(self):
        """Presumed (file, line) at every offset, from the line markers."""
        marks = []  # (offset of the line after the marker, file, line)
        for m in re.finditer(r'(?m)^#\s*(?:line\s+)?(\d+)\s+"([^"]*)"[^\n]*\n', self.text):
            marks.append((m.end(), m.group(2), int(m.group(1))))
        return marks

    def where(self, offset: int) -> tuple[str, int]:
        # The last line marker at or before offset (the markers are in
        # order): a bisection, as the lint asks for every finding.
        k = bisect.bisect_right(self._line_starts, offset) - 1
        if k < 0:
            return "<shader>", 1 + self.text.count("\n", 0, offset)
        base, file, line = self._line_cache[k]
        return file, line + self.text.count("\n", base, offset)

    def line(self, offset: int) -> int:
        return self.where(offset)[1]

    def problem(self, offset: int, message: str):
        file, line = self.where(offset)
        self.problems.append((line, f"{file}:{line}: {message}"))

    # --------------------------------------------------------------- edits --
    def blank(self, a: int, b: int):
        """Replace toks[a:b] (token indices) with whitespace, keeping newlines."""
        start, end = self.toks[a].start, self.toks[b - 1].end
        self.edits.append((start, end, _whitespace_like(self.text[start:end])))

    def replace(self, i: int, text: str):
        self.edits.append((self.toks[i].start, self.toks[i].end, text))

    def insert(self, offset: int, text: str):
        self.edits.append((offset, offset, text))

    def result(self) -> str:
        out, pos = [], 0
        for start, end, text in sorted(self.edits, key=lambda e: (e[0], e[1])):
            if start < pos:
                raise TranslateError(f"internal error: overlapping rewrites at offset {start}")
            out.append(self.text[pos:start])
            out.append(text)
            pos = end
        out.append(self.text[pos:])
        return "".join(out)

    # ------------------------------------------------------------- helpers --
    def t(self, i: int) -> str:
        return self.toks[i].text if 0 <= i < len(self.toks) else ""

    def match(self, i: int, open_: str, close: str) -> int:
        """Index of the token closing the bracket opened at i."""
        depth = parens = 0
        for j in range(i, len(self.toks)):
            s = self.toks[j].text
            if open_ == "<" and s in ("(", "["):
                parens += 1  # `sizeof(T) < 8` in a template argument list compares
            elif open_ == "<" and s in (")", "]"):
                parens -= 1
            elif parens > 0:
                continue
            elif (
                open_ == "<" and s == "<" and j > i and self.toks[j - 1].kind != "ident" and self.t(j - 1) != "template"
            ):
                continue  # `sizeof(T) < 8`: a comparison, no template argument list opens after ')'
            elif s == open_:
                depth += 1
            elif s == close:
                depth -= 1
                if depth == 0:
                    return j
            elif open_ == "<" and s == ">>":
                depth -= 2
                if depth <= 0:
                    return j
            elif open_ == "<" and s in (";", "{", "}"):
                break
        raise TranslateError(f"{self.where(self.toks[i].start)}: unbalanced '{open_}'")

    def attribute_at(self, i: int):
        """If toks[i:] starts `[[ ... ]]`, return (end index, [(name, arg)])."""
        if self.t(i) != "[" or self.t(i + 1) != "[":
            return None
        depth, j = 0, i
        while j < len(self.toks):
            s = self.t(j)
            if s == "[":
                depth += 1
            elif s == "]":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if self.t(j - 1) != "]":
            return None
        items, k = [], i + 2
        while k < j - 1:
            if self.toks[k].kind != "ident":
                k += 1
                continue
            name = self.t(k)
            k += 1
            while self.t(k) == "::":
                name += "::" + self.t(k + 1)
                k += 2
            arg = ""
            if self.t(k) == "(":
                close = self.match(k, "(", ")")
                arg = self.text[self.toks[k].end : self.toks[close].start].strip()
                k = close + 1
            items.append((name, arg))
            while k < j - 1 and self.t(k) != ",":
                k += 1
            k += 1
        return j + 1, items

    # ---------------------------------------------------------------- walk --
    def run(self) -> Translation:
        toks = self.toks
        # Scopes: ("ns", name) for namespaces and extern "C" blocks,
        # ("class",), ("func",), ("init",) for braced initialisers.
        scopes: list[tuple] = [("ns", None)]
        self._scopes = scopes  # the class a function definition is in, for the lint's call graph
        stmt_start = 0  # token index where the current statement began
        stmt_attrs: list[tuple[str, str]] = []
        stmt_kernel = False
        parens = 0  # parenthesis depth at namespace or class scope
        i = 0
        while i < len(toks):
            tok = toks[i]
            scope = scopes[-1][0]
            s = tok.text

            attr = self.attribute_at(i)
            if attr:
                end, items = attr
                names = {n for n, _ in items}
                if not names <= _STANDARD_ATTRIBUTES:
                    self.blank(i, end)
                if scope in ("ns", "class") and parens == 0:
                    stmt_attrs.extend(items)
                    stmt_kernel = stmt_kernel or "kernel" in names
                i = end
                continue

            if tok.kind == "number":
                self._rewrite_number(i)
            elif tok.kind == "string":
                self._string_argument(i)
            elif tok.kind == "ident" and scope == "func" and s in VECTOR_TYPES and self.toks[i + 1].kind == "ident" \
                    and self.t(i + 2) == "(" and self.t(i - 1) in (";", "{", "}", "const", ")"):
                # `short2 offset(a, b);`: a vector declared with constructor arguments.
                self.insert(self.toks[i + 1].end, f" = __mx_make<{s}>")
                self._insert_site(i + 2)
                i += 1
                continue
            elif tok.kind == "ident" and self._rewrite_vector_constructor(i):
                i += 1
                continue

            if scope in ("ns", "class"):
                if s == "(":
                    parens += 1
                elif s == ")":
                    parens -= 1
                elif parens > 0:
                    pass  # a parameter list: address spaces stay what they are
                elif s == "template" and self.t(i + 1) != "<" and scope == "ns":
                    i = self._explicit_instantiation(i, scopes)
                    stmt_start, stmt_attrs, stmt_kernel = i, [], False
                    continue
                elif (
                    s in ("kernel", "vertex", "fragment")
                    and scope == "ns"
                    and self.t(i + 1) not in ("(", "=", ";", ",")
                ):
                    if s != "kernel":
                        self.problem(tok.start, f"{s} functions are not supported by the CPU Metal executor")
                    self.blank(i, i + 1)
                    stmt_kernel = stmt_kernel or s == "kernel"
                elif s == "constant" and (scope == "ns" or "static" in (self.t(k) for k in range(stmt_start, i))):
                    # Program-scope and static data, not an address space; a
                    # member `constant T* p` points into constant memory.
                    self.replace(i, "const   ")
                elif s == ";":
                    if any(n == "function_constant" for n, _ in stmt_attrs):
                        self._function_constant(stmt_start, i)
                    stmt_start, stmt_attrs, stmt_kernel = i + 1, [], False
                elif s == "}":
                    scopes.pop()
                    if not scopes:
                        raise TranslateError("unbalanced '}'")
                    stmt_start, stmt_attrs, stmt_kernel = i + 1, [], False
                elif s == "{":
                    kind = self._classify_brace(stmt_start, i)
                    if kind == "func":
                        self._function_definition(stmt_start, i, stmt_kernel)
                        if scope == "class":
                            self._member_address_space(stmt_start, i, len(scopes))
                    if kind == "func" and stmt_kernel:
                        self._kernel_definition(stmt_start, i, scopes, stmt_attrs)
                    if kind == "ns":
                        name = self._namespace_name(stmt_start, i)
                    else:
                        name = self._class_name(stmt_start, i) if kind == "class" else None
                    if kind == "class" and name:
                        self._copies_from_address_spaces(i, name)
                    scopes.append((kind, name))
                    stmt_start, stmt_attrs, stmt_kernel = i + 1, [], False
                i += 1
                continue

            # Inside a function body or an initialiser.
            if s == "{":
                scopes.append((scope,))
            elif s == "}":
                scopes.pop()
                if scopes[-1][0] in ("ns", "class"):
                    stmt_start, stmt_attrs, stmt_kernel = i + 1, [], False
            elif s == "threadgroup" and scope == "func" and self.t(i - 1) in (";", "{", "}"):
                nxt = self._threadgroup_declaration(i)
                if nxt is not None:
                    i = nxt
                    continue
            i += 1
        self._resolve_member_address_spaces()
        return Translation(self.result(), self.kernels, self.problems, self.functions, self.function_constants,
                           sorted(self.address_space_classes))

    _SPACES = ("device", "constant", "threadgroup", "threadgroup_imageblock", "thread")

    def _member_address_space(self, start: int, brace: int, depth: int):
        """Record a member function whose `this` is in an address space
        (`operator vec<T, 2>() const device`, MSL 4.?): C++ has no such
        qualifier, so _resolve_member_address_spaces rewrites them."""
        sig = self._signature(start, brace)
        if not sig:
            return
        k = sig[2] + 1
        while self.t(k) in ("const", "volatile") + self._SPACES:
            if self.t(k) in self._SPACES:
                self.member_spaces.append((depth, self._class_open(start), start, brace, k))
                return
            k += 1
        self.member_spaces.append((depth, self._class_open(start), start, brace, None))

    def _class_open(self, start: int) -> int:
        """Token index of the '{' of the class the statement at `start` is in."""
        depth = 0
        for k in range(start - 1, -1, -1):
            s = self.t(k)
            if s == "}":
                depth += 1
            elif s == "{":
                if depth == 0:
                    return k
                depth -= 1
        return -1

    def _resolve_member_address_spaces(self):
        """Overloads of one member function for several address spaces of
        `this` (MLX's complex_t has `operator vec<T, 2>()` for thread,
        threadgroup, device and constant objects) become one function with
        the qualifier dropped: the one for `thread` (or unqualified) is
        kept, the others removed; a function with only another address
        space keeps its body without the qualifier. In check mode, calls on
        objects of such a class in any address space are then accepted
        (_compiler drops those diagnostics); the executable build has no
        address spaces."""
        by_class: dict[int, list] = {}
        for entry in self.member_spaces:
            by_class.setdefault(entry[1], []).append(entry)
        for entries in by_class.values():
            if not any(q is not None and self.t(q) != "thread" for *_, q in entries):
                continue
            groups: dict[str, list] = {}
            for entry in entries:
                _, _, start, brace, q = entry
                key = " ".join(self.t(k) for k in range(start, brace) if k != q and self.t(k) != "thread")
                # A constructor's member initialisers are not its signature.
                key = key.split(" ) : ")[0] if " ) : " in key else key
                groups.setdefault(key, []).append(entry)
            for group in groups.values():
                keep = next((e for e in group if e[4] is None or self.t(e[4]) == "thread"), group[0])
                for e in group:
                    _, class_open, start, brace, q = e
                    name = self._class_name_before(class_open)
                    if name:
                        self.address_space_classes.add(name)
                    if e is keep:
                        if q is not None and self.t(q) != "thread":
                            self._drop_edits(self.toks[q].start, self.toks[q].end)
                            self.blank(q, q + 1)
                    else:
                        end = self.match(brace, "{", "}")
                        a, b = self.toks[start].start, self.toks[end].end
                        self._drop_edits(a, b)
                        self.edits.append((a, b, _whitespace_like(self.text[a:b])))

    def _copies_from_address_spaces(self, open_: int, name: str):
        """Copy constructors and assignments from every address space for
        the class `name` whose body opens at token `open_` (mx_metal.h's
        __MX_COPIES: check mode only), where the class leaves them to the
        compiler; and the default constructor that declaring them would
        take away, where the class declares no constructor."""
        close = self.match(open_, "{", "}")
        ctor = copy_ctor = assign = False
        depth = 0
        for k in range(open_ + 1, close):
            s = self.t(k)
            if s in ("(", "[", "{"):
                depth += 1
            elif s in (")", "]", "}"):
                depth -= 1
            elif depth > 0:
                continue
            elif s == name and self.t(k + 1) == "(" and self.t(k - 1) not in (".", "->", "::", "~", "=", ",", "return"):
                ctor = True
                copy_ctor = copy_ctor or self._names_own_reference(k + 1, self.match(k + 1, "(", ")"), name)
            elif s == "operator" and self.t(k + 1) == "=":
                assign = True
        parts = []
        if not ctor:
            parts.append(f"__MX_DEFAULT_CONSTRUCTOR({name})")
        if not copy_ctor:
            parts.append(f"__MX_COPY_CONSTRUCTORS({name})")
        if not assign:
            parts.append(f"__MX_COPY_ASSIGNMENTS({name})")
        if parts:
            self.insert(self.toks[close].start, " public: " + " ".join(parts) + " ")

    def _names_own_reference(self, open_: int, close: int, name: str) -> bool:
        """Whether the parameter list between tokens open_ and close has a
        reference to the class `name` (`const thread C& o`, `C<T>&&`): a copy
        or move constructor of the class's own."""
        for k in range(open_ + 1, close):
            if self.t(k) != name:
                continue
            after = self.match(k + 1, "<", ">") + 1 if self.t(k + 1) == "<" else k + 1
            if self.t(after) in ("&", "&&"):
                return True
        return False

    def _class_name_before(self, class_open: int) -> str:
        k = class_open - 1
        while k >= 0 and self.t(k) not in (";", "{", "}"):
            k -= 1
        return self._class_name(k + 1, class_open) if class_open >= 0 else ""

    def _drop_edits(self, a: int, b: int):
        self.edits = [e for e in self.edits if not (a <= e[0] and e[1] <= b)]

    def _string_argument(self, i: int):
        """A string literal passed to a function is in the constant address
        space in Metal (MLX passes its logger's names so, to a
        `constant char*` parameter); in C++ it is not, so it is cast."""
        if self.t(i - 1) not in ("(", ",") or self.t(i + 1) not in (")", ","):
            return
        depth = 0
        for k in range(i - 1, -1, -1):
            t = self.t(k)
            if t == ")":
                depth += 1
            elif t == "(":
                if depth == 0:
                    if self.t(k - 1) in ("static_assert", "__attribute__", "asm", "_Pragma"):
                        return
                    break
                depth -= 1
        self.insert(self.toks[i].start, "((constant char*)")
        self.insert(self.toks[i].end, ")")

    def _array_parameter(self, ptoks: list[int]):
        """`constant const int64_t strides[3]`: an array parameter is a
        pointer into its address space (C++ would put the parameter itself
        there); written as one: `constant const int64_t* strides`."""
        words = [self.t(k) for k in ptoks]
        if not set(words) & {"device", "constant", "threadgroup"} or "*" in words or "(" in words:
            return
        k = next((n for n, w in enumerate(words) if w == "["), None)
        if k is None or k == 0 or self.toks[ptoks[k - 1]].kind != "ident" or self.attribute_at(ptoks[k]):
            return
        close = self.match(ptoks[k], "[", "]")
        if close != ptoks[-1]:
            return  # more dimensions: a pointer to arrays, left as written
        self.insert(self.toks[ptoks[k - 1]].start, "*")
        self._drop_edits(self.toks[ptoks[k]].start, self.toks[close].end)
        self.blank(ptoks[k], close + 1)

    def _metal_array_parameter(self, ptoks: list[int], param: Param, brace: int, end: int):
        """`constant metal::array<float, 2>& ab` indexed as `ab[0]` (PyTorch's
        Gemv.h): Apple's array has an operator[] for each address space of
        `this` (`const constant T& operator[](size_t) const constant`, the
        form of MSL 1.4.1's overloading on address spaces), which C++ cannot
        declare. In the body, `ab[i]` becomes `ab.__elems[i]`, the element
        in the parameter's address space, as Apple's operator returns it."""
        if param.address_space not in ("device", "constant", "threadgroup") or not param.is_reference \
                or param.is_pointer:
            return
        if not any(self.t(k) == "array" and self.t(k + 1) == "<"
                   and (self.t(k - 1) != "::" or self.t(k - 2) == "metal") for k in ptoks):
            return
        for k in range(brace + 1, end):
            if self.t(k) == param.name and self.t(k + 1) == "[" and self.t(k + 2) != "[" \
                    and self.t(k - 1) not in (".", "->", "::"):
                self.insert(self.toks[k].end, ".__elems")

    def _function_constant(self, start: int, semicolon: int):
        """`constant T name [[function_constant(N)]];`: value-initialised,
        so that check mode compiles it; recorded, so that the executor
        refuses to run it."""
        name = next((self.t(k) for k in range(start, semicolon)
                     if self.toks[k].kind == "ident" and self.t(k + 1) == "[" and self.t(k + 2) == "["), "?")
        self.insert(self.toks[semicolon].start, "{}")
        self.function_constants.append((self.line(self.toks[start].start), name))

    def _classify_brace(self, start: int, i: int) -> str:
        if self.t(start) == "template" and self.t(start + 1) == "<":
            # Default template arguments (`int N = 4`) are no initializer.
            try:
                start = min(self.match(start + 1, "<", ">") + 1, i)
            except TranslateError:
                pass
        words = [t.text for t in self.toks[start:i]]
        if not words:
            return "init"
        if words[0] == "namespace" or (words[0] == "extern" and len(words) == 2 and words[1].startswith('"')):
            return "ns"
        if words[0] == "inline" and len(words) > 1 and words[1] == "namespace":
            return "ns"
        depth = 0
        saw_paren = saw_eq = False
        for w in words:
            if w == "(":
                if depth == 0:
                    saw_paren = True
                depth += 1
            elif w == ")":
                depth -= 1
            elif w == "=" and depth == 0:
                saw_eq = True
            elif w in ("struct", "class", "union", "enum") and depth == 0 and not saw_paren:
                return "class" if w != "enum" else "init"
        if saw_eq:
            return "init"
        return "func" if saw_paren else "init"

    def _class_name(self, start: int, i: int) -> str:
        """The name of the class whose definition starts at `start` and
        opens at `i` (`template <class T> struct alignas(16) V`: V; `struct
        A::B`: B; a specialisation `S<float>`: S), "" for an anonymous one."""
        k = start
        try:
            if self.t(k) == "template" and self.t(k + 1) == "<":
                k = self.match(k + 1, "<", ">") + 1  # `class T` there is a template parameter
            while k < i and self.t(k) not in ("struct", "class", "union"):
                k += 1
            k += 1
            while k < i:
                attr = self.attribute_at(k)
                if attr:
                    k = attr[0]
                elif self.t(k) in ("alignas", "__attribute__", "__declspec") and self.t(k + 1) == "(":
                    k = self.match(k + 1, "(", ")") + 1
                else:
                    break
        except TranslateError:
            return ""
        name = ""
        while k < i and self.toks[k].kind == "ident":
            name = self.t(k)
            if self.t(k + 1) != "::":
                break
            k += 2
        return name

    def _qualifier(self, k: int) -> str:
        """The class or namespace named before `::` ending at token k - 1
        (`C::f`, `C<T>::f`), "" if the name at k is unqualified."""
        if self.t(k - 1) != "::":
            return ""
        j = k - 2
        if self.t(j) in (">", ">>"):
            depth = 0
            while j > 0:
                depth += {">": 1, ">>": 2, "<": -1}.get(self.t(j), 0)
                if depth <= 0:
                    break
                j -= 1
            j -= 1
        return self.t(j) if j >= 0 and self.toks[j].kind == "ident" else "::"

    def _namespace_name(self, start: int, i: int):
        words = [t.text for t in self.toks[start:i]]
        if words and words[0] in ("namespace", "inline"):
            names = [w for w in words if w not in ("namespace", "inline")]
            return "::".join(n for n in names if n != "::") or ""  # "" = anonymous
        return None

    # -------------------------------------------------------- local rewrites --
    def _rewrite_number(self, i: int):
        s = self.t(i)
        low = s.lower()
        if low.startswith("0x"):
            is_float = "p" in low
            body = low
        else:
            is_float = "." in s or "e" in low
            body = low
        if not is_float:
            return
        if body.endswith("h"):
            self.replace(i, s[:-1] + "f16")
        elif body.endswith("bf"):
            self.replace(i, f"((bfloat){s[:-2]}f)")
        elif not body.endswith("f"):
            self.replace(i, s + "f")

    def _rewrite_vector_constructor(self, i: int) -> bool:
        """`float4(...)`, `vec<float, 4>(...)` and `static_cast<float4>(...)`
        become `__mx_make<float4>(__mx::site(), ...)`: the site names the
        line if a conversion in it fails (mx_metal.h). `vec<bool, N>` becomes
        boolN, Metal's bool vector (a class in mx_metal.h)."""
        s, prev = self.t(i), self.t(i - 1)
        if prev in ("operator", ".", "->", "struct", "class", "typedef"):
            return False
        if s in VECTOR_TYPES and self.t(i + 1) == "(":
            self.replace(i, f"__mx_make<{s}>")
            self._insert_site(i + 1)
            return True
        if s in self.type_names and self.t(i + 1) == "(" and self.t(i + 2) not in (")", "*", "&", "^") \
                and prev not in ("::", "~", "typename", "template"):
            # `complex_T(x, y)` with complex_T = float2, or T(a, b) with T a
            # vector: __mx_construct builds vectors as Metal does, any other
            # type with the same arguments.
            self.replace(i, f"__mx_construct<{s}>")
            self._insert_site(i + 1)
            return True
        if s == "vec" and self.t(i + 1) == "<":
            close = self.match(i + 1, "<", ">")
            if self.t(i + 2) == "bool" and self.t(i + 3) == "," and close == i + 5 and self.t(i + 4) in ("2", "3", "4"):
                name = f"bool{self.t(i + 4)}"
                self.blank(i, close + 1)
                if self.t(close + 1) == "(":
                    self.insert(self.toks[i].start, f"__mx_make<{name}>")
                    self._insert_site(close + 1)
                else:
                    self.insert(self.toks[i].start, name)
                return False
            if self.t(close + 1) == "(" and self.t(close) == ">":
                self.insert(self.toks[i].start, "__mx_make<")
                self.insert(self.toks[close].end, ">")
                self._insert_site(close + 1)
            return False
        if s == "static_cast" and self.t(i + 1) == "<" and self.t(i + 3) == ">" and self.t(i + 2) in VECTOR_TYPES:
            self.blank(i, i + 4)
            self.insert(self.toks[i].start, f"__mx_make<{self.t(i + 2)}>")
            if self.t(i + 4) == "(":
                self._insert_site(i + 4)
            return False
        if s == "static_cast" and self.t(i + 1) == "<":
            # static_cast<bfloat>(h) of a half (MLX's fp8.h), or of a T that
            # is one: the operand goes through __mx::cast_operand (mx_metal.h).
            # Only for a target named by identifiers alone (T, bfloat16_t,
            # typename Op::T): pointers and references are no such pair.
            close = self.match(i + 1, "<", ">")
            if self.t(close + 1) == "(" and all(
                    self.toks[k].kind == "ident" or self.t(k) == "::" for k in range(i + 2, close)):
                target = self.text[self.toks[i + 2].start : self.toks[close - 1].end]
                end = self.match(close + 1, "(", ")")
                self.insert(self.toks[close + 1].end, f"__mx::cast_operand<{target}>((")
                self.insert(self.toks[end].start, "))")
        return False

    def _insert_site(self, paren: int):
        """After the '(' at token `paren`: the site argument of __mx_make."""
        site = "__mx::site(nullptr, 0, 0)" if any(a < paren < b for a, b in self.unevaluated) else "__mx::site()"
        self.insert(self.toks[paren].end, site if self.t(paren + 1) == ")" else f"{site}, ")

    # ------------------------------------------------- threadgroup variables --
    def _threadgroup_declaration(self, i: int):
        """`threadgroup T a[N], b;` in a function -> references to engine storage."""
        j, depth, brackets = i + 1, 0, _Brackets()
        while j < len(self.toks) and not (self.t(j) == ";" and depth == 0):
            s = self.t(j)
            if depth == 0 and s in ("*", "&", "&&"):
                return None  # a pointer or reference into threadgroup memory
            if depth == 0 and s == "=":
                self.problem(self.toks[i].start, "a threadgroup variable cannot have an initializer")
                return None
            depth = brackets.step(s)
            j += 1
        if j == len(self.toks):
            self.problem(self.toks[i].start, "cannot parse this threadgroup declaration (no ';' ends it)")
            return None
        parts = self._split_top_level(i + 1, j)  # one per declarator
        first = parts[0]
        # The first declarator's name: the last identifier at depth 0 before any '['.
        depth, name_at, brackets = 0, None, _Brackets()
        for k in first:
            s = self.t(k)
            if s == "[" and depth == 0:
                break
            if depth == 0 and self.toks[k].kind == "ident":
                name_at = k
            depth = brackets.step(s)
        if name_at is None or name_at == first[0]:
            self.problem(self.toks[i].start, "cannot parse this threadgroup declaration")
            return None
        type_text = self.text[self.toks[first[0]].start : self.toks[name_at - 1].end]
        declarators = [(name_at, first[first.index(name_at) :])] + [(p[0], p) for p in parts[1:]]
        pieces = []
        for name_tok, toks in declarators:
            name = self.t(name_tok)
            dims = "".join(self.t(k) for k in toks[1:])
            self.tg_counter += 1
            key = f"__mx_tg_key_{self.tg_counter}"
            # The key's address tells declarations apart (one per template
            # instantiation, being a static local); its text names the
            # variable in the engine's messages.
            pieces.append(
                f'static const char {key}[] = "{name}"; '
                f"threadgroup {type_text} (&{name}){dims} = "
                f"*(threadgroup {type_text} (*){dims})__mx_threadgroup_variable("
                f"{key}, sizeof({type_text}{dims}), alignof({type_text}{dims}));"
            )
        start, end = self.toks[i].start, self.toks[j].end
        newlines = self.text.count("\n", start, end)
        self.edits.append((start, end, " ".join(pieces) + "\n" * newlines))
        return j + 1

    # ----------------------------------------------------------- kernels --
    def _split_top_level(self, a: int, b: int) -> list[list[int]]:
        """Token indices of toks[a:b] split at commas outside brackets."""
        parts, cur, depth, brackets = [], [], 0, _Brackets()
        for k in range(a, b):
            s = self.t(k)
            if s == "," and depth == 0:
                parts.append(cur)
                cur = []
                continue
            depth = brackets.step(s)
            cur.append(k)
        if cur:
            parts.append(cur)
        return parts

    _NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "static_assert",
                  "__attribute__", "catch", "noexcept"}

    def _signature(self, start: int, brace: int):
        """(name token index, '(' index, ')' index) of a function definition."""
        k = start
        if self.t(k) == "template":
            k = self.match(k + 1, "<", ">") + 1
        j = k
        operator = None
        while j < brace:
            if self.t(j) == "__attribute__":
                j = self.match(j + 1, "(", ")") + 1
                continue
            attr = self.attribute_at(j)  # [[max_total_threads_per_threadgroup(N)]]
            if attr:
                j = attr[0]
                continue
            if self.t(j) == "operator":  # `operator()(`, `operator-(`, `operator vec<T, 2>(`
                operator = j
                j += 3 if self.t(j + 1) == "(" and self.t(j + 2) == ")" else 1
                continue
            if self.t(j) == "(":
                break
            j += 1
        if j >= brace:
            return None
        if operator is not None:
            return operator, j, self.match(j, "(", ")")
        if self.toks[j - 1].kind != "ident":
            return None
        return j - 1, j, self.match(j, "(", ")")

    def _function_definition(self, start: int, brace: int, is_kernel: bool):
        sig = self._signature(start, brace)
        if not sig:
            return
        name_at, open_, close = sig
        end = self.match(brace, "{", "}")
        calls = {
            (self._qualifier(k), self.t(k)) for k in range(brace + 1, end)
            if self.toks[k].kind == "ident" and self.t(k + 1) == "(" and self.t(k) not in self._NOT_CALLS
            and self.t(k - 1) not in (".", "->")
        }
        method_calls = {self.t(k) for k in range(brace + 1, end)
                        if self.toks[k].kind == "ident" and self.t(k + 1) == "(" and self.t(k - 1) in (".", "->")}
        file, line = self.where(self.toks[start].start)
        ptoks = self._split_top_level(open_ + 1, close)
        params = [self._param(p, self.t(name_at)) for p in ptoks]
        for p, param in zip(ptoks, params):
            self._array_parameter(p)
            self._metal_array_parameter(p, param, brace, end)
        if is_kernel:
            _assign_buffer_indices(params)
        # A member function: defined in its class, or out of it as `C::f`.
        scope = getattr(self, "_scopes", [("ns", None)])[-1]
        owner = self._qualifier(name_at) or (scope[1] or "" if scope[0] == "class" else "")
        self.functions.append(Function(self.t(name_at), file, line, is_kernel, params, calls, owner, method_calls))

    def _kernel_definition(self, start: int, brace: int, scopes, attrs):
        sig = self._signature(start, brace)
        if not sig:
            self.problem(self.toks[start].start, "cannot find this kernel's name")
            return
        name_at, open_, close = sig
        name = self.t(name_at)
        is_template = self.t(start) == "template"
        params = [self._param(p, name) for p in self._split_top_level(open_ + 1, close)]
        _assign_buffer_indices(params)
        namespace = tuple(n for kind, n in scopes if kind == "ns" and n)
        max_threads = "0"
        for aname, arg in attrs:
            if aname == "max_total_threads_per_threadgroup":
                max_threads = arg
        line = self.line(self.toks[start].start)
        key = (namespace, name)
        prev = self.kernel_defs.get(key)
        if prev is not None:
            # Kernel templates may overload one name (MLX's block_masked_gemm):
            # C++ picks one per instantiation, and the entry point binds the
            # same buffers whichever it is, if their parameters agree.
            if not (is_template and prev.is_template):
                self.problem(self.toks[start].start, f"kernel '{name}' is defined twice")
            elif _binding(prev.params) != _binding(params) or prev.max_threads != max_threads:
                self.problem(self.toks[start].start,
                             f"kernel templates named '{name}' with different parameters or attributes: the executor "
                             f"binds one parameter list per kernel name (give them different names)")
            return
        tparams = self._template_params(start) if is_template else []
        self.kernel_defs[key] = _KernelDef(name, namespace, is_template, params, max_threads, line, tparams)
        if not is_template:
            self.kernels.append(Kernel(name, _qualified(namespace, name), params, max_threads, line))

    def _template_params(self, start: int) -> list:
        """(is a type, name, default) of `template <...>` at `start`."""
        close = self.match(start + 1, "<", ">")
        out = []
        for part in self._split_top_level(start + 2, close):
            words = [self.t(k) for k in part]
            eq = words.index("=") if "=" in words else len(words)
            names = [k for k in part[:eq] if self.toks[k].kind == "ident"]
            if not names or "template" in words[:eq] or "..." in words:
                return []  # template template or variadic parameters: not substituted
            default = self.text[self.toks[part[eq + 1]].start : self.toks[part[-1]].end] if eq < len(words) - 1 else ""
            out.append((words[0] in ("typename", "class"), self.t(names[-1]), default))
        return out

    def _instantiated_expression(self, kdef: "_KernelDef", name_at: int, close: int, expr: str) -> str:
        """`expr` (max_total_threads_per_threadgroup(WM * WN * 32)) with the
        template's parameters bound to this instantiation's arguments."""
        args = [self.text[self.toks[p[0]].start : self.toks[p[-1]].end]
                for p in self._split_top_level(name_at + 2, close)]
        if not kdef.template_params or len(args) > len(kdef.template_params):
            return expr
        binds = []
        for k, (is_type, pname, default) in enumerate(kdef.template_params):
            value = args[k] if k < len(args) else default
            if not value:
                return expr
            binds.append(f"using {pname} = {value};" if is_type else f"constexpr auto {pname} = {value};")
        return "[] { " + " ".join(binds) + f" return ({expr}); }}()"

    def _param(self, ptoks: list[int], kernel: str) -> Param:
        attr_name, attr_arg, plain = "", "", []
        k = 0
        while k < len(ptoks):
            a = self.attribute_at(ptoks[k])
            if a:
                end, items = a
                for n, arg in items:
                    if n not in _STANDARD_ATTRIBUTES:
                        attr_name, attr_arg = n, arg
                while k < len(ptoks) and ptoks[k] < end:
                    k += 1
                continue
            plain.append(ptoks[k])
            k += 1
        words = [self.t(k) for k in plain]
        idents = [k for k in plain if self.toks[k].kind == "ident"]
        name = self.t(idents[-1]) if idents else "?"
        space = next((w for w in words if w in ("device", "constant", "threadgroup", "thread")), "")
        line = self.line(self.toks[ptoks[0]].start) if ptoks else 0
        # `T (*op)(T, T)`: a function pointer, no pointer into an address space.
        pointer = "*" in words and "(" not in words
        return Param(name, attr_name, attr_arg, space, "&" in words, line, pointer, "[" in words)

    def _explicit_instantiation(self, i: int, scopes) -> int:
        j = i
        depth = 0
        while j < len(self.toks) and not (self.t(j) == ";" and depth == 0):
            s = self.t(j)
            if s in ("(", "{"):
                depth += 1
            elif s in (")", "}"):
                depth -= 1
            j += 1
        host_name = None
        for k in range(i, j):
            a = self.attribute_at(k)
            if a:
                for n, arg in a[1]:
                    if n == "host_name":
                        # Adjacent literals concatenate (PyTorch's Sort.metal builds
                        # names with `"sort_block_" #T "_tptg" #TPTG`).
                        host_name = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', arg)) or arg.strip()
        # The template-id: last `name<...>` at depth 0 followed by '(' or ';'.
        callee, depth, k = None, 0, i + 1
        while k < j:
            s = self.t(k)
            if s == "(":
                depth += 1
            elif s == ")":
                depth -= 1
            elif depth == 0 and self.toks[k].kind == "ident" and self.t(k + 1) == "<" and s != "template":
                close = self.match(k + 1, "<", ">")
                if self.t(close + 1) in ("(", ";"):
                    qual_start = k
                    while self.t(qual_start - 1) == "::" and self.toks[qual_start - 2].kind == "ident":
                        qual_start -= 2
                    callee = (qual_start, k, close)
                k = close
            k += 1
        self.blank(i, j + 1)
        if host_name is None:
            return j + 1  # an ordinary explicit instantiation of a helper
        if callee is None:
            self.problem(self.toks[i].start, f"cannot find the template instantiated as '{host_name}'")
            return j + 1
        qual_start, name_at, close = callee
        name = self.t(name_at)
        qualifier = self.text[self.toks[qual_start].start : self.toks[name_at].start].replace(" ", "")
        template_args = self.text[self.toks[name_at + 1].start : self.toks[close].end]
        namespace = tuple(n for kind, n in scopes if kind == "ns" and n)
        lookup = namespace + tuple(q for q in qualifier.split("::") if q)
        kdef = self.kernel_defs.get((lookup, name)) or self.kernel_defs.get((namespace, name))
        if kdef is None:
            kdef = next((d for (ns, n), d in self.kernel_defs.items() if n == name), None)
        if kdef is None:
            self.problem(
                self.toks[i].start, f"'{host_name}' instantiates '{name}', which is not a kernel defined before it"
            )
            return j + 1
        callee_text = _qualified(kdef.namespace, name) + template_args
        max_threads = kdef.max_threads
        if kdef.is_template and max_threads != "0":
            max_threads = self._instantiated_expression(kdef, name_at, close, max_threads)
        self.kernels.append(Kernel(host_name, callee_text, kdef.params, max_threads, self.line(self.toks[i].start)))
        return j + 1


def _binding(params: list[Param]) -> list[tuple]:
    """What an entry point makes of a kernel's parameters (not where they are)."""
    return [
        (p.name, p.attribute, p.argument, p.address_space, p.is_reference, p.is_pointer, p.is_array) for p in params
    ]


def _assign_buffer_indices(params: list[Param]):
    """A device or constant pointer or reference parameter of a kernel
    without an attribute is a buffer at the lowest index no other buffer
    takes, in declaration order, as Apple's compiler assigns it (MLX's
    arange and hadamard kernels bind theirs so: `constant const T& start`
    is buffer 0 of arange, `constant const float& scale` after
    [[buffer(0)]] and [[buffer(1)]] is buffer 2 of hadamard)."""
    taken = set()
    for p in params:
        if p.attribute == "buffer":
            try:
                taken.add(int(p.argument.rstrip("uU"), 0))
            except ValueError:
                return  # an index computed at compile time: leave the others to the lint
    n = 0
    for p in params:
        if (
            not p.attribute
            and p.address_space in ("device", "constant")
            and (p.is_pointer or p.is_reference or p.is_array)
        ):
            while n in taken:
                n += 1
            p.attribute, p.argument = "buffer", str(n)
            taken.add(n)


class _Brackets:
    """Bracket depth while scanning a declaration's tokens. (), [] and {}
    always nest; '<' and '>' nest only outside () and [], where they are
    template brackets (inside they are comparisons, as in `buf[N > 4 ? 8 :
    4]`)."""

    def __init__(self):
        self.open: list[str] = []

    def step(self, token: str) -> int:
        """The depth after `token`."""
        if token in ("(", "[", "{"):
            self.open.append(token)
        elif token in (")", "]", "}"):
            while self.open and self.open.pop() == "<":
                pass  # a '<' left open inside was a comparison
        elif token == "<" and not any(b in "([" for b in self.open):
            self.open.append(token)
        elif token in (">", ">>"):
            for _ in range(len(token)):
                if self.open and self.open[-1] == "<":
                    self.open.pop()
        return len(self.open)


def _qualified(namespace: tuple[str, ...], name: str) -> str:
    # Fully qualified from the global namespace, so that a kernel named like
    # a Metal function (`divide`) is not ambiguous under `using namespace metal`.
    return "::" + "::".join(namespace + (name,))


def _whitespace_like(s: str) -> str:
    return "".join(c if c == "\n" else " " for c in s)


def translate(preprocessed: str) -> Translation:
    """Rewrite preprocessed MSL into C++ and find its kernels."""
    tr = _Translator(preprocessed)
    translation = tr.run()
    names = [k.host_name for k in translation.kernels]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        translation.problems.append((0, f"kernel names used twice: {', '.join(sorted(dup))}"))
    return translation


def entry_points(kernels: list[Kernel]) -> tuple[str, list[tuple[int, str]]]:
    """C++ for the entry points and the kernel table of mx_abi.h.

    Returns the code and a list of problems (kernel parameters the executor
    cannot bind).
    """
    problems = []
    out = [
        "namespace __mx_gen {",
        "template <class F> struct fn;",
        "template <class R, class... A> struct fn<R (*)(A...)> {",
        "  template <int I> using arg = __type_pack_element<I, A...>;",
        "};",
        "template <class F, int I> using arg_t = typename fn<F>::template arg<I>;",
        "template <class P> inline P buffer_arg(void* p) {",
        "  if constexpr (__is_reference(P)) return *(typename __mx::remove_ref<P>::type*)p;",
        "  else return (P)p;",
        "}",
        "template <class P> inline P builtin_arg(mx_uint3 v) {",
        "  typedef typename __mx::remove_cv<P>::type T;",
        "  typedef typename __mx::vt<T>::elem E;",
        "  if constexpr (__mx::vt<T>::n == 1) return (T)v.x;",
        "  else if constexpr (__mx::vt<T>::n == 2) return T{(E)v.x, (E)v.y};",
        "  else return T{(E)v.x, (E)v.y, (E)v.z};",
        "}",
        "template <class P> inline P builtin_arg(mx_u32 v) { return (P)v; }",
        "template <class T> constexpr mx_u64 size_of() { if constexpr (__is_void(T)) return 1; else return sizeof(T); }",  # noqa: E501
        "template <class P> constexpr mx_u64 pointee_size() {",
        "  if constexpr (__is_reference(P)) return size_of<typename __mx::remove_ref<P>::type>();",
        "  else return size_of<typename __mx::remove_ptr<P>::type>();",
        "}",
        "template <class P> constexpr bool pointee_const() {",
        "  typedef typename __mx::remove_ptr<typename __mx::remove_ref<P>::type>::type T;",
        "  return __is_const(T);",
        "}",
        "template <class P> constexpr mx_u32 param_flags(bool constant_space) {",
        "  return (__is_reference(P) ? MX_PARAM_REFERENCE : 0u) |",
        "         ((constant_space || pointee_const<P>()) ? MX_PARAM_READONLY : 0u);",
        "}",
        "}  // namespace __mx_gen",
        "",
    ]
    spaces = {"device": "MX_AS_DEVICE", "constant": "MX_AS_CONSTANT", "threadgroup": "MX_AS_THREADGROUP"}
    table = []
    for n, k in enumerate(kernels):
        f = f"decltype(&{k.callee})"
        args, descs = [], []
        for i, p in enumerate(k.params):
            pt = f"__mx_gen::arg_t<{f}, {i}>"
            where = f"kernel '{k.host_name}' parameter '{p.name}' (line {p.line})"
            if p.attribute == "buffer":
                args.append(f"__mx_gen::buffer_arg<{pt}>(t->buffers[{p.argument}])")
                flags = f"__mx_gen::param_flags<{pt}>({'true' if p.address_space == 'constant' else 'false'})"
                descs.append(
                    f'{{"{p.name}", MX_PARAM_BUFFER, (mx_u32)({p.argument}), {spaces.get(p.address_space, "MX_AS_NONE")}, '  # noqa: E501
                    f"{flags}, __mx_gen::pointee_size<{pt}>()}}"
                )
                if p.address_space not in ("device", "constant"):
                    problems.append((p.line, f"{where}: a buffer parameter needs the device or constant address space"))
            elif p.attribute == "threadgroup":
                args.append(f"({pt})t->tg_buffers[{p.argument}]")
                descs.append(
                    f'{{"{p.name}", MX_PARAM_THREADGROUP, (mx_u32)({p.argument}), MX_AS_THREADGROUP, 0u, '
                    f"__mx_gen::pointee_size<{pt}>()}}"
                )
                if p.address_space != "threadgroup":
                    problems.append(
                        (p.line, f"{where}: a [[threadgroup]] parameter needs the threadgroup address space")
                    )
            elif p.attribute in BUILTINS:
                args.append(f"__mx_gen::builtin_arg<{pt}>({BUILTINS[p.attribute]})")
                descs.append(f'{{"{p.name}", MX_PARAM_BUILTIN, 0u, MX_AS_NONE, 0u, 0u}}')
            elif not p.attribute:
                problems.append((p.line, f"{where} has no attribute ([[buffer(i)]], [[threadgroup(i)]] or a builtin)"))
            else:
                problems.append(
                    (p.line, f"{where}: attribute [[{p.attribute}]] is not supported by the CPU Metal executor")
                )
        out.append(f'extern "C" void __mx_entry_{n}(const mx_thread_info* t) {{')
        out.append(f"  {k.callee}({', '.join(args)});")
        out.append("}")
        if descs:
            out.append(f"static const mx_param __mx_params_{n}[] = {{{', '.join(descs)}}};")
            params = f"__mx_params_{n}"
        else:
            params = "nullptr"
        table.append(f'{{"{k.host_name}", &__mx_entry_{n}, {params}, {len(k.params)}u, (mx_u32)({k.max_threads})}}')
    if table:
        out.append("static const mx_kernel __mx_kernels[] = {" + ", ".join(table) + "};")
        kernels_expr = "__mx_kernels"
    else:
        kernels_expr = "nullptr"
    out += [
        f'extern "C" const mx_kernel* mx_library_kernels(mx_u32* n) {{ *n = {len(table)}u; return {kernels_expr}; }}',
        'extern "C" mx_u32 mx_library_abi(void) { return MX_ABI_VERSION; }',
        'extern "C" { const mx_engine_api* __mx_api; }',
        'extern "C" void mx_library_bind(const mx_engine_api* api) { __mx_api = api; }',
        "",
    ]
    return "\n".join(out), problems
