// Scaled matrix products with float8 operands: aten::_scaled_mm,
// aten::_scaled_mm_v2 (F.scaled_mm) and mps_ext::fp8_linear (the weight-only
// FP8 linear of mps_ext.quantize_fp8). Kernels: kernels_metal/scaled_mm.metal.
//
// Recipes (scales are fp32 de-quantisation multipliers):
//   tensor-wise  one scale per operand                         (_scaled_mm, v2 recipe 0/0)
//   row-wise     scale_a [M, 1], scale_b [1, N]                (_scaled_mm, v2 recipe 1/1)
//   1x128 x 128x128  scale_a [M, ceil(K/128)], scale_b [round_up(ceil(K/128), 4), ceil(N/128)]  (v2 4/5)
//   1x128 x 1x128    scale_a [M, ceil(K/128)], scale_b [N, ceil(K/128)]                        (v2 4/4)
// (torch's layouts: set_scales). Inputs
// torch rejects go to torch's own kernel where there is one (its error
// message); on MPS, where torch 2.9-2.14 has none, mps_ext raises.
#include <ATen/ATen.h>

#include <algorithm>

#include "backend/launch.h"
#include "fp8_params.h"
#include "ops/fp8.h"
#include "ops/norm.h"
#include "ops/ops.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

uint32_t type_code(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return FP8_TYPE_F32;
    case at::kHalf: return FP8_TYPE_F16;
    case at::kBFloat16: return FP8_TYPE_BF16;
    case at::kFloat8_e4m3fn: return FP8_TYPE_E4M3;
    case at::kFloat8_e5m2: return FP8_TYPE_E5M2;
    default: return FP8_TYPE_NONE;
  }
}

// The activation's name in kernel names: fp8 for both float8 formats (the
// kernel reads the format from the parameters).
const char* act_name(c10::ScalarType t) { return is_fp8(t) ? "fp8" : kernel_type_name(t); }

// Rows of a matrix contiguous along K, each starting 16-byte aligned.
bool rows_vectorizable(const at::Tensor& t, int64_t k_stride, int64_t row_stride, int64_t rows) {
  return k_stride == 1 && aligned16(t, rows > 1 ? row_stride : 0);
}

// One scaled product: a [M, K] (fp8, or f32/f16/bf16 for fp8_linear),
// w [N, K] fp8, y [M, N] written in its dtype. With `norm`
// (rms_norm_fp8_linear, at most kMaxDecodeRows rows), a is rms_norm(norm->x),
// norm->normed, which the decode kernel computes itself.
struct Problem {
  at::Tensor a, w, y;
  at::Tensor scale_a, scale_b, bias, scale_result;  // undefined: absent
  Fp8MatmulParams p{};
  const NormedRows* norm = nullptr;
};

