"""Check mode against Metal that Apple's compiler builds every day.

    python tools/metal_corpus.py [-j JOBS] [--only SUBSTRING ...]

The corpus is every Metal header of
- the `mlx-metal` macOS wheel (MLX_VERSION): mlx/include/mlx/backend/metal/kernels/,
  the kernels MLX compiles into its metallib and JIT-compiles at run time;
- the torch macOS wheels tools/torch_matrix.py downloads (every release of
  torch_matrix.VERSIONS): ATen/native/mps/kernels/ and c10/metal/, the
  headers PyTorch's own Metal kernels include (files shared by several
  releases are checked once).

A header of templates compiles little by itself, and MLX's headers are not
self-contained: each file is checked through a stub that includes, first,
what MLX's own .metal files include before it (PRELUDES, read from MLX's
sources at the same version), then the file, then instantiations of its
kernel templates where INSTANTIATIONS has them. A file that needs what the
executor documents as unsupported is in EXCEPTED with the reason; every
other file must give no finding.

Wheels are downloaded once (pip download, pinned versions) into
$MPS_EXT_CORPUS_CACHE or ~/.cache/mps_ext/metal-corpus/ (torch headers: the
cache of tools/torch_matrix.py). A failed download is an error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import os
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import torch_matrix  # noqa: E402

MLX_VERSION = "0.32.4"
MLX_PLATFORM = "macosx_14_0_arm64"  # the wheel is py3-none: one per macOS release, the same headers
MLX_KERNELS = "mlx/include/mlx/backend/metal/kernels"


class CorpusError(Exception):
    """The corpus could not be built (download, extraction)."""


def cache_root() -> Path:
    d = os.environ.get("MPS_EXT_CORPUS_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "mps_ext" / "metal-corpus"


def fetch_mlx(root: Path | None = None) -> Path:
    """The wheel's include directory (holding mlx/backend/metal/kernels)."""

    def make(tree: Path) -> str:
        wheel = torch_matrix.download_wheel(f"mlx-metal=={MLX_VERSION}", MLX_PLATFORM, tree.parent, error=CorpusError)
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith(MLX_KERNELS + "/")]
            if not names:
                raise CorpusError(f"{wheel.name} has no {MLX_KERNELS}/")
            z.extractall(tree, names)
        return wheel.name

    dest = torch_matrix.cached_download((root or cache_root()) / f"mlx-metal-{MLX_VERSION}", make)
    return dest / "mlx" / "include"


# What MLX's .metal files include before each header (MLX's sources at
# MLX_VERSION, mlx/backend/metal/kernels/*.metal); a header no .metal file
# includes (the JIT's) gets utils.h, as MLX's JIT preamble does.
PRELUDES = {
    "atomic.h": ["defines.h", "utils.h"],
    "binary.h": ["defines.h", "utils.h", "binary_ops.h"],
    "binary_two.h": ["utils.h", "binary_ops.h"],
    "defines.h": [],
    "dot.h": [],
    "fft.h": ["defines.h"],
    "fp_quantized.h": ["utils.h", "steel/gemm/gemm.h", "quantized_utils.h"],
    "gemv.h": [],
    "quantized.h": ["utils.h", "steel/gemm/gemm.h", "quantized_utils.h"],
    "quantized_utils.h": ["utils.h", "steel/gemm/gemm.h"],
    "reduce.h": ["defines.h", "utils.h", "atomic.h", "reduction/ops.h"],
    "reduction/ops.h": ["defines.h", "utils.h", "atomic.h"],
    "reduction/reduce_all.h": ["defines.h", "utils.h", "atomic.h", "reduction/ops.h"],
    "reduction/reduce_col.h": ["defines.h", "utils.h", "atomic.h", "reduction/ops.h"],
    "reduction/reduce_row.h": ["defines.h", "utils.h", "atomic.h", "reduction/ops.h"],
    "reduce_utils.h": ["defines.h", "utils.h", "atomic.h", "reduction/ops.h"],
    "indexing/scatter.h": ["defines.h", "utils.h", "atomic.h", "indexing/indexing.h"],
    "indexing/scatter_axis.h": ["defines.h", "utils.h", "atomic.h"],
    "steel/conv/loader.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/conv.h", "steel/conv/params.h"],
    "steel/conv/loaders/loader_channel_l.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/params.h"],
    "steel/conv/loaders/loader_channel_n.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/params.h"],
    "steel/conv/loaders/loader_general.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/params.h"],
    "scan.h": ["defines.h", "utils.h"],
    "searchsorted.h": ["utils.h", "sort.h"],
    "steel/conv/conv.h": ["utils.h", "steel/gemm/mma.h"],
    "steel/conv/kernels/steel_conv.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/conv.h", "steel/conv/params.h"],
    "steel/conv/kernels/steel_conv_3d.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/conv.h",
                                           "steel/conv/params.h"],
    "steel/conv/kernels/steel_conv_general.h": ["utils.h", "steel/gemm/mma.h", "steel/conv/conv.h",
                                                "steel/conv/params.h", "steel/utils.h"],
    "steel/conv/params.h": [],
    "steel/gemm/kernels/steel_gemm_fused.h": ["utils.h", "steel/gemm/gemm.h"],
    "steel/gemm/kernels/steel_gemm_gather.h": ["utils.h", "steel/gemm/gemm.h"],
    "steel/gemm/kernels/steel_gemm_masked.h": ["utils.h", "steel/gemm/gemm.h"],
    "steel/gemm/kernels/steel_gemm_segmented.h": ["utils.h", "steel/gemm/gemm.h"],
    "steel/gemm/kernels/steel_gemm_splitk.h": ["utils.h", "steel/gemm/gemm.h"],
    "ternary.h": ["utils.h", "ternary_ops.h"],
    "unary.h": ["utils.h", "unary_ops.h"],
    "utils.h": [],
}

