"""Build a host shared library from Metal Shading Language source.

Pipeline (every step by the same clang, Debian's clang-19 or Apple's):
  1. preprocess the shader, with stand-in <metal_*> headers that are empty,
     so that only the shader's own text comes out (line markers kept);
  2. translate it to C++ (_translate.py) and generate the kernel entry points;
  3. compile that once with Metal's address spaces as clang address spaces,
     syntax only, so that mixing them fails as on a Mac;
  4. compile it with address spaces erased to LLVM IR (front end only, with
     line tables);
  5. optimise that IR once more as a GPU compiler would, for the static
     costs of each kernel (_analysis.py: registers, private memory, loads
     in flight);
  6. instrument the front end's IR (_instrument.py): memory accesses, SIMT
     positions, conversions;
  7. optimise it, count the 64-bit integer work and the divisions that are left
     (_instrument.count_ops), add the table of static costs, and compile
     and link it into a shared object the engine loads.

Results are cached by a hash of everything that goes into them, in
$MPS_EXT_CACHE_DIR or ~/.cache/executor/mps_ext_executor.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import _analysis, _instrument, _lint, _translate

__all__ = [
    "CompileError",
    "Built",
    "MathMode",
    "build",
    "preprocess",
    "check_address_spaces",
    "check_file",
    "check_source",
    "find_clang",
    "cache_dir",
    "math_mode",
    "set_math_mode",
]

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
SCAN_INCLUDE = INCLUDE / "scan"

# What Metal's compiler predefines, as far as shaders look at it.
METAL_MACROS = {"__METAL_VERSION__": "310", "__METAL_MACOS__": "1", "__HAVE_BFLOAT__": "1", "__METAL__": "1"}

_LANGUAGE = ["-x", "c++", "-std=c++17", "-nostdinc", "-nostdinc++", "-fno-exceptions", "-fno-rtti"]
# Metal rounds half and bfloat arithmetic to the type after every operation.
# Its Safe math mode (the one mps_ext compiles with) contracts a*b + c within
# one statement into an fma, as clang's -ffp-contract=on does; the executor
# makes each such fma exact on every CPU (_instrument.fuse_multiply_adds)
# and fuses nothing across statements. Its own headers contract nothing
# (translation_unit). MathMode turns the contraction off, for tests.
_ARITHMETIC = [
    "-Xclang", "-ffloat16-excess-precision=none",
    "-Xclang", "-fbfloat16-excess-precision=none",
    "-fno-math-errno",
    # Apple GPUs flush fp32 denormals (engine.cpp sets the CPU to do the
    # same at run time); constant folding must agree.
    "-fdenormal-fp-math-f32=preserve-sign,preserve-sign",
]


@dataclasses.dataclass(frozen=True)
class MathMode:
    """How the executor compiles a shader's floating-point arithmetic: as a
    Mac's Safe math mode does by default, or as far in another direction as
    Metal allows, so that a test can show that a kernel's claim does not
    depend on a choice the GPU's compiler or library makes.

    contract: `a * b + c` within one statement is one fma (True, as the
    executor models Safe math: -ffp-contract=on), or a rounded product and
    a rounded sum (False), which Safe math allows as well: its contraction
    is the compiler's option, not an obligation.
    perturb: 0, the C library's functions (exp, log, ... within an ulp);
    n > 0, every precise function whose accuracy MSL's tables bound in ulps
    (exp: 4 ulp of float, 1 of half) returns a result as far from the exact
    one as n times that bound allows, in a direction a hash of the function
    and its arguments' bits decides (mx_metal.h, __mx::off_by): 1 is the
    worst a conforming GPU may do, more a planted worse one that a test's
    claim must then catch."""

    contract: bool = True
    perturb: int = 0

    def __post_init__(self):
        if not isinstance(self.contract, bool):
            raise TypeError(f"MathMode.contract must be a bool, got {self.contract!r}")
        if isinstance(self.perturb, bool) or not isinstance(self.perturb, int) or self.perturb < 0:
            raise ValueError(f"MathMode.perturb must be a non-negative int (times the specification's bound), "
                             f"got {self.perturb!r}")

    @classmethod
    def from_environment(cls) -> "MathMode":
        """MPS_EXT_EXECUTOR_CONTRACT=off and MPS_EXT_EXECUTOR_PERTURB=n, for
        running a whole test suite in another mode."""
        contract = os.environ.get("MPS_EXT_EXECUTOR_CONTRACT", "on")
        if contract not in ("on", "off"):
            raise ValueError(f"MPS_EXT_EXECUTOR_CONTRACT must be 'on' or 'off', got {contract!r}")
        perturb = os.environ.get("MPS_EXT_EXECUTOR_PERTURB", "0")
        if not perturb.isdigit():
            raise ValueError(f"MPS_EXT_EXECUTOR_PERTURB must be a non-negative integer, got {perturb!r}")
        return cls(contract=contract == "on", perturb=int(perturb))

    def flags(self) -> list[str]:
        """What the mode changes in the compile of the translation unit."""
        return ["-ffp-contract=" + ("on" if self.contract else "off"), f"-DMX_PERTURB={self.perturb}"]


_math_mode = MathMode.from_environment()
_STARTING_MODE = _math_mode


def math_mode() -> MathMode:
    """The mode shaders are compiled in from now on."""
    return _math_mode


def set_math_mode(mode: MathMode) -> MathMode:
    """Compile shaders in `mode` from now on; returns the mode before.
    Libraries compiled before keep theirs."""
    global _math_mode
    if not isinstance(mode, MathMode):
        raise TypeError(f"set_math_mode takes a MathMode, not {type(mode).__name__}")
    before, _math_mode = _math_mode, mode
    return before


# The IR is instrumented before optimisation (every memory access the source
# makes, at the width the source makes it: an optimiser may split a 16-byte
# load into four 4-byte ones; and every call still a call, always_inline
# helpers included, for the SIMT positions), then optimised with the checks
# in place. -O2 without LLVM passes: the front end's output as at -O0, but
# not marked noinline, so the optimiser can inline the stand-in stdlib.
_IR_OPT = ["-O2", "-Xclang", "-disable-llvm-passes"]


@dataclasses.dataclass
class Diagnostic:
    file: str
    line: int
    column: int
    severity: str
    message: str


class CompileError(Exception):
    """A shader failed to compile. `diagnostics` lists the compiler's
    messages; the exception's text shows them as file:line:col lines of the
    shader source."""

    def __init__(self, message: str, diagnostics: list[Diagnostic] | None = None):
        super().__init__(message)
        self.diagnostics = diagnostics or []


@dataclasses.dataclass
class Built:
    path: Path  # the shared object
    kernels: list[dict]  # name, line and parameters of each kernel


def cache_dir() -> Path:
    d = os.environ.get("MPS_EXT_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "mps_ext" / "cpu_metal"


@functools.lru_cache(maxsize=None)
def find_clang() -> str:
    """The clang++ to use: $MPS_EXT_CLANG, clang++-19, or clang++."""
    candidates = [os.environ.get("MPS_EXT_CLANG"), "clang++-19", "clang++"]
    for c in candidates:
        if c and shutil.which(c):
            return shutil.which(c)
    raise CompileError(
        "the CPU Metal executor needs clang++ (Debian: apt-get install clang-19; "
        "macOS: xcode-select --install), or set MPS_EXT_CLANG"
    )


@functools.lru_cache(maxsize=None)
def _clang_identity() -> str:
    out = subprocess.run([find_clang(), "--version"], capture_output=True, text=True)
    return out.stdout.strip()


@functools.lru_cache(maxsize=None)
def _supported_arithmetic_flags() -> tuple[str, ...]:
    """The _ARITHMETIC flags this clang accepts (Apple's may lack some)."""
    ok = []
    pairs = [_ARITHMETIC[i : i + 2] for i in (0, 2)] + [[f] for f in _ARITHMETIC[4:]]
    for flag in pairs:
        r = subprocess.run(
            [find_clang(), *_LANGUAGE, "-fsyntax-only", *flag, "-"],
            input="", capture_output=True, text=True,
        )
        if r.returncode == 0:
            ok += flag
    return tuple(ok)


def _run(cmd: list[str], stdin: str | None = None, what: str = "compile") -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        diags = parse_diagnostics(r.stderr)
        raise CompileError(format_diagnostics(diags) or r.stderr.strip() or f"{what} failed", diags)
    return r


_DIAG_RE = re.compile(r"^(.*?):(\d+):(\d+): (fatal error|error|warning|note): (.*)$")


def parse_diagnostics(text: str) -> list[Diagnostic]:
    diags = []
    for line in text.splitlines():
        m = _DIAG_RE.match(line)
        if m:
            diags.append(Diagnostic(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)))
    return diags