// The variant policy.
// - M <= 8 rows: fp8_gemv with R = the smallest of 1, 2, 4, 8 holding them;
//   decode_geometry (dispatch/kernel_choice.h): up to DECODE_MAX_SIMDGROUPS simdgroups of up to
//   FP8_GEMV_OUTPUTS(R, activation bytes) outputs.
// - More rows: fp8_mm_tile, one threadgroup per 64 x 64 outputs
//   (fp8_linear's 16-bit activations with tensor-wise or row-wise scales:
//   gmm_tiled_dense_<act>_e4m3w instead, dense_tile_scale).
// - vec (16-byte loads) when the weight rows and the activation rows are
//   contiguous along K and 16-byte aligned; otherwise element loads
//   (fp8_mm_tile's still load aligned weights 16 bytes at a time: w_vec).
void run(Problem& pr) {
  Fp8MatmulParams& p = pr.p;
  p.m = pr.a.size(0);
  p.k = pr.a.size(1);
  p.n = pr.w.size(0);
  p.a_row_stride = pr.a.stride(0);
  p.a_k_stride = pr.a.stride(1);
  p.w_n_stride = pr.w.stride(0);
  p.w_k_stride = pr.w.stride(1);
  p.y_row_stride = pr.y.stride(0);
  p.y_n_stride = pr.y.stride(1);
  p.a_format = type_code(pr.a.scalar_type());
  p.w_format = type_code(pr.w.scalar_type());
  p.out_type = type_code(pr.y.scalar_type());
  p.has_scale_a = pr.scale_a.defined() ? 1 : 0;
  p.has_scale_result = pr.scale_result.defined() && is_fp8(pr.y.scalar_type()) ? 1 : 0;
  if (pr.bias.defined()) {
    p.bias_type = type_code(pr.bias.scalar_type());
    p.bias_stride = pr.bias.stride(0);
  }
  if (pr.y.numel() == 0) return;
  // The kernels count rows, columns and K in 32 bits.
  TORCH_CHECK(p.m <= INT32_MAX && p.n <= INT32_MAX && p.k <= INT32_MAX,
              "mps_ext scaled_mm: M, N and K must be below "
              "2^31, got ",
              p.m, ", ", p.n, ", ", p.k);

  p.w_vec = rows_vectorizable(pr.w, p.w_k_stride, p.w_n_stride, p.n) ? 1 : 0;
  const bool vec = p.w_vec && rows_vectorizable(pr.a, p.a_k_stride, p.a_row_stride, p.m);
  Launch l;
  l.library = "scaled_mm";
  const std::string act = act_name(pr.a.scalar_type());
  if (p.m <= kMaxDecodeRows) {
    const int64_t rows = row_variant(p.m);
    // reuse: the activation's bytes over the fp8 weight's, per output.
    // The same variant and geometry with the norm as without (they decide
    // the sums' order): rms_norm_fp8_gemv is bit for bit rms_norm, then this.
    l.kernel = std::string(pr.norm ? "rms_norm_fp8_gemv_" : "fp8_gemv_") + act + "_r" + std::to_string(rows) +
               (vec ? "_vec" : "_scalar");
    const DecodeGeometry g =
        fit_threads(decode_geometry(device_profile(pr.w.device()), p.n, 1, FP8_GEMV_OUTPUTS(rows, pr.a.itemsize()),
                                    false, p.m * pr.a.itemsize()),
                    p.n, thread_budget(pr.w.device(), l.library, l.kernel, DECODE_MAX_THREADS));
    p.outputs_per_simdgroup = static_cast<uint32_t>(g.outputs_per_simdgroup);
    l.threadgroups = {static_cast<uint32_t>(g.threadgroups), 1, 1};
    l.threads_per_threadgroup = {static_cast<uint32_t>(32 * g.simdgroups), 1, 1};
  } else {
    TORCH_CHECK(!pr.norm, "mps_ext rms_norm_fp8_linear: at most ", kMaxDecodeRows, " rows");  // (the caller's bound)
    TORCH_CHECK(ceil_div(p.m, FP8_TILE_M) <= 0xffffffffll && ceil_div(p.n, FP8_TILE_N) <= 0xffffffffll,
                "mps_ext scaled_mm: too many tiles");
    l.kernel = "fp8_mm_tile_" + act + (vec ? "_vec" : "_scalar");
    l.threadgroups = {static_cast<uint32_t>(ceil_div(p.n, FP8_TILE_N)),
                      static_cast<uint32_t>(ceil_div(p.m, FP8_TILE_M)), 1};
    l.threads_per_threadgroup = {FP8_TILE_THREADS, 1, 1};
  }
  // Absent operands are stood in for by the output or scale_b; the kernel
  // does not read them (has_scale_a, bias_type, has_scale_result).
  auto or_else = [](const at::Tensor& t, const at::Tensor& stand_in) {
    return KernelArg::of(t.defined() ? t : stand_in);
  };
  l.args = {KernelArg::of(pr.y),
            KernelArg::of(pr.a),
            KernelArg::of(pr.w),
            KernelArg::value(p),
            or_else(pr.scale_a, pr.scale_b),
            KernelArg::of(pr.scale_b),
            or_else(pr.bias, pr.y),
            or_else(pr.scale_result, pr.scale_b)};
  if (pr.norm) {
    // buffer 1 is the norm's input rows; p's activation strides are the
    // normed rows' (pr.a), as the kernel keeps them.
    l.args[1] = KernelArg::of(pr.norm->x);
    l.args.push_back(KernelArg::of(pr.norm->normed));
    l.args.push_back(KernelArg::of(pr.norm->weight));
    l.args.push_back(KernelArg::value(pr.norm->params));
  }
  launch(l);
}

