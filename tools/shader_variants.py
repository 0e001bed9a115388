"""The explicit instantiations of a flattened shader library, so that the Mac
backend can compile one kernel variant at a time (issue 32, point 7).

Metal compiles a template only where it is instantiated: a library's source
with every `template [[host_name("k")]] kernel ...;` but one removed holds
the same code and defines that one function, and costs a fraction of the
whole library's compile (`linear` has some 75 variants).

`sites(text)` finds every place of `text` (a flattened library,
tools/embed_shaders.py) that instantiates kernels: an explicit instantiation
statement, or a call of a macro that expands to some. For each it gives the
statements it expands to, with their host names. The expansion is the C
preprocessor's for what these macros use (function-like macros, `#param`,
`__VA_ARGS__`, nested calls, adjacent string literals); anything else in an
instantiation macro (`##`, conditionals) is refused, so the table never
disagrees silently with Metal's own preprocessor. tests/test_shader_variants.py
checks the host names against the executor's preprocessor (clang -E).

The C++ side (csrc/backend/launch.cpp, variant_source) blanks every site but
the one that holds the variant, which it replaces by that statement alone,
keeping newlines so that compiler messages keep their lines.
"""

from __future__ import annotations

import dataclasses
import re

_TOKEN = re.compile(
    r"""(?P<ws>[ \t\r\f\v]+|\\\n)|(?P<nl>\n)|(?P<comment>//[^\n]*|/\*.*?\*/)|(?P<string>"(?:[^"\\\n]|\\.)*")"""
    r"""|(?P<char>'(?:[^'\\\n]|\\.)*')|(?P<ident>[A-Za-z_]\w*)|(?P<number>\.?\d(?:[\w.]|[eEpP][+-])*)"""
    r"""|(?P<punct>\#\#|\.\.\.|::|->|\[\[|\]\]|[^\s])""",
    re.S,
)


@dataclasses.dataclass
class Tok:
    kind: str
    text: str
    start: int
    end: int


@dataclasses.dataclass
class Site:
    """Characters [start, end) of the library instantiate `kernels`: host name -> statement."""

    start: int
    end: int
    kernels: dict[str, str]


@dataclasses.dataclass
class _Macro:
    params: list[str] | None  # None: object-like, kept as it is (host names never use one)
    variadic: bool
    body: list[Tok]


class VariantError(ValueError):
    """An instantiation the splitter cannot expand exactly."""


def _tokens(text: str) -> list[Tok]:
    out = []
    for m in _TOKEN.finditer(text):
        out.append(Tok(m.lastgroup, m.group(), m.start(), m.end()))
    return out


def _lines(toks: list[Tok]):
    """Logical lines (continuations joined), as lists of the tokens that are not blank or comments."""
    line: list[Tok] = []
    for t in toks:
        if t.kind == "nl":
            yield line
            line = []
        elif t.kind not in ("ws", "comment"):
            line.append(t)
    yield line


def _define(line: list[Tok], macros: dict[str, _Macro]):
    # `#define NAME(` is function-like only with no space before the paren.
    if len(line) < 3 or line[1].text != "define" or line[2].kind != "ident":
        return
    name, rest = line[2].text, line[3:]
    if not rest or rest[0].text != "(" or rest[0].start != line[2].end:
        macros[name] = _Macro(None, False, rest)
        return
    close = next(i for i, t in enumerate(rest) if t.text == ")")
    params = [t.text for t in rest[1:close] if t.text != ","]
    variadic = bool(params) and params[-1] == "..."
    macros[name] = _Macro(params[:-1] if variadic else params, variadic, rest[close + 1 :])


def _arguments(toks: list[Tok], open_: int) -> tuple[list[list[Tok]], int]:
    """The arguments of the call whose '(' is toks[open_], and the index after its ')'."""
    args: list[list[Tok]] = [[]]
    depth = 0
    for i in range(open_ + 1, len(toks)):
        t = toks[i].text
        if t in "([{" and toks[i].kind == "punct":
            depth += 1
        elif t in ")]}" and toks[i].kind == "punct":
            if depth == 0:
                return args, i + 1
            depth -= 1
        elif t == "," and depth == 0:
            args.append([])
            continue
        args[-1].append(toks[i])
    raise VariantError("a macro call has no closing parenthesis")