# Files check mode does not pass, with the reason (keyed by the summary's
# name: a torch file by the first release whose copy of it is checked).
_METAL4 = ("Metal 4 (MetalPerformancePrimitives tensor operations, and the lambdas Metal 4 allows): the executor "
           "implements MSL 3.1 and documents Metal 4 as unsupported")
EXCEPTED: dict[str, str] = {
    **{f"mlx/{f}": _METAL4 for f in (
        "fp_quantized_nax.h", "gated_delta_nax_ops.h", "gated_delta_update_nax.h", "gated_delta_update_nax_vjp.h",
        "quantized_nax.h", "steel/attn/kernels/steel_attention_nax.h", "steel/attn/nax.h", "steel/gemm/gemm_nax.h",
        "steel/gemm/kernels/steel_gemm_fused_nax.h", "steel/gemm/kernels/steel_gemm_gather_nax.h",
        "steel/gemm/kernels/steel_gemm_segmented_nax.h", "steel/gemm/kernels/steel_gemm_splitk_nax.h",
        "steel/gemm/kernels/steel_gemm_thin_nax.h", "steel/gemm/nax.h")},
}

# Kernel instantiations appended to a file's stub (MLX's .metal files
# instantiate with the same macros).
INSTANTIATIONS: dict[str, str] = {}


@dataclasses.dataclass
class Entry:
    name: str  # how the summary names it: "mlx/<path>" or "torch-<version>/<path>"
    path: Path  # the header
    include_dirs: list[Path]
    stub: str  # the .metal text that is checked


@dataclasses.dataclass
class Result:
    entry: Entry
    findings: list[str]
    seconds: float
    excepted: str = ""

    @property
    def ok(self) -> bool:
        return not self.findings


def _mlx_entries(include: Path) -> list[Entry]:
    kernels = include / MLX_KERNELS.split("/", 2)[2]
    out = []
    for path in sorted(kernels.rglob("*.h")):
        rel = path.relative_to(kernels).as_posix()
        prelude = PRELUDES.get(rel, ["utils.h"])
        lines = ["#include <metal_stdlib>"]
        lines += [f'#include "mlx/backend/metal/kernels/{p}"' for p in prelude if p != rel]
        lines.append(f'#include "mlx/backend/metal/kernels/{rel}"')
        if rel in INSTANTIATIONS:
            lines.append(INSTANTIATIONS[rel])
        out.append(Entry(f"mlx/{rel}", path, [include], "\n".join(lines) + "\n"))
    return out