bool fp32_scalar(const at::Tensor& s) { return s.scalar_type() == at::kFloat && s.numel() == 1; }

std::string sizes_of(const at::Tensor& t) { return c10::str(t.sizes(), " (strides ", t.strides(), ")"); }

// Scale strides of a recipe into p (sa: activation, sb: weight), given the
// scale tensors as torch's callers pass them. "" when they are that
// recipe's; otherwise what was wrong and what is accepted.
//
// Block-wise scales are laid out as torch's contract for _scaled_mm_v2
// says, kb = ceil(K / 128):
//   scale_a                [M, kb]
//   scale_b 1x128 x 1x128   [N, kb]   (one row per output column)
//   scale_b 1x128 x 128x128 [round_up(kb, 4), ceil(N / 128)] (rows past kb
//                           are padding, never read)
// _meta_registrations.py of torch 2.10-2.13 (with K // 128, the same for a
// K that is a multiple of 128; a K // 128 scale has no scale for the last,
// partial block, and CUDA's checks take ceil) and the CUDA checks of 2.10-2.15
// (_scaled_block1x128_block1x128, _scaled_block1x128_block128x128) ask for
// these shapes column-major (strides (1, rows)); torch 2.15's meta also names
// row-major ("both scales should be contiguous (row-major or column-major)").
// Both are read here by their strides; any other strides are refused, and so
// is any other shape, among them the transpose [kb, N] of 1x128 x 1x128,
// which, when N == kb, could not be told from torch's layout.
Reason set_scales(Fp8MatmulParams& p, int64_t ra, const at::Tensor& sa, int64_t rb, const at::Tensor& sb, int64_t M,
                  int64_t K, int64_t N) {
  const Reason rejected = because::scales_torch_rejects;
  if (sa.scalar_type() != at::kFloat || sb.scalar_type() != at::kFloat) return rejected;
  p.sb_n_group = 1;
  if (ra == kTensorWise && rb == kTensorWise)  // strides 0
    return sa.numel() == 1 && sb.numel() == 1 ? Reason() : rejected;
  if (ra == kRowWise && rb == kRowWise) {
    if (!(sa.dim() == 2 && sa.size(0) == M && sa.size(1) == 1 && sa.is_contiguous())) return rejected;
    if (!(sb.dim() == 2 && sb.size(0) == 1 && sb.size(1) == N && sb.t().is_contiguous())) return rejected;
    p.sa_row_stride = 1;
    p.sb_n_stride = 1;
    return {};
  }
  if (ra != kBlock1x128 || (rb != kBlock1x128 && rb != kBlock128x128)) return rejected;
  const int64_t kb = ceil_div(K, FP8_SCALE_BLOCK);
  const bool per_column = rb == kBlock1x128;
  const int64_t sb_rows = per_column ? N : (kb + 3) / 4 * 4, sb_cols = per_column ? kb : ceil_div(N, FP8_SCALE_BLOCK);
  auto dense = [](const at::Tensor& t) { return t.is_contiguous() || t.t().is_contiguous(); };
  const bool ok = sa.dim() == 2 && sa.size(0) == M && sa.size(1) == kb && dense(sa) && sb.dim() == 2 &&
                  sb.size(0) == sb_rows && sb.size(1) == sb_cols && dense(sb);
  if (!ok)
    return because::block_scales(
        c10::str("block-wise scales scale_a ", sizes_of(sa), ", scale_b ", sizes_of(sb), "; 1x128 x ",
                 per_column ? "1x128" : "128x128", " takes scale_a [M, ceil(K/128)] = [", M, ", ", kb, "] and scale_b ",
                 per_column ? "[N, ceil(K/128)]" : "[round_up(ceil(K/128), 4), ceil(N/128)]", " = [", sb_rows, ", ",
                 sb_cols, "], each column-major (torch's layout) or row-major"));
  p.sa_row_stride = sa.stride(0);
  p.sa_k_stride = sa.stride(1);
  if (per_column) {
    p.sb_n_stride = sb.stride(0);
    p.sb_k_stride = sb.stride(1);
  } else {
    p.sb_n_group = FP8_SCALE_BLOCK;
    p.sb_k_stride = sb.stride(0);
    p.sb_n_stride = sb.stride(1);
  }
  return {};
}