def format_diagnostics(diags: list[Diagnostic]) -> str:
    return "\n".join(f"{d.file}:{d.line}:{d.column}: {d.severity}: {d.message}" for d in diags)


def _define_flags(defines: dict | None) -> list[str]:
    flags = [f"-D{k}={v}" for k, v in METAL_MACROS.items()]
    for k, v in (defines or {}).items():
        if not re.match(r"^[A-Za-z_][A-Za-z_0-9]*$", str(k)):
            raise CompileError(f"define name {k!r} is not an identifier")
        if isinstance(v, bool):
            v = int(v)
        flags.append(f"-D{k}={v}")
    return flags


def preprocess(source: str, filename: str, defines: dict | None, include_dirs=()) -> str:
    """The shader's own text after the preprocessor, with line markers."""
    cmd = [find_clang(), "-E", *_LANGUAGE, "-I", str(SCAN_INCLUDE)]
    for d in include_dirs:
        cmd += ["-I", str(d)]
    cmd += [*_define_flags(defines), "-"]
    text = f'#line 1 "{filename}"\n{source}'
    return _run(cmd, text, "preprocessing").stdout


def translation_unit(preprocessed: str, tr: "_translate.Translation | None" = None,
                     defines: dict | None = None, contract: bool = True) -> tuple[str, list[dict], list[str]]:
    """The C++ translation unit, the kernels, and problems found on the way.
    The stand-in <metal_stdlib> sees the Metal version the shader was
    preprocessed for (functions newer than it are missing, as on a Mac);
    `contract` is MathMode.contract."""
    tr = tr or _translate.translate(preprocessed)
    entry, entry_problems = _translate.entry_points(tr.kernels)
    problems = [msg for _, msg in tr.problems] + [msg for _, msg in entry_problems]
    version = (defines or {}).get("__METAL_VERSION__", METAL_MACROS["__METAL_VERSION__"])
    tu = (
        f"#define __METAL_VERSION__ {int(version)}\n"
        # The stand-in library's arithmetic is written out as Metal's
        # behaves; the shader's own is contracted as Metal's compiler does.
        "#pragma clang fp contract(off)\n"
        '#include "mx_metal.h"\n'
        f"#pragma clang fp contract({'on' if contract else 'off'})\n"
        + tr.text
        + '\n#line 1 "<executor entry points>"\n'
        + entry
    )
    kernels = [
        {
            "name": k.host_name,
            "line": k.line,
            "params": [dataclasses.asdict(p) for p in k.params],
        }
        for k in tr.kernels
    ]
    return tu, kernels, problems


