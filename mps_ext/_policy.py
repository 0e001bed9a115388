"""Where mps_ext's kernels help, and where torch's own are as good.

One table, read at import: an aten op is overridden on the MPS key only on
torch releases older than the one that shipped an equal kernel of its own;
from that release on, mps_ext leaves the op to torch (a family whose every op
is left to torch is not installed at all). A rule may leave only some calls
of an op to torch: not those with a dtype or an argument value torch's
kernel refuses, or only those the op's own code picks by what torch's kernel
takes (a row count, a scale recipe). The policy applies to the MPS
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
    # Not calls with a tensor argument of these dtypes (torch's names:
    # "complex64"), nor those with these bool argument values (name, value):
    # inputs torch's kernel refuses, which mps_ext keeps.
    kept_dtypes: tuple[str, ...] = ()
    kept_args: tuple[tuple[str, bool], ...] = ()
    # Only the calls the op's own code picks (csrc/ops/: linear.cpp's
    # mm_unsupported, fp8_mm.cpp's policy), in words: for a choice the
    # arguments' dtypes and bools do not express.
    calls: str = ""

    def __post_init__(self):
        # route (csrc/ops/registry.h) applies kept dtypes and arguments; an op
        # that picks its calls is handed the rule alone.
        if self.calls and (self.kept_dtypes or self.kept_args):
            raise ValueError(f"{self.ops}: a rule whose calls the op picks keeps no dtypes or arguments")

    def whole(self) -> bool:
        """Every call of the ops is left to torch."""
        return not (self.kept_dtypes or self.kept_args or self.calls)

    def scope(self) -> str:
        """Which calls, in words: '' for all."""
        parts = [self.calls] if self.calls else []
        parts += [f"not {dtype}" for dtype in self.kept_dtypes]
        parts += [f"not {name}={value}" for name, value in self.kept_args]
        return "; ".join(parts)


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
         "constant_pad_nd_dense_<dtype> for contiguous input, 15 dtypes (bool, char, uchar, short, ushort, int, "
         "uint, long, ulong, half, bfloat, float, half2, float2, float8_e4m3fn); none for float8_e5m2 or the "
         "other float8 formats",
         "kernels/Pad.h (new in 2.15: ConstantPadNdParams, ConstantPadDenseParams); dylib: 45 "
         "constant_pad_nd_* kernels (constant_pad_nd_{dense_<dtype>,<dtype>_u32,<dtype>_u64} for the 15 dtypes "
         "above) and the strings 'constant_pad_nd_dense_', 'constant_pad_nd_{}{}'"),
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
         "torch's copy, fill, cat, pad, eye, eq/ne, gather and scatter kernels, .item() "
         "(_local_scalar_dense) and torch.equal (eq, then all); no float8 lt/le/gt/ge; float8_e5m2: none, "
         "as before",
         "c10/metal/float8.h (new in 2.15: fp8e4m3fn_to_fp32, fp8e4m3fn_from_fp32, struct float8_e4m3fn, "
         "nothing for e5m2); C10_METAL_ALL_TYPES_FUNCTOR gains Float8_e4m3fn; MPSScalar's value union gains "
         "c10::Float8_e4m3fn (native/mps/OperationUtils.h); dylib: the only float8 kernel instantiations are "
         "copy_*, cat_*, constant_pad_nd_*, eq_*, ne_*, eye_*, gather_*, scatter_set_* and scaled_mm_* of "
         "float8_e4m3fn, none for e5m2; torch/testing/_internal/common_methods_invocations.py lists "
         "float8_e4m3fn for item, cat, constant_pad_nd, eye (dtypes) and gather, scatter, _scaled_mm_v2 "
         "(dtypesIfMPS); operations/Scalar.mm (_local_scalar_dense_mps dispatches Float8_e4m3fn, pytorch PR "
         "197383), operations/Equal.cpp (mps_equal: at::mps::eq(...).all().item())"),
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
    "linalg": [
        ("2.9-2.13", "Apple's MPS matrix kernels, float32 only: LU by MPSMatrixDecompositionLU (linalg_lu_factor_ex; "
         "2.9 also linalg_lu_factor), solves by MPSMatrixSolveLU and MPSMatrixSolveTriangular; complex64 LU, "
         "triangular solves and inverses are refused, and so is LU without pivoting; linalg_lu_solve has no MPS "
         "kernel at all (nor linalg_lu in 2.9); lu_unpack: 2.9 its own MPS kernel (tril, triu, diagonal fills and "
         "copies; pivots not checked), 2.10 on the generic structured kernel, whose unpack_pivots_* runs after a "
         "range check of the pivots read back to the CPU",
         "native_functions.yaml (MPS: linalg_lu_factor_ex_out_mps, linalg_solve_triangular_mps, "
         "triangular_solve_mps_out, linalg_inv_ex_out_mps, _linalg_solve_ex_out_mps; none for linalg_lu_solve); the "
         "dylib links _OBJC_CLASS_$_MPSMatrixDecompositionLU, MPSMatrixSolveLU, MPSMatrixSolveTriangular and has "
         "no LU kernel of its own; strings \"linalg.lu_factor(): MPS doesn't support complex types.\", \"MPS doesn't "
         "allow pivot == False.\", \"linalg_inv: not supported for complex types yet!\" (and in 2.9 "
         "\"linalg.solve.triangular(); Not supported for complex yet!\"); structured_lu_unpack_out_mps::impl "
         "(2.9) calls sub, fill_, tril, triu, diagonal, copy_ and no item; unpack_pivots_stub_impl (2.10 on) calls "
         "le, ge, logical_and, _is_all_true and item<bool>; tools/linalg_entry_points.py"),
        ("2.14", "float32 LU in torch's own Metal kernels (a blocked right-looking getrf: factorPanelLU or "
         "luStreamUpdate/luStreamPivot panels, laswpGatherLU, trsmPanelLU, gemmLU/gemmSimdLU trailing updates, "
         "transposeInPlaceLU) and a Metal linalg_lu_solve (luApplyPivotsRHS, trsmDiagSolveLU), float32 only; "
         "triangular solves still MPSMatrixSolveTriangular (float only); complex64 LU, solves and inverses and LU "
         "without pivoting still refused",
         "kernels/LinearAlgebra.h (new in 2.14: kLUStreamNT 'for LU streaming-panel kernels'); dylib: "
         "factorPanelLU_{1_32,2_16,4_8}, luStream{Update,Pivot}, gemmLU_*, trsmDiagSolveLU_* without a dtype "
         "suffix (float only), no MPSMatrixDecompositionLU; strings \"linalg.lu_solve(): MPS only supports "
         "float32.\", \"linalg.solve.triangular(); Only float is supported!\", \"MPS doesn't support complex "
         "types.\", \"MPS doesn't allow pivot == False.\""),
        ("2.15", "LU (linalg_lu_factor_ex) in Metal for float32 and complex64, pivot=False still refused; "
         "triangular solves in Metal (triangular_solve_{float,float2}, triangular_solve_small_* for n = 16/32/64 "
         "with MPP variants), float32 and complex64; linalg_lu_solve and _linalg_solve_ex (LU, then "
         "luApplyPivotsRHS and two trsmDiagSolveLU) for float32 and complex64; linalg_inv_ex: float32 matrices up "
         "to 4x4 one thread each in registers (luInvSmall_1..4), larger ones by LU and solve; complex64 inverses "
         "still refused, before any kernel runs; _linalg_det/_linalg_slogdet: their structured kernels over "
         "linalg_lu_factor_ex_out (so Metal), then diagonal/prod/mul (and abs, log, sum); lu_unpack: the generic "
         "structured kernel (tril_out, triu_out, a fill_ of the diagonal, arange + expand, unpack_pivots_* after a "
         "range check of the pivots read back to the CPU, zero_, scatter_)",
         "kernels/LinearAlgebra.h (new in 2.15: TriangularSolveParams, kLUSmallInvMax = 4, LUSmallInvParams, "
         "LUStreamScratch<T> 'T is float or c10::metal::complex<float>'); dylib: factorPanelLU_{float,float2}_*, "
         "luStream*_{float,float2}, triangular_solve_float(2), triangular_solve_small_*, luApplyPivotsRHS_float(2), "
         "trsmDiagSolveLU_float(2)_*, luInvSmall_1..4 (only air.fabs.f32: float32), unpack_pivots_*; strings "
         "\"linalg.lu_factor(): MPS supports float32 and complex64 inputs\", \"MPS doesn't allow pivot == False.\", "
         "\"linalg.solve_triangular(): MPS only supports float32 and complex64\", \"linalg_inv: not supported for "
         "complex types yet!\" (loaded by structured_linalg_inv_ex_out_mps::impl when the dtype is complex, before "
         "'luInvSmall_{}'); unpack_pivots_stub_impl calls le, ge, logical_and, _is_all_true and item<bool>; "
         "tools/linalg_entry_points.py"),
    ],
    "grouped_mm": [
        ("2.9-2.14", "_grouped_mm has no MPS kernel: its CompositeExplicitAutograd kernel runs "
         "_grouped_mm_fallback, which copies offs to the CPU (a sync on every call) and runs one mm_out per group "
         "(bmm for 3D x 3D); _scaled_grouped_mm (and _scaled_grouped_mm_v2, from 2.10) are CUDA only. "
         "F.grouped_mm (-> _grouped_mm) and F.scaled_grouped_mm (-> _scaled_grouped_mm_v2) exist from 2.10",
         "torch/include/ATen/ops/: _grouped_mm_compositeexplicitautograd_dispatch.h and _grouped_mm_cuda_dispatch.h, "
         "no _grouped_mm_mps_dispatch.h; _scaled_grouped_mm_cuda_dispatch.h (and _scaled_grouped_mm_v2_cuda_dispatch.h) "
         "only; ATen/native/GroupedMMUtils.h: _grouped_mm_fallback ('auto offs_cpu = offs.value().cpu();', then "
         "offs_cpu[group_idx].item<int>() per group); tests/ops/test_grouped_mm.py sees that copy in the installed "
         "torch's CPU kernel; torch/nn/functional.py of 2.9 has neither grouped_mm nor scaled_grouped_mm, 2.10-2.14 "
         "both; ATen/ops/_scaled_grouped_mm_v2.h from 2.10"),
        ("2.15", "_grouped_mm_mps: Metal kernels launched from shapes alone (the jagged grid axis sized for the worst "
         "case of one partial tile per group; the kernel discards the excess tiles), offs read only on the GPU: a "
         "few-rows kernel for up to 32 rows with no more rows than groups and K contiguous in both operands "
         "(grouped_mm_few_rows_<dtype>: a threadgroup of 16 simdgroups per row of a and 16 output columns), "
         "otherwise simdgroup_matrix tiles of 16/32/64 rows by 64 columns (grouped_mm_{rows,k}_<dtype>_bm*; "
         "matmul2d tiles on GPUs with Metal Performance Primitives); 3D x 3D by bmm; a new same-dtype check. "
         "_scaled_grouped_mm and _scaled_grouped_mm_v2 are still CUDA only",
         "torch/include/ATen/ops/_grouped_mm_mps_dispatch.h (new in 2.15); ATen/native/mps/kernels/GroupedMM.h (new "
         "in 2.15: kGroupedMMFewRowsMax = 32, kGroupedMMFewRowsSimdgroups = 16, GroupedMMParams<idx_t>); "
         "GroupedMMUtils.h: 'Expected mat_a and mat_b to have the same dtype'; no _scaled_grouped_mm*_mps_dispatch.h; "
         "pytorch/pytorch aten/src/ATen/native/mps/operations/GroupedMM.mm (grouped_mm_out_mps, _grouped_mm_mps), "
         "whose constants and parameter struct are those of the 2.15 header"),
    ],
}

# Ops mps_ext leaves to torch from a release on.
NATIVE: dict[str, list[Native]] = {
    "softmax": [Native(
        (2, 15), ("aten::_softmax", "aten::_log_softmax"),
        "torch 2.15 splits long softmax rows over many threadgroups itself (its backward stays MPSGraph, so "
        "mps_ext keeps the backward)", HISTORY["softmax"][1][2])],
    # torch 2.15's pad kernels cover every dtype mps_ext pads except the float8
    # formats other than e4m3fn (a float8_e5m2 tensor on MPS is mps_ext's
    # own): those stay.
    "pad": [Native((2, 15), ("aten::constant_pad_nd",), "torch 2.15 has Metal constant_pad_nd kernels",
                   HISTORY["pad"][1][2],
                   kept_dtypes=("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))],
    # Op by op on torch 2.15 (HISTORY["linalg"][2] says what torch has):
    # - LU: torch's blocked getrf spreads a matrix over many threadgroups, with
    #   its trailing updates as GEMMs; mps_ext's factors a matrix in one
    #   threadgroup. Nothing measurable here shows ours as good, so torch
    #   keeps it, except LU without pivoting, which torch refuses ("MPS
    #   doesn't allow pivot == False.").
    # - Triangular solves, LU solves, solve, det and slogdet run on torch's
    #   Metal LU and triangular kernels: left to torch. (For matrices up to
    #   4x4 mps_ext factors and solves in one dispatch where torch runs an LU
    #   and then luApplyPivotsRHS and two trsmDiagSolveLU, but that count is
    #   read from torch's kernel names, not measured; not taken as evidence.)
    # - Inverse: float32 left to torch, whose luInvSmall inverts matrices up
    #   to 4x4 in one thread each as mps_ext's does (and larger ones by its
    #   LU); complex64 stays: torch 2.15 refuses it before any kernel runs.
    # - lu_unpack stays: torch's is the generic structured kernel, 12 aten
    #   calls on MPS (tril_out, triu_out, fill_ of the diagonal, arange,
    #   expand().contiguous(), le, ge, logical_and, _is_all_true and a read
    #   back, unpack_pivots_*, zero_, scatter_), each a dispatch reading or
    #   writing whole matrices; mps_ext's writes P, L and U in one dispatch
    #   that reads LU and the pivots once and writes each output once
    #   (tests/ops/test_linalg.py counts it), after the same pivot range
    #   check with the same read back (4 small dispatches; none on torch
    #   2.9, whose MPS lu_unpack does not check: csrc/ops/linalg.cpp).
    "linalg": [
        Native((2, 15), ("aten::linalg_lu_factor_ex", "aten::linalg_lu"),
               "torch 2.15 has its own Metal LU for float32 and complex64", HISTORY["linalg"][2][2],
               kept_args=(("pivot", False),)),
        Native((2, 15), ("aten::linalg_solve_triangular", "aten::triangular_solve", "aten::linalg_lu_solve",
                         "aten::_linalg_solve_ex", "aten::_linalg_det", "aten::_linalg_slogdet"),
               "torch 2.15 has its own Metal LU and triangular solves for float32 and complex64",
               HISTORY["linalg"][2][2]),
        Native((2, 15), ("aten::linalg_inv_ex",), "torch 2.15 has its own Metal float32 inverse",
               HISTORY["linalg"][2][2], kept_dtypes=("complex64",)),
    ],
    # grouped_mm on torch 2.15 (HISTORY["grouped_mm"][1]): torch's own
    # _grouped_mm no longer reads offs on the CPU, and by its source it streams
    # each chosen expert's weights once per decode row (few-rows kernel) or per
    # 16-row tile, in one dispatch: the minimum traffic and dispatch count
    # mps_ext's kernels reach (benchmarks/bench_moe.py). Where they differ
    # (mps_ext's 16-byte weight loads and one read for up to 8 rows of an
    # expert; torch's matmul2d prefill tiles) only a Mac can time, so torch
    # keeps _grouped_mm. _scaled_grouped_mm stays: no release has an MPS
    # kernel for it.
    "grouped_mm": [
        Native((2, 15), ("aten::_grouped_mm",), "torch 2.15 has its own Metal _grouped_mm, which reads offs only "
               "on the GPU", HISTORY["grouped_mm"][1][2]),
    ],
    # torch 2.14 gave aten::mm and aten::addmm a GEMV of their own for a
    # single row (or column); mps_ext keeps 2 to 8 rows there (speculative
    # decoding, beam search, small batches), and F.linear's single row, which
    # torch's aten::linear does not send to that GEMV.
    "linear": [Native((2, 14), ("aten::mm", "aten::addmm", "aten::mm.out", "aten::addmm.out"),
                      "torch 2.14 has its own one-row GEMV for mm and addmm",
                      HISTORY["linear"][1][2], calls="one row")],
    # torch 2.15 handles float8_e4m3fn tensors on MPS (not float8_e5m2), and
    # tensor-wise and row-wise float8_e4m3fn _scaled_mm_v2 products with the
    # outputs and bias dtypes its kernel takes; mps_ext keeps float8_e5m2,
    # the block-wise recipes, _scaled_mm (v1) and what torch's kernel rejects.
    # Of the fp8 family's value ops (csrc/ops/fp8_ops.cpp), torch 2.15 has for
    # float8_e4m3fn on MPS only those with float8 kernels or float8 in their
    # host dispatch: .item() (_local_scalar_dense_mps dispatches
    # Float8_e4m3fn), eq/ne (eq_*/ne_*_float8_e4m3fn kernels), torch.equal
    # (mps_equal: eq, all, item) and gather (gather_*_float8_e4m3fn). It has
    # no float8 lt/le/gt/ge kernel; indexing, index_put_, where,
    # masked_fill_, repeat and flip are not shown to take float8 (their
    # kernels are instantiated by element size or built by MPSGraph, which
    # has no float8 type), so mps_ext keeps them for both formats.
    "fp8": [Native((2, 15), ("aten::copy_", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_", "aten::cat",
                             "aten::index_select", "aten::_local_scalar_dense", "aten::eq.Tensor", "aten::eq.Scalar",
                             "aten::ne.Tensor", "aten::ne.Scalar", "aten::equal", "aten::gather"),
                   "torch 2.15 has float8_e4m3fn tensors on MPS", HISTORY["fp8"][1][2],
                   kept_dtypes=("float8_e5m2",))],
    "scaled_mm": [Native((2, 15), ("aten::_scaled_mm_v2",),
                         "torch 2.15's _scaled_mm_v2 runs tensor-wise and row-wise float8_e4m3fn products on MPS",
                         HISTORY["scaled_mm"][2][2],
                         calls="tensor-wise and row-wise float8_e4m3fn, with outputs and bias torch's kernel "
                               "takes, K and N, operand storage offsets and strides multiples of 16")],
}


def torch_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def left_to_torch(family: str, version: str) -> dict[str, Native]:
    """The aten ops of `family` that mps_ext leaves (in all or some calls)
    to torch `version` on MPS, each with its rule."""
    out = {}
    for native in NATIVE.get(family, []):
        if torch_version(version) >= native.since:
            out.update({op: native for op in native.ops})
    return out


def steps_aside(family: str, ops: list[str], version: str) -> str | None:
    """Why mps_ext does not install `family` (whose aten ops are `ops`) on
    torch `version`: every call of every op is left to torch. None if it
    installs it."""
    left = left_to_torch(family, version)
    if ops and all(op in left and left[op].whole() for op in ops):
        return "; ".join(sorted({native.what for native in left.values()}))
    return None
