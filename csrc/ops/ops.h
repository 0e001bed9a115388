// The ops of mps_ext, as the op layer implements them once for every backend.
// Each checks its arguments (torch's messages), allocates its output, picks
// a kernel variant and launch geometry, and launches through backend/launch.h.
// `*_unsupported` returns why an input goes to the stock kernel instead
// (none: mps_ext handles it; a Reason, dispatch/registry.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/Scalar.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "dispatch/registry.h"

namespace mps_ext {

// The float dtypes the attention layer's kernels take (attention_gate.cpp,
// kv_cache.cpp): an error naming the op and argument for any other.
inline void check_float(const at::Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "mps_ext ", op, ": ", name,
              " must be float32, float16 or bfloat16, got ", dt);
}

// A kernel parameter's element stride of dim `d` of `t`: 0 where the size is 1
// (a dim of one may have any stride; 0 reads the same element, as a
// broadcast does), as uint32, the width the params structs hold.
inline uint32_t stride_or_zero(const at::Tensor& t, int64_t d) {
  const int64_t s = t.size(d) > 1 ? t.stride(d) : 0;
  TORCH_CHECK(s >= 0 && s <= static_cast<int64_t>(UINT32_MAX), "mps_ext: a stride of ", s, " elements (dim ", d,
              " of a tensor of shape ", t.sizes(),
              ") does not fit the kernel's 32-bit offsets; pass a contiguous tensor");
  return static_cast<uint32_t>(s);
}

// softmax.cpp: _softmax / _log_softmax and their backward.
Reason softmax_unsupported(const at::Tensor& self);
at::Tensor softmax_forward(const at::Tensor& self, int64_t dim, bool half_to_float, bool log);
Reason softmax_backward_unsupported(const at::Tensor& grad, const at::Tensor& output, c10::ScalarType input_dtype);
at::Tensor softmax_backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim, c10::ScalarType input_dtype,
                            bool log);

// pad.cpp: constant_pad_nd.
Reason pad_unsupported(const at::Tensor& self, c10::IntArrayRef pad);
at::Tensor constant_pad(const at::Tensor& self, c10::IntArrayRef pad, const c10::Scalar& value);

// linear.cpp: aten::linear, aten::mm, aten::addmm (and their out= forms):
// 1 to 8 activation rows as GEMVs; more rows (prefill) in float16 and
// bfloat16 as gmm_tiled's dense product (grouped_mm.cpp's dense_tiled).
Reason linear_unsupported(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// attention_gate.cpp: torch.ops.mps_ext.sigmoid_gate, x * sigmoid(gate)
// (linear.cpp's sigmoid_gate_linear runs it, then F.linear, where its
// kernel does not take a call).
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& gate);
// `op`: the aten op called ("aten::mm.out"); `self`: addmm's bias (nullptr
// for mm); `key`: the dispatch key called (a
// policy rule may leave one-row products on it to torch's own GEMV:
// mps_ext/_policy.py; F.linear keeps one row, torch's aten::linear does not
// use that GEMV).
Reason mm_unsupported(const RoutedOp& op, const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor* self,
                      c10::DispatchKey key);
// Why the out= forms do not write into `out` (none if they do).
Reason out_unsupported(const at::Tensor& out, const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor* self);
at::Tensor mm(const at::Tensor& mat1, const at::Tensor& mat2);
at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                 const c10::Scalar& alpha);
at::Tensor& mm_out(const at::Tensor& mat1, const at::Tensor& mat2, at::Tensor& out);
at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                      const c10::Scalar& alpha, at::Tensor& out);

// grouped_mm.cpp: _grouped_mm and _scaled_grouped_mm (mixture-of-experts layers).
Reason grouped_mm_unsupported(const at::Tensor& a, const at::Tensor& b);
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs,
                      const c10::optional<at::Tensor>& bias, c10::optional<c10::ScalarType> out_dtype);
// A dense product out [M, N] = a [M, K] @ b [K, N] (2-D strided views, one
// dtype, out not overlapping a or b): gmm_tiled in its batched mode with one
// group, which reads no offsets (linear.cpp's prefill calls).
Reason dense_tiled_unsupported(const at::Tensor& a, const at::Tensor& b);
void dense_tiled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);
// fp8_linear's product past 8 rows (scaled_mm.cpp): out [M, N] = a [M, K]
// @ (b [K, N] * scale), a and out float16 or bfloat16, b float8_e4m3fn,
// scale float32 of one element (tensor-wise) or [N] contiguous (one per
// output column): gmm_tiled_dense_<a>_e4m3w, the scale applied to the float
// sums. The caller checks dense_tiled_unsupported(a, b) first.
void dense_tiled_fp8(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale, const at::Tensor& out);
Reason scaled_grouped_mm_unsupported(const at::Tensor& a, const at::Tensor& b);
at::Tensor scaled_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const c10::optional<at::Tensor>& offs,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale_result,
                             c10::optional<c10::ScalarType> out_dtype);
// The fused MoE decode ops (moe.cpp): one grouped product at
// decode, optionally gathering each row's token and fusing silu(gate) * up.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& weight_scale,
                       const at::Tensor& offs, const c10::optional<at::Tensor>& slot_of_row, int64_t slots_per_token,
                       bool swiglu);

}  // namespace mps_ext
