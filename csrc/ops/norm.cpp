// torch.ops.mps_ext.rms_norm: transformers' RMSNorm modules in one dispatch
// (kernels_metal/norm.metal), for mps_ext.optimize (mps_ext/fused_norm.py).
// Eager, each is 6 to 8 aten ops a token, four or more per decoder layer
// (input and post-attention norms, the attention's q and k norms). Its own
// op rather than an override of aten::rms_norm: the models do not call that
// op, and their rounding steps (normed rounded to the model's dtype before
// the weight multiplies it, or 1 + weight in float32) are not its.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "backend/launch.h"
#include "norm_params.h"
#include "ops/kernel_choice.h"
#include "ops/registration.h"
#include "ops/registry.h"

namespace mps_ext {
namespace {

constexpr int64_t kMaxRow = int64_t(RMS_NORM_MAX_THREADS) * RMS_NORM_PER_THREAD;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view variant) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "mps_ext rms_norm: x must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(x.dim() >= 1, "mps_ext rms_norm: x must have a last dimension to normalise, got a 0-d tensor");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == dt,
              "mps_ext rms_norm: weight must be 1-D of x's last dimension (", n, ") in x's dtype (", dt, "), got ",
              weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), "mps_ext rms_norm: x is on ", x.device(), " and weight on ",
              weight.device());
  const bool zero_centred = variant == "zero_centred";
  TORCH_CHECK(zero_centred || variant == "weight", "mps_ext rms_norm: variant must be 'weight' (out = weight * "
              "normed.to(dtype): Llama, Qwen3, LFM2) or 'zero_centred' (out = (normed * (1 + weight)).to(dtype): "
              "Qwen3-Next, Qwen3.5, Gemma), got '", std::string(variant), "'");
  TORCH_CHECK(n >= 1 && n <= kMaxRow, "mps_ext rms_norm: rows of 1 to ", kMaxRow, " elements are supported (a "
              "thread keeps ", RMS_NORM_PER_THREAD, " in registers), got ", n);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  at::Tensor rows_view = x.reshape({-1, n});  // a view when the leading dimensions collapse
  if (rows_view.stride(1) != 1) rows_view = rows_view.contiguous();
  const int64_t rows = rows_view.size(0);
  const int64_t row_stride = rows > 1 ? rows_view.stride(0) : n;
  TORCH_CHECK(fits_32bit((rows - 1) * row_stride + n) && fits_32bit(rows * n),
              "mps_ext rms_norm: tensors past 2^31 elements are not supported, got ", rows, " rows of ", n);
  const at::Tensor w = weight.contiguous();
  // Team: the fewest threads (a power of two, at least a simdgroup) that
  // hold the row at RMS_NORM_PER_THREAD elements each.
  uint32_t shift = 5;
  while ((int64_t(1) << shift) * RMS_NORM_PER_THREAD < n) ++shift;
  const int64_t team = int64_t(1) << shift;
  const int64_t teams = ceil_div(rows, RMS_NORM_ROWS_PER_TEAM);
  const int64_t teams_per_group = std::max<int64_t>(1, std::min<int64_t>(RMS_NORM_GROUP_THREADS / team, teams));
  RmsNormParams p{};
  p.rows = static_cast<uint32_t>(rows);
  p.n = static_cast<uint32_t>(n);
  p.row_stride = static_cast<uint32_t>(row_stride);
  p.team_shift = shift;
  p.teams = static_cast<uint32_t>(teams);
  p.iterations = static_cast<uint32_t>(ceil_div(rows, teams));
  p.zero_centred = zero_centred ? 1u : 0u;
  p.eps = static_cast<float>(eps);  // torch adds a Python float to a float32 tensor as a float32
  launch(Launch{"norm", std::string("rms_norm_") + kernel_type_name(dt),
                {KernelArg::of(out), KernelArg::of(rows_view), KernelArg::of(w), KernelArg::value(p)},
                {static_cast<uint32_t>(ceil_div(teams, teams_per_group)), 1, 1},
                {static_cast<uint32_t>(teams_per_group * team), 1, 1}});
  return out;
}

using c10::DispatchKey;

const RoutedOp kRmsNorm(FamilyId::norm, "mps_ext::rms_norm");

template <DispatchKey K>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view variant) {
  return run_own(kRmsNorm, K, [&] { return rms_norm(x, weight, eps, variant); });
}

// The family overrides no aten op: its one op is mps_ext's own.
template <DispatchKey K>
void register_norm(torch::Library&) {}

}  // namespace
}  // namespace mps_ext

// Its Meta (fake) kernel, for torch.compile, is in mps_ext/_meta.py.
TORCH_LIBRARY_FRAGMENT(mps_ext, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, str variant=\"weight\") -> Tensor");
}

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) { m.impl("rms_norm", TORCH_FN(mps_ext::rms_norm_impl<c10::DispatchKey::CPU>)); }

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) { m.impl("rms_norm", TORCH_FN(mps_ext::rms_norm_impl<c10::DispatchKey::MPS>)); }
#endif

MPS_EXT_FAMILY_OWN_META(norm, mps_ext::register_norm, )