# Copies of a struct between address spaces (mx_metal.h, __MX_COPIES): the
# translator gives each class of the shader constructors and assignments
# from every address space, so that the address-space compile takes copies
# out of device, constant and threadgroup memory as Metal does. Two kinds of
# copy C++ cannot be given, and which are accepted after the fact instead
# (an error in a template's body makes clang mark the specialisation
# invalid, so every later use of it fails too: the fewer, the better):
# - copy construction for a class the translator does not see (a local or
#   anonymous class, one declaring its own copy constructor);
_STRUCT_COPY_NOTES = (
    re.compile(r"implicit (copy|move) constructor\) not viable: .*address space"),
    re.compile(
        r"no known conversion from '__attribute__\(\(address_space\(\d\)\)\) (?:const )?(.+?)' to '(?:const )?\1"
    ),
)
# - assignment to an object in device or threadgroup memory: its `this`
#   would need the address space. Legal where the same assignment compiles
#   with the address spaces erased, which tells a const or `constant` target
#   (Apple: read-only) from a writable one.
_ASSIGNMENT_IN_SPACE = re.compile(r"'this' object is in address space '[13]'")


def _drop_struct_copies(stderr: str, erased_errors) -> list[Diagnostic]:
    """The diagnostics without the copies above; `erased_errors()` gives
    the (file, line, column) of each error of the compile with address
    spaces erased."""
    groups: list[list[Diagnostic]] = []
    for d in parse_diagnostics(stderr):
        if d.severity == "note" and groups:
            groups[-1].append(d)
        else:
            groups.append([d])
    kept, erased = [], None
    for g in groups:
        head = g[0]
        if head.severity in ("error", "fatal error"):
            if any(pat.search(n.message) for n in g[1:] for pat in _STRUCT_COPY_NOTES):
                continue
            if head.message == "no viable overloaded '='" and any(
                _ASSIGNMENT_IN_SPACE.search(n.message) for n in g[1:]
            ):
                erased = erased_errors() if erased is None else erased
                if (head.file, head.line, head.column) not in erased:
                    continue
        kept.extend(g)
    return kept