// Checks shared by both ops; none when mps_ext's kernels take the call.
Reason operands_unsupported(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                            c10::ScalarType out) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0)) return because::shapes_torch_rejects;
  if (!is_fp8(a.scalar_type()) || !is_fp8(b.scalar_type())) return because::operands_not_fp8;
  if (a.layout() != at::kStrided || b.layout() != at::kStrided) return because::not_strided;
  if (type_code(out) == FP8_TYPE_NONE) return because::output_dtype(out);
  if (bias && bias->defined()) {
    if (bias->numel() != b.size(1)) return because::bias_torch_rejects;
    const auto t = bias->scalar_type();
    if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return because::bias_dtype(t);
  }
  return {};
}

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const Fp8MatmulParams& scales, const at::Tensor& sa,
                     const at::Tensor& sb, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& scale_result, c10::ScalarType out) {
  Problem pr;
  pr.p = scales;
  pr.a = a;
  pr.w = b.t();
  pr.y = at::empty({a.size(0), b.size(1)}, a.options().dtype(out));
  pr.scale_a = sa;
  pr.scale_b = sb;
  if (bias && bias->defined()) pr.bias = bias->reshape({b.size(1)});
  if (scale_result && scale_result->defined()) pr.scale_result = *scale_result;
  run(pr);
  return pr.y;
}

// A reason for the stock kernel, or raise where there is none: on MPS
// torch 2.9-2.14 have no _scaled_mm kernel to give their error.
Reason or_raise(Reason why, const RoutedOp& op, c10::DispatchKey key) {
  if (why && !op.has_stock(key))
    TORCH_CHECK(false, "mps_ext ", op.name + 6, " on ", key, ": unsupported input (", why.text(),
                "). Supported: float8 operands (mat2 any layout), tensor-wise or row-wise fp32 scales "
                "(_scaled_mm, _scaled_mm_v2), block-wise 1x128 x 128x128 and 1x128 x 1x128 (_scaled_mm_v2); "
                "outputs float32, float16, bfloat16, float8_e4m3fn, float8_e5m2; bias float32/float16/bfloat16.");
  return why;
}

// torch 2.15's scaled_mm kernels load 16 float8 values at a time and raise
// unless K, N, each operand's storage offset and its leading stride are
// multiples of this (kernels/ScaledMM.h: scaled_mm_alignment; the library's
// "Expected K and N to be divisible by", "storage offset and leading stride
// to be divisible by").
constexpr int64_t kTorchScaledMMAlignment = 16;

// An operand torch 2.15's kernel takes whichever stride it calls leading:
// contiguous along one dimension, the other stride and the storage offset
// multiples of 16. (Other layouts stay with mps_ext, which runs any.)
bool torch_aligned(const at::Tensor& t) {
  auto multiple = [](int64_t v) { return v % kTorchScaledMMAlignment == 0; };
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  return multiple(t.storage_offset()) && ((s1 == 1 && multiple(s0)) || (s0 == 1 && multiple(s1)));
}

