"""Which aten ops torch's linear-algebra entry points reach on MPS, per
release, read from torch's macOS arm64 wheels.

    python tools/linalg_entry_points.py WHEEL [WHEEL ...]

For each wheel (torch-2.X.Y-...-macosx_*_arm64.whl, e.g. from
`pip download torch==2.X.Y --no-deps --platform macosx_14_0_arm64
--python-version 3.11 --only-binary=:all:`) it prints
 1. the MPS dispatch of every op the linalg family implements, from the
    wheel's native_functions.yaml: its own MPS kernel (mps_ext overrides it),
    a composite (it reaches other ops), or none (mps_ext registers one);
 2. the aten ops that torch's composite entry points and structured kernels
    call, from a disassembly of libtorch_cpu.dylib (the calls to
    at::_ops::<op>::call in each function);
 3. what torch's own MPS linear-algebra kernels refuse, from their messages.
csrc/ops/linalg.cpp is written from this output; rerun it for a new torch.
Needs llvm-nm, llvm-objdump and llvm-cxxfilt (any LLVM, e.g. -19).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml

# The ops of the family (csrc/ops/linalg.cpp) and the composites before them.
FAMILY = ["linalg_lu_factor_ex", "linalg_lu_factor", "linalg_lu", "lu_unpack", "linalg_solve_triangular",
          "triangular_solve", "linalg_inv_ex", "_linalg_solve_ex", "linalg_lu_solve", "_linalg_det",
          "_linalg_slogdet"]
# Functions whose calls decide the paths: composite entry points and the
# structured kernels torch uses on MPS.
CALLERS = [
    r"^at::native::(linalg_solve|linalg_solve_ex|linalg_inv|inverse|linalg_lu_factor|lu_solve|linalg_det|det|"
    r"linalg_slogdet|slogdet|logdet|_lu_with_info)\(at::Tensor",
    r"^at::native::structured_(_linalg_det_out|_linalg_slogdet_out|linalg_lu_out|lu_unpack_out|"
    r"_linalg_solve_ex_out|linalg_inv_ex_out)::impl\(",
]
MESSAGES = re.compile(r"^(linalg[._]\w*|lu_\w*|solve\w*|triangular_solve)\W.*(MPS|complex)", re.I)


def tool(name: str) -> str:
    for candidate in (name, f"{name}-19", f"{name}-18", f"{name}-17"):
        if shutil.which(candidate):
            return candidate
    raise SystemExit(f"{name} not found")


def dispatch_table(yaml_text: str) -> dict[str, str]:
    entries = {e["func"].split("(")[0]: e for e in yaml.load(yaml_text, Loader=getattr(yaml, "CSafeLoader",
                                                                                          yaml.SafeLoader))}
    out = {}
    for op in FAMILY:
        e = entries[op]
        if "structured_delegate" in e:
            e = entries[e["structured_delegate"]]
        keys = {k.strip(): v for ks, v in (e.get("dispatch") or {}).items() for k in ks.split(",")}
        if "MPS" in keys:
            out[op] = f"MPS kernel {keys['MPS']}: overridden"
        elif "CompositeImplicitAutograd" in keys or not keys:
            out[op] = "composite: not overridden (reaches the ops it calls)"
        else:
            out[op] = "no MPS kernel: registered by mps_ext"
    return out


def calls(lib: Path) -> dict[str, list[str]]:
    nm, objdump, filt = tool("llvm-nm"), tool("llvm-objdump"), tool("llvm-cxxfilt")
    raw = subprocess.run([nm, "--defined-only", str(lib)], capture_output=True, text=True).stdout.splitlines()
    dem = subprocess.run([nm, "--defined-only", "-C", str(lib)], capture_output=True, text=True).stdout.splitlines()
    patterns = [re.compile(p) for p in CALLERS]
    out = {}
    for r, d in zip(raw, dem):
        parts = d.split(" ", 2)
        if len(parts) < 3 or not any(p.search(parts[2]) for p in patterns):
            continue
        symbol = r.split(" ", 2)[2]
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", f"--disassemble-symbols={symbol}", str(lib)],
                             capture_output=True, text=True).stdout
        mangled = sorted(set(re.findall(r"<(__ZN2at4_ops\w+?)(?:\+0x[0-9a-f]+)?>", dis)))
        names = subprocess.run([filt] + [m[1:] for m in mangled], capture_output=True, text=True).stdout.split("\n")
        ops = sorted({re.sub(r"\(.*", "", n).replace("at::_ops::", "").replace("::call", "")
                      for n in names if "::call" in n})
        if ops:
            out[re.sub(r"\(.*", "", parts[2])] = ops
    return out


def report(wheel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        version = re.search(r"__version__ = '([^']+)'", z.read("torch/version.py").decode()).group(1)
        print(f"=== torch {version} ({wheel.name})")
        for op, how in dispatch_table(z.read("torchgen/packaged/ATen/native/native_functions.yaml").decode()).items():
            print(f"  {op:26} {how}")
        lib = Path(z.extract("torch/lib/libtorch_cpu.dylib", tmp))
        print("  calls:")
        for fn, ops in sorted(calls(lib).items()):
            print(f"    {fn:60} -> {', '.join(ops)}")
        strings = subprocess.run(["strings", "-n", "8", str(lib)], capture_output=True, text=True).stdout
        print("  torch's MPS kernels say:")
        for line in sorted({s for s in strings.splitlines() if MESSAGES.match(s)}):
            print(f"    {line}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for path in sys.argv[1:]:
        report(Path(path))