# The check compile takes the shader as C++14, the base of MSL 3.1. Apple's
# compiler (a clang) takes C++17 and C++20 features there as extensions, with
# a warning: MLX builds its kernels, which use `if constexpr`, inline
# variables and static_assert without a message, with
# `-Wno-c++17-extensions -Wno-c++20-extensions`
# (mlx/backend/metal/kernels/CMakeLists.txt). Newer ones an older clang may
# not know are errors here. The executor's own headers are system headers
# and its entry points are exempt: they are C++17 and never reach a Mac.
_CHECK_LANGUAGE = [f if f != "-std=c++17" else "-std=c++14" for f in _LANGUAGE]
_CXX20_ONLY = ["-Wno-everything", "-Werror=c++23-extensions"]
_ENTRY_POINTS = '\n#line 1 "<executor entry points>"\n'


_OBJECT_PARAMETER = re.compile(
    r"(?:cannot initialize object parameter of type '(?:const )?|"
    r"no viable conversion from '(?:const )?(?:device|constant|threadgroup) (?:const )?)(\w+)"
)


def check_address_spaces(tu: str, workdir: Path, address_space_classes=()) -> list[Diagnostic]:
    """Errors of the translation unit compiled with real address spaces, as
    C++14 (the shader's own text). Member calls on objects of
    address_space_classes in any address space are legal (the translator
    dropped the member functions' address-space qualifiers)."""
    path = workdir / "address_spaces.cpp"
    path.write_text(
        tu.replace(_ENTRY_POINTS, '\n#pragma clang diagnostic ignored "-Wc++17-extensions"' + _ENTRY_POINTS)
    )
    cmd = [find_clang(), *_CHECK_LANGUAGE, "-fsyntax-only", *_CXX20_ONLY, "-ferror-limit=0",
           "-fno-color-diagnostics", "-fno-caret-diagnostics", "-DMX_ADDRESS_SPACES=1", "-isystem", str(INCLUDE),
           str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        return []

    def erased_errors():
        erased = subprocess.run([c if c != "-DMX_ADDRESS_SPACES=1" else "-DMX_ADDRESS_SPACES=0" for c in cmd],
                                capture_output=True, text=True)
        return {(d.file, d.line, d.column) for d in parse_diagnostics(erased.stderr) if d.severity == "error"}

    diags = _drop_struct_copies(r.stderr, erased_errors)
    classes = set(address_space_classes)
    diags = [d for d in diags if not ((m := _OBJECT_PARAMETER.match(d.message)) and m.group(1) in classes)]
    if not any(d.severity in ("error", "fatal error") for d in diags):
        return []
    for d in diags:
        if re.search(r"\[-Werror,-Wc\+\+\d+", d.message):
            d.message += "; Apple's compiler takes C++ up to C++20 (as extensions of MSL's C++14) [msl-cxx20]"
    return diags


def check_file(path: str | Path, include_dirs=()) -> list[str]:
    """Check mode: Metal rules C++ accepts (the lint), then the address-space
    compile. Returns findings as 'file:line[:col]: message'."""
    path = Path(path)
    return check_source(path.read_text(), str(path), [path.parent, *include_dirs])


def check_source(source: str, name: str, include_dirs=()) -> list[str]:
    """check_file of `source` as the file `name`, its includes searched in
    include_dirs."""
    findings = _lint.lint_includes(source, name)
    try:
        pre = preprocess(source, name, None, include_dirs)
    except CompileError as e:
        return findings + [line for line in str(e).splitlines() if line.strip()]
    try:
        tr = _translate.translate(pre)
        findings += _lint.lint(pre)
    except _translate.TranslateError as e:  # text the executor cannot read: a finding, not a crash
        return findings + [f"{name}: the CPU Metal executor cannot read this shader: {e}"]
    findings += [msg for _, msg in tr.problems]
    tu, _, entry_problems = translation_unit(pre, tr)
    with tempfile.TemporaryDirectory() as work:
        diags = check_address_spaces(tu, Path(work), tr.address_space_classes)
    for d in diags:
        # Parameters the lint already reported also break the generated
        # entry points; do not report them twice.
        if d.severity == "note" or (entry_problems and d.file == "<executor entry points>"):
            continue
        findings.append(f"{d.file}:{d.line}:{d.column}: {d.severity}: {d.message}")
    return findings


def _cache_key(source: str, filename: str, defines: dict | None, check: bool, mode: MathMode) -> str:
    h = hashlib.sha256()
    for part in (
        _clang_identity(),
        sys.platform,
        json.dumps(sorted((str(k), str(v)) for k, v in (defines or {}).items())),
        filename,
        str(check),
        repr(mode),
        source,
    ):
        h.update(part.encode())
        h.update(b"\0")
    # The executor's own code decides what comes out: fold it in.
    for f in sorted(INCLUDE.glob("*.h")) + [HERE / "_translate.py", HERE / "_instrument.py", HERE / "_lint.py",
                                            HERE / "_analysis.py", Path(__file__)]:
        h.update(f.read_bytes())
    return h.hexdigest()


def build(source: str, defines: dict | None = None, filename: str = "shader.metal",
          check: bool = True, mode: MathMode | None = None) -> Built:
    """Compile MSL source to a shared object (cached), in `mode` (by default
    math_mode())."""
    mode = mode or _math_mode
    key = _cache_key(source, filename, defines, check, mode)
    final = cache_dir() / key[:2] / key
    meta_path = final / "kernels.json"
    if meta_path.exists():
        return Built(final / "library.so", json.loads(meta_path.read_text()))

    final.parent.mkdir(parents=True, exist_ok=True)
    # One build of a key at a time, across threads and processes (the test
    # suite's workers share the cache and start on the same libraries): the
    # others wait for it and load its result instead of compiling the same
    # library beside it, each at the cost of the whole pipeline. flock
    # releases the GIL while it waits; the lock goes with the file's close,
    # also when the process dies.
    with open(final.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta_path.exists():
            return Built(final / "library.so", json.loads(meta_path.read_text()))
        return _build_locked(source, defines, filename, check, mode, final)


def op_layer_library(name: str, source: str, variant: str) -> tuple[str, bool]:
    """The library the op layer's launches of a kernel of
    kernels_metal/<name>.metal load on the executor
    (executor/csrc/backend.cpp), and whether it is the whole library:
    `source` is the library's embedded text, `variant` the text the Metal
    backend compiles for the kernel alone (csrc/backend/shaders.h; empty
    when the library has none). In the mode the process started in, the
    whole library: one build, cached, which every test and worker shares.
    In another mode (a test's math_mode block) the variant: such a block
    launches a few kernels, and building their whole libraries in its mode
    cost minutes (the contraction-off tests' grouped_mm.metal took 257 s in
    a CI run)."""
    whole = _math_mode == _STARTING_MODE or not variant
    return str(build(source if whole else variant, None, f"{name}.metal").path), whole


def _build_locked(source: str, defines: dict | None, filename: str, check: bool, mode: MathMode,
                  final: Path) -> Built:
    meta_path = final / "kernels.json"
    work = Path(tempfile.mkdtemp(prefix="build-", dir=final.parent))
    try:
        pre = preprocess(source, filename, defines)
        tr = _translate.translate(pre)
        tu, kernels, problems = translation_unit(pre, tr, defines=defines, contract=mode.contract)
        problems += [f"{filename}:{line}: function constant '{name}' ([[function_constant]]): the CPU Metal executor "
                     "has no pipeline to take its value from; pass the value as a buffer or a define"
                     for line, name in tr.function_constants]
        if check:  # what Apple's compiler would reject (_lint.py); a standard header already failed above
            problems = _lint.lint(pre) + problems
        if problems:
            raise CompileError("\n".join(problems))
        if check:
            diags = check_address_spaces(tu, work, tr.address_space_classes)
            if diags:
                raise CompileError(format_diagnostics(diags), diags)
        cpp = work / "library.cpp"
        cpp.write_text(tu)
        ll = work / "library.ll"
        clang = find_clang()
        _run([clang, *_LANGUAGE, *_supported_arithmetic_flags(), *mode.flags(), *_IR_OPT,
              "-gline-tables-only", "-fPIC", "-w", "-fno-color-diagnostics", "-DMX_ADDRESS_SPACES=0",
              "-I", str(INCLUDE), "-S", "-emit-llvm", "-o", str(ll), str(cpp)])
        # What the kernels cost a GPU, from the IR optimised as a GPU
        # compiler would (_analysis.py).
        analysed = work / "library.analysis.ll"
        _run([clang, *_analysis.ANALYSIS_FLAGS, "-w", "-S", "-emit-llvm", "-x", "ir", str(ll), "-o", str(analysed)],
             what="analysis")
        costs = _analysis.kernel_costs(analysed.read_text(), kernels)
        instrumented, _sites = _instrument.instrument(ll.read_text())
        ill = work / "library.instrumented.ll"
        ill.write_text(instrumented)
        # Optimise, count the 64-bit integer work and divisions left, then
        # generate code without optimising again.
        oll = work / "library.optimised.ll"
        _run([clang, "-O2", "-fno-vectorize", "-fno-slp-vectorize", "-w", "-S", "-emit-llvm",
              "-x", "ir", str(ill), "-o", str(oll)], what="optimising")
        counted = work / "library.counted.ll"
        counted.write_text(_instrument.count_ops(oll.read_text()) + _instrument.kernel_info_table(costs))
        so = work / "library.so"
        _run([clang, "-O2", "-Xclang", "-disable-llvm-passes", "-fPIC", "-shared", "-w",
              "-x", "ir", str(counted), "-o", str(so), "-lm"], what="linking")
        (work / "kernels.json").write_text(json.dumps(kernels))
        try:
            os.rename(work, final)
        except OSError:
            if not meta_path.exists():  # lost a race to a broken build
                raise
        return Built(final / "library.so", json.loads(meta_path.read_text()))
    except (_instrument.InstrumentError, _analysis.AnalysisError) as e:
        raise CompileError(f"{filename}: {e}") from None
    except _translate.TranslateError as e:
        raise CompileError(f"{filename}: {e}") from None
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