_TORCH_DIRS = ("ATen/native/mps/kernels", "c10/metal")

# What PyTorch's .metal files include before a header that is not
# self-contained: SortMerge.h says SortRadix.h uses its sort_init and is
# included after it (as SortTopK.h does); Gemv.h's GemmEpilogue is
# LinearAlgebra.h's.
TORCH_PRELUDES = {
    "ATen/native/mps/kernels/SortRadix.h": ["ATen/native/mps/kernels/SortMerge.h"],
    "ATen/native/mps/kernels/Gemv.h": ["ATen/native/mps/kernels/LinearAlgebra.h"],
}


def _torch_entries(versions) -> list[Entry]:
    out, seen = [], set()
    for v in versions:
        include = torch_matrix.fetch(v) / "torch" / "include"
        for d in _TORCH_DIRS:
            for path in sorted((include / d).glob("*.h")):
                rel = path.relative_to(include).as_posix()
                key = (rel, hashlib.sha256(path.read_bytes()).hexdigest())
                if key in seen:
                    continue  # the same file as in an older release
                seen.add(key)
                # PyTorch's kernels include c10/metal's utilities and use
                # namespace metal before their ATen/native/mps/kernels headers.
                prelude = "#include <c10/metal/utils.h>\nusing namespace metal;\n" if rel.startswith("ATen/") else ""
                prelude += "".join(f"#include <{p}>\n" for p in TORCH_PRELUDES.get(rel, []))
                stub = f"#include <metal_stdlib>\n{prelude}#include <{rel}>\n"
                if rel in INSTANTIATIONS:
                    stub += INSTANTIATIONS[rel] + "\n"
                out.append(Entry(f"torch-{v}/{rel}", path, [include], stub))
    return out


def entries(torch_versions=None) -> list[Entry]:
    """Every corpus file with the stub that checks it (downloads on first use)."""
    versions = torch_matrix.VERSIONS if torch_versions is None else torch_versions
    return _mlx_entries(fetch_mlx()) + _torch_entries(versions)


def _check(entry: Entry) -> Result:
    from mps_ext_executor._compiler import CompileError, check_source
    t = time.perf_counter()
    try:
        findings = check_source(entry.stub, f"{entry.path}.stub.metal", entry.include_dirs)
    except CompileError as e:  # a shader the translator cannot read
        findings = [str(e)]
    return Result(entry, findings, time.perf_counter() - t)


def _excepted_key(entry: Entry) -> str:
    return entry.name


def check(corpus: list[Entry], jobs: int = 2, include_excepted: bool = False) -> list[Result]:
    """Check mode on every entry; excepted entries are checked too with
    include_excepted (to see that they still fail), else skipped."""
    todo, results = [], []
    for e in corpus:
        reason = EXCEPTED.get(_excepted_key(e))
        if reason and not include_excepted:
            results.append(Result(e, [], 0.0, reason))
        else:
            todo.append(e)
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        for r in pool.map(_check, todo):
            r.excepted = EXCEPTED.get(_excepted_key(r.entry), "")
            results.append(r)
    return sorted(results, key=lambda r: r.entry.name)


def report(results: list[Result], seconds: float | None = None) -> str:
    lines = []
    for r in results:
        if r.findings and not r.excepted:
            lines.append(f"FAIL {r.entry.name} ({len(r.findings)} findings)")
            lines += [f"    {f}" for f in r.findings[:20]]
    passed = sum(r.ok and not r.excepted for r in results)
    excepted = [r for r in results if r.excepted]
    failed = sum(not r.ok and not r.excepted for r in results)
    for r in excepted:
        lines.append(f"excepted {r.entry.name}: {r.excepted}")
    timing = f" in {seconds:.0f} s" if seconds is not None else ""
    lines.append(f"{len(results)} files: {passed} pass, {len(excepted)} excepted, {failed} fail{timing}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", nargs="*", default=[], help="check only files whose name contains one of these")
    args = parser.parse_args(argv)
    corpus = entries()
    if args.only:
        corpus = [e for e in corpus if any(s in e.name for s in args.only)]
    t = time.perf_counter()
    results = check(corpus, args.jobs)
    print(report(results, time.perf_counter() - t))
    return 0 if all(r.ok or r.excepted for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