class _Expander:
    def __init__(self, macros: dict[str, _Macro]):
        self.macros = macros
        self.instantiating = {n for n in macros if self._instantiates(n, set())}

    def _instantiates(self, name: str, seen: set[str]) -> bool:
        m = self.macros[name]
        if m.params is None or name in seen:
            return False
        seen.add(name)
        return any(t.text == "host_name" or (t.text in self.macros and self._instantiates(t.text, seen))
                   for t in m.body)

    def expand(self, toks: list[Tok], disabled: frozenset[str] = frozenset()) -> list[Tok]:
        """`toks` with every call of an instantiating macro expanded (rescanned as cpp does)."""
        out: list[Tok] = []
        i = 0
        while i < len(toks):
            t = toks[i]
            if (t.text in self.instantiating and t.text not in disabled and i + 1 < len(toks)
                    and toks[i + 1].text == "("):
                args, i = _arguments(toks, i + 1)
                out += self.expand(self._substitute(t.text, args), disabled | {t.text})
                continue
            out.append(t)
            i += 1
        return out

    def _substitute(self, name: str, args: list[list[Tok]]) -> list[Tok]:
        m = self.macros[name]
        if args == [[]] and not m.params:
            args = []
        named = dict(zip(m.params, args))
        if len(args) < len(m.params) or (len(args) > len(m.params) and not m.variadic):
            raise VariantError(f"{name} takes {len(m.params)} arguments, called with {len(args)}")
        if m.variadic:
            rest: list[Tok] = []
            for k, a in enumerate(args[len(m.params) :]):
                rest += ([Tok("punct", ",", 0, 0)] if k else []) + a
            named["__VA_ARGS__"] = rest
        out: list[Tok] = []
        body = m.body
        i = 0
        while i < len(body):
            t = body[i]
            if t.text == "##":
                raise VariantError(f"{name} pastes tokens (##), which the variant splitter does not expand")
            if t.text == "#" and i + 1 < len(body) and body[i + 1].text in named:
                text = " ".join(a.text for a in named[body[i + 1].text])
                out.append(Tok("string", '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"', 0, 0))
                i += 2
                continue
            if t.kind == "ident" and t.text in named:
                # Arguments are expanded before substitution; the rescan does it here.
                out += named[t.text]
            else:
                out.append(t)
            i += 1
        return out


def _statements(toks: list[Tok], where: str) -> dict[str, str]:
    """Host name -> statement text, for the explicit instantiations `toks` expanded to."""
    found: dict[str, str] = {}
    start = 0
    for i, t in enumerate(toks):
        if t.text != ";":
            continue
        stmt = toks[start : i + 1]
        start = i + 1
        texts = [s.text for s in stmt]
        if texts[:4] != ["template", "[[", "host_name", "("]:
            raise VariantError(f"{where}: an instantiation site expands to something other than "
                               f"explicit instantiations: {' '.join(texts[:8])}")
        args, _ = _arguments(stmt, 3)
        if len(args) != 1 or not args[0] or any(a.kind != "string" for a in args[0]):
            raise VariantError(f"{where}: a host_name that is not string literals: {' '.join(texts)}")
        name = "".join(a.text[1:-1] for a in args[0])
        if name in found:
            raise VariantError(f"{where}: host name {name} is instantiated twice")
        found[name] = " ".join(texts)
    if start != len(toks):
        raise VariantError(f"{where}: an instantiation site does not end with ';'")
    return found


def sites(text: str) -> list[Site]:
    """Every place of `text` that instantiates kernels, in order."""
    toks = _tokens(text)
    macros: dict[str, _Macro] = {}
    code: list[Tok] = []  # the tokens outside directives
    for line in _lines(toks):
        if line and line[0].text == "#":
            _define(line, macros)
        else:
            code += line
    expander = _Expander(macros)
    found: list[Site] = []
    seen: set[str] = set()
    i = 0
    while i < len(code):
        t = code[i]
        if t.text == "template" and i + 2 < len(code) and code[i + 1].text == "[[" and code[i + 2].text == "host_name":
            end = next(k for k in range(i, len(code)) if code[k].text == ";") + 1
        elif t.text in expander.instantiating and i + 1 < len(code) and code[i + 1].text == "(":
            _, end = _arguments(code, i + 1)
        else:
            i += 1
            continue
        line = text.count("\n", 0, t.start) + 1
        kernels = _statements(expander.expand(code[i:end]), f"line {line}")
        for name in kernels:
            if name in seen:
                raise VariantError(f"line {line}: host name {name} is instantiated twice")
            seen.add(name)
        found.append(Site(t.start, code[end - 1].end, kernels))
        i = end
    return found