// The policy, for an op whose rule leaves to torch the calls picked here
// (mps_ext/_policy.py; on MPS from torch 2.15): torch's _scaled_mm_v2 on MPS
// (operations/ScaledMM.mm) runs tensor-wise and row-wise float8_e4m3fn
// products with outputs f32/f16/bf16/e4m3fn, and a bias only of the output's
// dtype (bf16 or f16) or, for an e4m3fn output, either, on aligned operands
// (torch_aligned); mps_ext keeps what it rejects: the calls of the
// torch_scaled_mm condition. The rule's reason, or none.
Reason policy(const RoutedOp& op, c10::DispatchKey key, const at::Tensor& a, const at::Tensor& b, int64_t recipe,
              c10::ScalarType out, const c10::optional<at::Tensor>& bias) {
  const Reason rule = op.picked(key, Condition::torch_scaled_mm);
  if (!rule || !op.has_stock(key) || recipe > kRowWise || a.scalar_type() != at::kFloat8_e4m3fn ||
      b.scalar_type() != at::kFloat8_e4m3fn || out == at::kFloat8_e5m2)
    return {};
  if (a.size(1) % kTorchScaledMMAlignment != 0 || b.size(1) % kTorchScaledMMAlignment != 0 || !torch_aligned(a) ||
      !torch_aligned(b))
    return {};
  if (bias && bias->defined()) {
    const auto t = bias->scalar_type();
    if (out == at::kFloat || !(t == at::kBFloat16 || t == at::kHalf) || (out != at::kFloat8_e4m3fn && t != out))
      return {};
  }
  return rule;
}

const RoutedOp kScaledMm(FamilyId::scaled_mm, "aten::_scaled_mm"),
    kScaledMmV2(FamilyId::scaled_mm, "aten::_scaled_mm_v2"), kFp8Linear(FamilyId::scaled_mm, "mps_ext::fp8_linear");

template <c10::DispatchKey K>
at::Tensor scaled_mm_impl(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& scale_result, c10::optional<c10::ScalarType> out_dtype,
                          bool use_fast_accum) {
  const c10::ScalarType out = out_dtype.value_or(self.scalar_type());
  Fp8MatmulParams p{};
  Reason why = operands_unsupported(self, mat2, bias, out);
  if (!why) {
    const bool tensorwise = fp32_scalar(scale_a) && fp32_scalar(scale_b);
    const int64_t recipe = tensorwise ? kTensorWise : kRowWise;
    why = set_scales(p, recipe, scale_a, recipe, scale_b, self.size(0), self.size(1), mat2.size(1));
    if (!why && scale_result && scale_result->defined() && !fp32_scalar(*scale_result))
      why = because::scale_result_torch_rejects;
    if (!why) why = policy(kScaledMm, K, self, mat2, kRowWise, out, bias);
  }
  return route<decltype(scaled_mm_impl<K>)>(
      kScaledMm, K, or_raise(why, kScaledMm, K),
      [&] { return scaled_mm(self, mat2, p, scale_a, scale_b, bias, scale_result, out); }, self, mat2, scale_a, scale_b,
      bias, scale_result, out_dtype, use_fast_accum);
}

