"""Where mps_ext's kernels help, and where torch's own are as good.

One table, read at import: an aten op is overridden on the MPS key only on
torch releases older than the one that shipped an equal kernel of its own;
from that release on, mps_ext leaves the op to torch (a family whose every op
is left to torch is not installed at all). The policy applies to the MPS
overrides only: torch.ops.mps_ext on CPU tensors always runs mps_ext's
kernels.

Each entry was checked against every release mps_ext supports (2.9.0,
2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0) in the macOS arm64 wheels:
torchgen/packaged/ATen/native/native_functions.yaml (which kernel each op
has on MPS), torch/include/ATen/native/mps/ (the kernels' parameter
headers), and the Metal library compiled into torch/lib/libtorch_cpu.dylib,
whose kernel names can be read from the binary (the strings
"air-alias-scopes(<kernel name>)"), with the host functions named in its
symbols and strings; the sources are in pytorch/pytorch under
aten/src/ATen/native/mps/.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Native:
    """A kernel of torch's own that makes mps_ext's override unnecessary."""
    since: tuple[int, int]  # first torch release that has it
    ops: tuple[str, ...]    # the aten ops mps_ext leaves to it on MPS
    what: str               # what torch has, in one sentence
    evidence: str           # the files that show it


# What each release's MPS kernels are, per family, whether or not mps_ext
# steps aside for them: (releases, what torch has, the files that show it).
HISTORY: dict[str, list[tuple[str, str, str]]] = {
    "softmax": [
        ("2.9-2.14", "_softmax/_log_softmax: one MPSGraph softmax per shape (softmax_mps_out); backward: "
         "MPSGraph (softmax_backward_mps_out)",
         "native_functions.yaml: _softmax.out MPS: softmax_mps_out, _log_softmax.out MPS: log_softmax_mps_out; "
         "operations/SoftMax.mm; no softmax kernel in the dylib's Metal library"),
        ("2.15", "forward: Metal kernels (softmax_mps_impl): softmax_row, softmax, and for long rows "
         "softmax_partial + softmax_finalize, which split a row over threadgroups (chunk_size, n_chunks), with "
         "strided and log_softmax variants, float/half/bfloat, 32- and 64-bit indices; backward: still MPSGraph",
         "kernels/SoftMax.h (new in 2.15: SoftmaxParams with chunk_size, n_chunks); dylib: "
         "softmax_{row,partial,finalize,strided_partial,strided_finalize}_{float,half,bfloat}_{u32,u64} and "
         "log_softmax_*; string 'softmax_backward_mps_out:' (the MPSGraph cache key) as in 2.9-2.14"),
    ],
    "pad": [
        ("2.9-2.14", "constant_pad_nd_mps builds an MPSGraph pad per shape (pad_out_template)",
         "native_functions.yaml: constant_pad_nd MPS: constant_pad_nd_mps; operations/Pad.mm; no "
         "constant_pad_nd kernel in the dylib's Metal library"),
        ("2.15", "constant_pad_nd_mps runs Metal kernels: constant_pad_nd_<dtype>_{u32,u64} for any strides and "
         "constant_pad_nd_dense_<dtype> for contiguous input, 15 dtypes (bool, integers, half, bfloat, float, "
         "complex, float8_e4m3fn)",
         "kernels/Pad.h (new in 2.15: ConstantPadNdParams, ConstantPadDenseParams); dylib: 30 "
         "constant_pad_nd_* kernels and the strings 'constant_pad_nd_dense_', 'constant_pad_nd_{}{}'"),
    ],
    "linear": [
        ("2.9-2.13", "mm/addmm: an MPSGraph matmul (graph keys 'MM/...'), or a naive Metal matmul ('matmul_') "
         "for integer dtypes, PYTORCH_MPS_PREFER_METAL and some strides; linear: _mps_linear "
         "(MPSNDArrayMatrixMultiplication or MPSGraph); no GEMV",
         "operations/LinearAlgebra.mm (mm_out_mps_impl, addmm_out_mps_impl), operations/Linear.mm; no gemv "
         "kernel in the dylib"),
        ("2.14-2.15", "mm and addmm run torch's own Metal GEMV when one operand is a single row or column "
         "(M == 1 xor N == 1): gemv_t / gemv_t2d for y = x @ B, gemv_nt for y = A @ x, float/half/bfloat, "
         "strided matrices ('_strided'), contiguous or strided vectors (xc/xs), 64-bit index variants ('_i64'), "
         "with the addmm epilogue ('ab'). aten::linear (_mps_linear) does not use it: it runs "
         "MPSNDArrayMatrixMultiplication or MPSGraph, and calls at::mm/at::addmm only on a fallback path (in "
         "the source: Apple7/8 GPUs with K > 32768)",
         "kernels/Gemv.h (new in 2.14: 'Rank-1 GEMV kernels (M==1 xor N==1)'), operations/GemmHeuristics.h "
         "(GemvPolicy); dylib: 644 gemv_* kernels in 2.14 and 2.15, none before; 'dispatch_gemv' between "
         "'mm_out_mps_impl' and 'addmm_out_mps_impl' (operations/LinearAlgebra.mm); the disassembly of "
         "at::native::_mps_linear calls _mps_linear_nograph, runMPSGraph and, once each, at::_ops::mm and "
         "at::_ops::addmm"),
    ],
    "fp8": [
        ("2.9-2.14", "no Metal kernel for a float8 dtype, and getMPSDataType refuses float8 (\"does not have "
         "support for that dtype\"): copy_ between dtypes or devices, fill_, zero_, cat and index_select of "
         "float8 tensors raise on MPS; empty/empty_strided accept float8 (they refuse only float64), views are "
         "dtype-blind, printing converts float8 to half first (a copy_)",
         "c10/metal/ has no float8.h and C10_METAL_ALL_TYPES_FUNCTOR (c10/metal/common.h) no float8 entry; no "
         "float8 kernel name in the dylib's Metal library; operations/Copy.mm, OperationUtils.mm "
         "(getMPSDataType), EmptyTensor.cpp, torch/_tensor_str.py"),
        ("2.15", "float8_e4m3fn tensors on MPS: Metal conversions to and from float (c10/metal/float8.h) in "
         "torch's copy, fill, cat, gather, pad kernels; float8_e5m2: none, as before",
         "c10/metal/float8.h (new in 2.15: fp8e4m3fn_to_fp32, fp8e4m3fn_from_fp32, struct float8_e4m3fn, "
         "nothing for e5m2); C10_METAL_ALL_TYPES_FUNCTOR gains Float8_e4m3fn; MPSScalar's value union gains "
         "c10::Float8_e4m3fn (native/mps/OperationUtils.h); dylib: e4m3fn kernel instantiations, none for e5m2"),
    ],
    "scaled_mm": [
        ("2.9", "_scaled_mm: CPU and CUDA kernels only; no _scaled_mm_v2 op (F.scaled_mm)",
         "ATen/ops/_scaled_mm_native.h (_scaled_mm_cpu, _scaled_mm_cuda); no ATen/ops/_scaled_mm_v2*.h"),
        ("2.10-2.14", "_scaled_mm_v2 (F.scaled_mm): CUDA kernels (2.10, 2.11), CPU and CUDA (2.12-2.14); "
         "_scaled_mm: CPU and CUDA; nothing on MPS",
         "ATen/ops/_scaled_mm_v2_native.h: _scaled_mm_cuda_v2 (2.10, 2.11), _scaled_mm_cpu_v2 and "
         "_scaled_mm_cuda_v2 (2.12, 2.13), structured _scaled_mm_cpu_v2_out and _scaled_mm_cuda_v2_out (2.14); "
         "_scaled_mm_native.h: cpu and cuda"),
        ("2.15", "_scaled_mm_v2 on MPS: Metal kernels scaled_mm_<output dtype> (32 x 32 tiles) for "
         "float8_e4m3fn operands with tensor-wise or row-wise fp32 scales, outputs f32/f16/bf16/e4m3fn, a "
         "bias only of the output's dtype (bf16 or f16); no block-wise recipes, no e5m2; _scaled_mm (v1): "
         "still no MPS kernel",
         "ATen/ops/_scaled_mm_v2_native.h (structured__scaled_mm_mps_v2_out, new in 2.15), "
         "native/mps/kernels/ScaledMM.h (new in 2.15: ScaledMMParams with rowwise, has_bias, bias_bfloat16), "
         "operations/ScaledMM.mm (TensorWise/RowWise dispatch table, its bias checks); _scaled_mm_native.h "
         "without an mps kernel"),
    ],
}

# Ops mps_ext leaves to torch from a release on.
NATIVE: dict[str, list[Native]] = {
    "softmax": [Native(
        (2, 15), ("aten::_softmax", "aten::_log_softmax"),
        "torch 2.15 splits long softmax rows over many threadgroups itself (its backward stays MPSGraph, so "
        "mps_ext keeps the backward)", HISTORY["softmax"][1][2])],
    "pad": [Native((2, 15), ("aten::constant_pad_nd",), "torch 2.15 has Metal constant_pad_nd kernels",
                   HISTORY["pad"][1][2])],
}

# torch 2.14 gave aten::mm and aten::addmm a GEMV of their own for a single
# row (or column); mps_ext keeps 2 to 8 rows there (speculative decoding, beam
# search, small batches), and F.linear's single row, which torch's
# aten::linear does not send to that GEMV.
MM_ONE_ROW_GEMV = Native((2, 14), ("aten::mm", "aten::addmm"), "torch 2.14 has its own one-row GEMV for mm and addmm",
                         HISTORY["linear"][1][2])


# torch 2.15 handles float8_e4m3fn tensors on MPS, and tensor-wise and
# row-wise float8_e4m3fn _scaled_mm_v2 products (with the outputs and bias
# dtypes its kernel takes): mps_ext's fp8 and scaled_mm families then keep
# float8_e5m2, the block-wise recipes, _scaled_mm (v1) and what torch's
# kernel rejects (csrc/ops/fp8.cpp, fp8_mm.cpp decide per call).
FP8_E4M3FN = Native((2, 15), ("aten::copy_", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_", "aten::cat",
                              "aten::index_select"),
                    "torch 2.15 has float8_e4m3fn tensors on MPS", HISTORY["fp8"][1][2])
SCALED_MM_E4M3FN = Native((2, 15), ("aten::_scaled_mm_v2",),
                          "torch 2.15's _scaled_mm_v2 runs tensor-wise and row-wise float8_e4m3fn products on MPS",
                          HISTORY["scaled_mm"][2][2])

# What each family leaves to torch for some inputs only, decided per call:
# family -> [(the kernel torch has, which inputs)].
PARTLY_NATIVE: dict[str, list[tuple[Native, str]]] = {
    "linear": [(MM_ONE_ROW_GEMV, "one-row mm/addmm left to torch's own GEMV")],
    "fp8": [(FP8_E4M3FN, "float8_e4m3fn left to torch")],
    "scaled_mm": [(SCALED_MM_E4M3FN, "tensor-wise and row-wise float8_e4m3fn _scaled_mm_v2 left to torch")],
}


def has(native: Native, version: str) -> bool:
    """Whether torch `version` has that kernel."""
    return torch_version(version) >= native.since


def torch_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def left_to_torch(family: str, version: str) -> dict[str, str]:
    """The aten ops of `family` that mps_ext leaves to torch `version` on
    MPS, each with the reason."""
    out = {}
    for native in NATIVE.get(family, []):
        if has(native, version):
            out.update({op: native.what for op in native.ops})
    return out


def steps_aside(family: str, ops: list[str], version: str) -> str | None:
    """Why mps_ext does not install `family` (whose aten ops are `ops`) on
    torch `version`: every op is left to torch. None if it installs it."""
    left = left_to_torch(family, version)
    if ops and all(op in left for op in ops):
        return "; ".join(sorted(set(left.values())))
    return None


def mm_min_rows(version: str) -> int:
    """Fewest rows (or columns) of an mm/addmm product mps_ext takes on MPS
    with torch `version`."""
    return 2 if has(MM_ONE_ROW_GEMV, version) else 1


def fp8_e4m3fn_native(version: str) -> bool:
    """Whether torch `version` handles float8_e4m3fn tensors and tensor-wise
    and row-wise e4m3fn scaled_mm on MPS itself."""
    return has(FP8_E4M3FN, version)


def partly_left_to_torch(family: str, version: str) -> list[str]:
    """What `family` leaves to torch `version` on MPS for some inputs."""
    return [which for native, which in PARTLY_NATIVE.get(family, []) if has(native, version)]