template <c10::DispatchKey K>
at::Tensor scaled_mm_v2_impl(const at::Tensor& self, const at::Tensor& mat2, at::TensorList scale_a,
                             at::IntArrayRef recipe_a, at::IntArrayRef swizzle_a, at::TensorList scale_b,
                             at::IntArrayRef recipe_b, at::IntArrayRef swizzle_b, const c10::optional<at::Tensor>& bias,
                             c10::optional<c10::ScalarType> out_dtype, at::IntArrayRef contraction_dim,
                             bool use_fast_accum) {
  const c10::ScalarType out = out_dtype.value_or(at::kBFloat16);  // torch's default for v2
  Fp8MatmulParams p{};
  Reason why = operands_unsupported(self, mat2, bias, out);
  auto no_swizzle = [](at::IntArrayRef s) { return s.empty() || (s.size() == 1 && s[0] == 0); };
  if (!why) {
    if (scale_a.size() != 1 || scale_b.size() != 1 || recipe_a.size() != 1 || recipe_b.size() != 1)
      why = because::several_scales;
    else if (!no_swizzle(swizzle_a) || !no_swizzle(swizzle_b)) why = because::swizzled_scales;
    else if (!contraction_dim.empty()) why = because::contraction_dim;
    else if (recipe_a[0] >= kBlock1x128 &&
             (self.scalar_type() != at::kFloat8_e4m3fn || mat2.scalar_type() != at::kFloat8_e4m3fn))
      why = because::block_scales_e5m2;
    else if (!(why = set_scales(p, recipe_a[0], scale_a[0], recipe_b[0], scale_b[0], self.size(0), self.size(1),
                                mat2.size(1))))
      why = policy(kScaledMmV2, K, self, mat2, recipe_a[0], out, bias);
  }
  return route<decltype(scaled_mm_v2_impl<K>)>(
      kScaledMmV2, K, or_raise(why, kScaledMmV2, K),
      [&] { return scaled_mm(self, mat2, p, scale_a[0], scale_b[0], bias, c10::nullopt, out); }, self, mat2, scale_a,
      recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype, contraction_dim, use_fast_accum);
}

// ------------------------------------------------------------ fp8_linear --
// y = input @ dequant(weight).T + bias with the weight kept in float8 and
// de-quantised in registers; the activation stays in its dtype (more
// accurate than quantising it, for the same weight traffic).
// weight_scale by granularity: "tensor" one element, "row" [N, 1], "block"
// [ceil(N/128), ceil(K/128)] (weight blocks of 128 x 128).

// The weight's scale strides for the kernel, after checking every argument.
Fp8MatmulParams linear_params(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_scale,
                              c10::string_view granularity, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && is_fp8(weight.scalar_type()),
              "mps_ext fp8_linear: weight must be a 2-D float8 "
              "tensor, got ",
              weight.scalar_type(), " of ", weight.dim(), " dimensions");
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "mps_ext fp8_linear: input's last dimension (",
              input.dim() ? input.size(-1) : 0, ") must equal the weight's K (", weight.size(1), ")");
  const auto t = input.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16,
              "mps_ext fp8_linear: input must be float32, float16 or bfloat16, got ", t);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat, "mps_ext fp8_linear: weight_scale must be float32");
  const int64_t N = weight.size(0), K = weight.size(1);
  Fp8MatmulParams p{};
  p.sb_n_group = 1;
  if (granularity == "tensor") {
    TORCH_CHECK(weight_scale.numel() == 1, "mps_ext fp8_linear: a tensor-wise weight_scale has one element");
  } else if (granularity == "row") {
    TORCH_CHECK(weight_scale.numel() == N, "mps_ext fp8_linear: a row-wise weight_scale has N = ", N, " elements");
    p.sb_n_stride = weight_scale.dim() ? weight_scale.stride(0) : 0;
  } else if (granularity == "block") {
    TORCH_CHECK(weight_scale.dim() == 2 && weight_scale.size(0) == ceil_div(N, FP8_SCALE_BLOCK) &&
                    weight_scale.size(1) == ceil_div(K, FP8_SCALE_BLOCK),
                "mps_ext fp8_linear: a block-wise weight_scale is [ceil(N/128), ceil(K/128)] = [",
                ceil_div(N, FP8_SCALE_BLOCK), ", ", ceil_div(K, FP8_SCALE_BLOCK), "], got ", weight_scale.sizes());
    p.sb_n_group = FP8_SCALE_BLOCK;
    p.sb_n_stride = weight_scale.stride(0);
    p.sb_k_stride = weight_scale.stride(1);
  } else {
    TORCH_CHECK(false, "mps_ext fp8_linear: granularity must be 'tensor', 'row' or 'block', got '", granularity, "'");
  }
  if (bias && bias->defined())
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == t, "mps_ext fp8_linear: bias must have N = ", N,
                " elements of the input's dtype");
  return p;
}

// The same product through torch's own ops (the weight de-quantised in
// memory): where mps_ext's kernels do not run (turned off, Metal failed).
at::Tensor linear_with_torch_ops(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scale,
                                 c10::string_view granularity, const c10::optional<at::Tensor>& bias) {
  at::Tensor w = weight.to(at::kFloat);
  if (granularity == "block") {
    at::Tensor s = scale.repeat_interleave(FP8_SCALE_BLOCK, 0).repeat_interleave(FP8_SCALE_BLOCK, 1);
    w = w * s.slice(0, 0, w.size(0)).slice(1, 0, w.size(1));
  } else {
    w = w * scale.reshape({granularity == "row" ? w.size(0) : 1, 1});
  }
  return at::linear(input, w.to(input.scalar_type()), bias);
}

// The weight scale as gmm_tiled_dense_<act>_e4m3w reads it (one element, or
// N contiguous) when fp8_linear's call `pr` runs on that tile, else
// undefined. The tile takes the prefill of 16-bit activations (more than
// kMaxDecodeRows rows) on float8_e4m3fn weights with a tensor-wise or
// row-wise scale (applied to the float sums, where fp8_mm_tile scales each
// weight before its products: the same sums up to float32 rounding) and no
// bias: it is gmm_tiled's dense tile, which counted 0.611 of its issue slots
// in useful MMAs where fp8_mm_tile counts 0.516
// (docs/dev/compute_efficiency.md). fp8_mm_tile keeps the rest: block
// scales (a scale per 128 of K inside the sums), a bias (the tile's epilogue
// has none), e5m2 weights (the tile decodes e4m3 only), float32 activations,
// a row-wise scale whose elements are not contiguous, and operands past the
// tile's 32-bit offsets.
at::Tensor dense_tile_scale(const Problem& pr) {
  const auto t = pr.a.scalar_type();
  const int64_t N = pr.w.size(0);
  if (pr.norm || pr.a.size(0) <= kMaxDecodeRows || (t != at::kHalf && t != at::kBFloat16) ||
      pr.w.scalar_type() != at::kFloat8_e4m3fn || pr.bias.defined() || pr.p.sb_n_group != 1 ||
      dense_tiled_unsupported(pr.a, pr.w.t()))
    return {};
  const at::Tensor s = pr.scale_b.reshape({pr.scale_b.numel()});  // tensor-wise: 1 element; row-wise: N
  return s.numel() == 1 || (s.numel() == N && s.stride(0) == 1) ? s : at::Tensor();
}

// fp8_linear's product on mps_ext's kernels, input [..., K]; with `norm`,
// the input's rows are rms_norm(norm->x) (rms_norm_fp8_linear).
at::Tensor fp8_linear_ours(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_scale,
                           const Fp8MatmulParams& p, const c10::optional<at::Tensor>& bias,
                           const NormedRows* norm = nullptr) {
  const int64_t N = weight.size(0), K_ = weight.size(1);
  Problem pr;
  pr.p = p;
  pr.a = input.reshape({-1, K_});
  pr.w = weight;
  pr.y = at::empty({pr.a.size(0), N}, input.options());
  pr.scale_b = weight_scale;
  if (bias && bias->defined()) pr.bias = bias->reshape({N});
  pr.norm = norm;
  const at::Tensor tile_scale = dense_tile_scale(pr);
  if (tile_scale.defined()) dense_tiled_fp8(pr.a, pr.w.t(), tile_scale, pr.y);
  else run(pr);
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = N;
  return pr.y.view(out_shape);
}

// torch has no kernel of its own: the fallback is linear_with_torch_ops.
template <c10::DispatchKey K>
at::Tensor fp8_linear_impl(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_scale,
                           c10::string_view granularity, const c10::optional<at::Tensor>& bias) {
  const Fp8MatmulParams p = linear_params(input, weight, weight_scale, granularity, bias);
  auto ours = [&] { return fp8_linear_ours(input, weight, weight_scale, p, bias); };
  auto theirs = [&](Reason) { return linear_with_torch_ops(input, weight, weight_scale, granularity, bias); };
  return route_to(kFp8Linear, K, Reason(), ours, theirs, input, weight, weight_scale, bias);
}

// ------------------------------------------------- rms_norm_fp8_linear --
// (rms_norm(x), fp8_linear(rms_norm(x), weight, ...)) in one dispatch,
// rms_norm_fp8_gemv: a decoder layer's input norm and the fused projection
// that reads it, quantised by mps_ext.quantize_fp8
// (mps_ext/passes/projections.py, norm_into_projection): linear.cpp's
// rms_norm_linear for FP8Linear. Bit for bit mps_ext.rms_norm then
// fp8_linear: the kernel norms as rms_norm's team would and picks
// fp8_linear's variant and geometry. Every granularity (the block scales
// are fp8_gemv's). 1 to 8 rows whose normed bytes fit the kernel's
// threadgroup memory; larger calls are the two ops.
std::tuple<at::Tensor, at::Tensor> rms_norm_fp8_linear(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                                       c10::string_view variant, const at::Tensor& weight,
                                                       const at::Tensor& weight_scale, c10::string_view granularity,
                                                       const c10::optional<at::Tensor>& bias) {
  const bool zero_centred = check_norm("rms_norm_fp8_linear", x, norm_weight, variant);
  const Fp8MatmulParams p = linear_params(x, weight, weight_scale, granularity, bias);
  TORCH_CHECK(weight.device() == x.device() && weight_scale.device() == x.device() &&
                  (!bias || !bias->defined() || bias->device() == x.device()),
              "mps_ext rms_norm_fp8_linear: weight, weight_scale and bias must be on x's device (", x.device(), ")");
  const int64_t k = x.size(-1), rows = x.numel() / std::max<int64_t>(k, 1);
  if (!gemv_norms_rows(rows, k, x.itemsize()) || weight.size(0) == 0) {
    const at::Tensor normed = rms_norm(x, norm_weight, eps, variant);  // the two ops, as the model's code calls them
    return {normed, fp8_linear_ours(normed, weight, weight_scale, p, bias)};
  }
  at::Tensor normed = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const NormedRows norm = normed_rows("rms_norm_fp8_linear", x, norm_weight, normed, eps, zero_centred);
  return {normed, fp8_linear_ours(normed, weight, weight_scale, p, bias, &norm)};
}

const RoutedOp kRmsNormFp8Linear(FamilyId::scaled_mm, "mps_ext::rms_norm_fp8_linear");

template <c10::DispatchKey K>
std::tuple<at::Tensor, at::Tensor> rms_norm_fp8_linear_impl(const at::Tensor& x, const at::Tensor& norm_weight,
                                                            double eps, c10::string_view variant,
                                                            const at::Tensor& weight, const at::Tensor& weight_scale,
                                                            c10::string_view granularity,
                                                            const c10::optional<at::Tensor>& bias) {
  return run_own(kRmsNormFp8Linear, K, [&] {
    return rms_norm_fp8_linear(x, norm_weight, eps, variant, weight, weight_scale, granularity, bias);
  });
}

// Meta kernels: mps_ext/_meta.py.
template <c10::DispatchKey K>
void register_scaled_mm(FamilyOps& ops) {
  ops.aten("_scaled_mm", TORCH_FN(scaled_mm_impl<K>));
  ops.aten("_scaled_mm_v2", TORCH_FN(scaled_mm_v2_impl<K>));
  ops.own("fp8_linear(Tensor input, Tensor weight, Tensor weight_scale, str granularity, Tensor? bias=None) -> Tensor",
          TORCH_FN(fp8_linear_impl<K>));
  ops.own("rms_norm_fp8_linear(Tensor x, Tensor norm_weight, float eps, str variant, Tensor weight, "
          "Tensor weight_scale, str granularity, Tensor? bias=None) -> (Tensor, Tensor)",
          TORCH_FN(rms_norm_fp8_linear_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY_OWN_META(scaled_mm, mps_ext::register_scaled_mm)
