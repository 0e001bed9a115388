// torch.ops.mps_ext.rms_norm: transformers' RMSNorm modules in one dispatch
// (kernels_metal/norm.metal), for mps_ext.optimize (mps_ext/passes/norm.py);
// torch.ops.mps_ext.add_rms_norm: a decoder layer's residual add and the
// norm after it in the same dispatch (mps_ext/passes/decoder.py);
// torch.ops.mps_ext.qk_norm_rope: an attention's q and k norms and rotary
// embedding in one dispatch (mps_ext.passes.norm.qk_norm_rope);
// torch.ops.mps_ext.qk_norm_rope_append: the same with the KV cache append
// (kv_append) in that dispatch (mps_ext/passes/attention.py).
// Eager, each is 6 to 8 aten ops a token, four or more per decoder layer
// (input and post-attention norms, the attention's q and k norms). Its own
// op rather than an override of aten::rms_norm: the models do not call that
// op, and their rounding steps (normed rounded to the model's dtype before
// the weight multiplies it, or 1 + weight in float32) are not its.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "backend/launch.h"
#include "linear_params.h"
#include "norm_params.h"
#include "ops/norm.h"
#include "ops/ops.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

constexpr int64_t kMaxRow = int64_t(RMS_NORM_MAX_THREADS) * RMS_NORM_PER_THREAD;

}  // namespace

// The checks rms_norm and add_rms_norm share (`op` names the one called);
// whether the variant is zero-centred.
bool check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, c10::string_view variant) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "mps_ext ", op,
              ": x must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(x.dim() >= 1, "mps_ext ", op, ": x must have a last dimension to normalise, got a 0-d tensor");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == dt, "mps_ext ", op,
              ": weight must be 1-D of x's last dimension (", n, ") in x's dtype (", dt, "), got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), "mps_ext ", op, ": x is on ", x.device(), " and weight on ",
              weight.device());
  const bool zero_centred = variant == "zero_centred";
  TORCH_CHECK(zero_centred || variant == "weight", "mps_ext ", op,
              ": variant must be 'weight' (out = weight * "
              "normed.to(dtype): Llama, Qwen3, LFM2) or 'zero_centred' (out = (normed * (1 + weight)).to(dtype): "
              "Qwen3-Next, Qwen3.5, Gemma), got '",
              std::string(variant), "'");
  TORCH_CHECK(n >= 1 && n <= kMaxRow, "mps_ext ", op, ": rows of 1 to ", kMaxRow,
              " elements are supported (a "
              "thread keeps ",
              RMS_NORM_PER_THREAD, " in registers), got ", n);
  return zero_centred;
}

// t [..., n] as rows [rows, n] with a contiguous last dimension: a view
// when the leading dimensions collapse.
at::Tensor norm_rows(const at::Tensor& t, int64_t n) {
  at::Tensor rows = t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

int64_t row_stride_of(const at::Tensor& rows) { return rows.size(0) > 1 ? rows.stride(0) : rows.size(1); }

// Team: the fewest threads (a power of two, at least a simdgroup) that hold
// the row at RMS_NORM_PER_THREAD elements each (rms_norm.h). It decides the
// order of the row's sum, so rms_norm_gemv_rows (linear.cpp) norms with the
// team rms_norm would.
RmsNormParams rms_norm_params(int64_t rows, int64_t n, int64_t row_stride, int64_t residual_row_stride, double eps,
                              bool zero_centred) {
  uint32_t shift = 5;
  while ((int64_t(1) << shift) * RMS_NORM_PER_THREAD < n) ++shift;
  const int64_t teams = ceil_div(rows, RMS_NORM_ROWS_PER_TEAM);
  RmsNormParams p{};
  p.rows = static_cast<uint32_t>(rows);
  p.n = static_cast<uint32_t>(n);
  p.row_stride = static_cast<uint32_t>(row_stride);
  p.residual_row_stride = static_cast<uint32_t>(residual_row_stride);
  p.team_shift = shift;
  p.teams = static_cast<uint32_t>(teams);
  p.iterations = static_cast<uint32_t>(ceil_div(rows, teams));
  p.zero_centred = zero_centred ? 1u : 0u;
  p.eps = static_cast<float>(eps);  // torch adds a Python float to a float32 tensor as a float32
  return p;
}

bool gemv_norms_rows(int64_t rows, int64_t n, int64_t itemsize) {
  return rows >= 1 && rows <= kMaxDecodeRows && rows * n * itemsize <= RMS_GEMV_NORMED_BYTES;
}

NormedRows normed_rows(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& normed,
                       double eps, bool zero_centred, const at::Tensor* residual, const at::Tensor* sum) {
  const int64_t n = x.size(-1);
  NormedRows norm;
  norm.x = norm_rows(x, n);
  const int64_t rows = norm.x.size(0);
  // Without a residual the kernel reads none: x's rows stand in for its stride.
  const at::Tensor& residual_rows = residual ? (norm.residual = norm_rows(*residual, n)) : norm.x;
  TORCH_CHECK(fits_32bit((rows - 1) * std::max(row_stride_of(norm.x), row_stride_of(residual_rows)) + n), "mps_ext ",
              op, ": x past 2^31 elements");
  norm.weight = weight.contiguous();
  norm.normed = normed.view({rows, n});
  if (sum) norm.sum = sum->view({rows, n});
  norm.params = rms_norm_params(rows, n, row_stride_of(norm.x), row_stride_of(residual_rows), eps, zero_centred);
  return norm;
}

namespace {

// Launches op's kernel (rms_norm_<dtype> or add_rms_norm_<dtype>) over the
// rows of `x_rows` [rows, n]; `buffers` are the kernel's tensors before its
// parameters, `residual_rows` add_rms_norm's second input (x_rows itself
// for rms_norm).
void launch_norm(const char* op, std::vector<KernelArg> buffers, const at::Tensor& x_rows,
                 const at::Tensor& residual_rows, double eps, bool zero_centred) {
  const int64_t rows = x_rows.size(0), n = x_rows.size(1);
  const int64_t row_stride = row_stride_of(x_rows), residual_row_stride = row_stride_of(residual_rows);
  TORCH_CHECK(fits_32bit((rows - 1) * std::max(row_stride, residual_row_stride) + n) && fits_32bit(rows * n),
              "mps_ext ", op, ": tensors past 2^31 elements are not supported, got ", rows, " rows of ", n);
  // The pipeline's threads bound the team (rms_norm_params): a longer row
  // is this call's fallback (elements a thread holds are registers, so no
  // team takes more), shorter ones run. Fewer teams per threadgroup under a
  // lower limit change no result: each row is its team's alone.
  const std::string kernel = std::string(op) + "_" + kernel_type_name(x_rows.scalar_type());
  const int64_t budget = thread_budget(x_rows.device(), "norm", kernel, RMS_NORM_MAX_THREADS);
  const RmsNormParams p = rms_norm_params(rows, n, row_stride, residual_row_stride, eps, zero_centred);
  const int64_t team = int64_t(1) << p.team_shift, teams = p.teams;
  if (team > budget) {
    int64_t widest = 32;
    while (2 * widest <= budget) widest *= 2;
    throw CallNotTaken{because::past_pipeline(std::string("row elements"), widest * RMS_NORM_PER_THREAD)};
  }
  const int64_t group_threads = std::min<int64_t>(RMS_NORM_GROUP_THREADS, budget);
  const int64_t teams_per_group = std::max<int64_t>(1, std::min<int64_t>(group_threads / team, teams));
  buffers.push_back(KernelArg::value(p));
  launch(Launch{"norm",
                kernel,
                std::move(buffers),
                {static_cast<uint32_t>(ceil_div(teams, teams_per_group)), 1, 1},
                {static_cast<uint32_t>(teams_per_group * team), 1, 1}});
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view variant) {
  const bool zero_centred = check_norm("rms_norm", x, weight, variant);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t n = x.size(-1);
  const at::Tensor rows = norm_rows(x, n), w = weight.contiguous();
  launch_norm("rms_norm", {KernelArg::of(out), KernelArg::of(rows), KernelArg::of(w)}, rows, rows, eps, zero_centred);
  return out;
}

void check_residual(const char* op, const at::Tensor& x, const at::Tensor& residual) {
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "mps_ext ", op,
              ": residual must have x's shape ", x.sizes(), " and dtype ", x.scalar_type(), " (no broadcasting), got ",
              residual.sizes(), " ", residual.scalar_type());
  TORCH_CHECK(residual.device() == x.device(), "mps_ext ", op, ": x is on ", x.device(), " and residual on ",
              residual.device());
}

// (x + residual, rms_norm(x + residual)), the sum rounded to x's dtype as
// torch's add rounds it: a decoder layer's residual add and the norm after
// it in one dispatch. No broadcasting: residual is x's shape and dtype.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, c10::string_view variant) {
  const bool zero_centred = check_norm("add_rms_norm", x, weight, variant);
  check_residual("add_rms_norm", x, residual);
  auto sum = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return {sum, out};
  const int64_t n = x.size(-1);
  const at::Tensor rows = norm_rows(x, n), residual_rows = norm_rows(residual, n), w = weight.contiguous();
  launch_norm(
      "add_rms_norm",
      {KernelArg::of(out), KernelArg::of(sum), KernelArg::of(rows), KernelArg::of(residual_rows), KernelArg::of(w)},
      rows, residual_rows, eps, zero_centred);
  return {sum, out};
}

namespace {

// The registers a lane needs for a head of D with R rotated (norm_params.h).
int64_t qk_rope_slots(int64_t D, int64_t R) { return 2 * ceil_div(R, 64) + ceil_div(D - R, 32); }

// q [B, T, Hq, D] and k [B, T, Hk, D] (views: the heads of a projection's
// output, last dimension contiguous), cos and sin [B or 1, T, R] as the
// model's rotary embedding returns them: per-head RMSNorm (where a weight is
// given), then the rotary embedding, into q_out [B, Hq, T, D] (contiguous,
// the layout attention takes after the model's transpose(1, 2)) and rows
// k_start .. k_start + T - 1 of k_out [B, Hk, capacity, D] (contiguous).
// With `v` (qk_norm_rope_append: v [B, T, Hk, D] as k), v's rows are copied
// into the same rows of v_out (k_out's shape) in the same dispatch. `op`
// names the op called in errors; the caller checks k_out and v_out.
void run_qk_norm_rope(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                      const c10::optional<at::Tensor>& k_weight, double eps, c10::string_view variant,
                      const at::Tensor& q_out, const at::Tensor& k_out, int64_t k_start, const at::Tensor* v,
                      const at::Tensor* v_out) {
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hk = k.size(2);
  const int64_t R = cos.size(2);
  const bool zero_centred = variant == "zero_centred";
  if (B == 0 || T == 0 || Hq + Hk == 0) return;
  // The kernel indexes the last dimension as contiguous.
  auto last_contiguous = [](const at::Tensor& t) { return t.size(-1) == 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor qv = last_contiguous(q), kv = last_contiguous(k);
  const at::Tensor vv = v != nullptr ? last_contiguous(*v) : kv;
  at::Tensor cv = last_contiguous(cos), sv = last_contiguous(sin);
  if (cv.strides() != sv.strides()) cv = cv.contiguous(), sv = sv.contiguous();
  auto offset_fits = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return t.numel() == 0 || (t.dim() > 0 && fits_32bit(last + 1));
  };
  TORCH_CHECK(offset_fits(qv) && offset_fits(kv) && offset_fits(vv) && offset_fits(cv) && fits_32bit(q_out.numel()) &&
                  fits_32bit(k_out.numel()),
              "mps_ext ", op, ": tensors past 2^31 elements are not supported");
  const int64_t v_heads = v != nullptr ? Hk : 0;
  const int64_t heads = Hq + Hk + v_heads;
  // A head is one simdgroup's, so fewer simdgroups (a lower pipeline limit)
  // change no result.
  const std::string kernel = std::string(op) + "_" + kernel_type_name(q.scalar_type());
  const int64_t simdgroups = std::min<int64_t>(
      {heads, QK_ROPE_MAX_SIMDGROUPS, thread_budget(q.device(), "norm", kernel, QK_ROPE_MAX_SIMDGROUPS * 32) / 32});
  // Decode spreads the heads over cores, one a simdgroup; a longer call
  // keeps a token's heads in one threadgroup, staging cos, sin and the weights once (norm_params.h).
  const int64_t per_group = B * T <= QK_ROPE_SPREAD_TOKENS ? simdgroups : heads;
  QkNormRopeParams p{};
  p.q_heads = static_cast<uint32_t>(Hq);
  p.k_heads = static_cast<uint32_t>(Hk);
  p.tokens = static_cast<uint32_t>(T);
  p.head_dim = static_cast<uint32_t>(D);
  p.rotary_dim = static_cast<uint32_t>(R);
  p.q_stride_b = stride_or_zero(qv, 0), p.q_stride_t = stride_or_zero(qv, 1), p.q_stride_h = stride_or_zero(qv, 2);
  p.k_stride_b = stride_or_zero(kv, 0), p.k_stride_t = stride_or_zero(kv, 1), p.k_stride_h = stride_or_zero(kv, 2);
  p.k_capacity = static_cast<uint32_t>(k_out.size(2));
  p.k_start = static_cast<uint32_t>(k_start);
  p.v_heads = static_cast<uint32_t>(v_heads);
  p.v_stride_b = stride_or_zero(vv, 0), p.v_stride_t = stride_or_zero(vv, 1), p.v_stride_h = stride_or_zero(vv, 2);
  p.cs_stride_b = stride_or_zero(cv, 0), p.cs_stride_t = stride_or_zero(cv, 1);  // a batch of 1 broadcasts: stride 0
  p.heads_per_group = static_cast<uint32_t>(per_group);
  p.iterations = static_cast<uint32_t>(ceil_div(per_group, simdgroups));
  p.q_norm = q_weight.has_value() ? 1u : 0u;
  p.k_norm = k_weight.has_value() ? 1u : 0u;
  p.zero_centred = zero_centred ? 1u : 0u;
  p.eps = static_cast<float>(eps);  // torch adds a Python float to a float32 tensor as a float32
  // An absent weight is never read; q stands in for its buffer.
  const at::Tensor qw = q_weight.has_value() ? q_weight->contiguous() : qv;
  const at::Tensor kw = k_weight.has_value() ? k_weight->contiguous() : qv;
  std::vector<KernelArg> args{KernelArg::of(q_out), KernelArg::of(k_out)};
  if (v != nullptr) args.push_back(KernelArg::of(*v_out));
  args.push_back(KernelArg::of(qv));
  args.push_back(KernelArg::of(kv));
  if (v != nullptr) args.push_back(KernelArg::of(vv));
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&cv, &sv, &qw, &kw}) {
    args.push_back(KernelArg::of(*t));
  }
  args.push_back(KernelArg::value(p));
  launch(Launch{"norm",
                kernel,
                std::move(args),
                {static_cast<uint32_t>(T), static_cast<uint32_t>(B), static_cast<uint32_t>(ceil_div(heads, per_group))},
                {static_cast<uint32_t>(simdgroups * 32), 1, 1}});
}

// The checks of qk_norm_rope's inputs, which qk_norm_rope_append shares (`op` names the one called).
void check_qk_norm_rope(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                        const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                        const c10::optional<at::Tensor>& k_weight, c10::string_view variant) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "mps_ext ", op,
              ": q must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "mps_ext ", op,
              ": q and k must be 4-D [batch, tokens, heads, "
              "head_dim] (before the model's transpose(1, 2)), got ",
              q.sizes(), " and ", k.sizes());
  const int64_t B = q.size(0), T = q.size(1), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == T && k.size(3) == D, "mps_ext ", op, ": k must be [", B, ", ", T,
              ", heads, ", D, "] as q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes(), "mps_ext ", op,
              ": cos and sin must be 3-D "
              "[batch, tokens, rotary_dim] of one shape, got ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t R = cos.size(2);
  TORCH_CHECK((cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == T, "mps_ext ", op,
              ": cos and sin must "
              "be [",
              B, " or 1, ", T, ", rotary_dim] for q ", q.sizes(), ", got ", cos.sizes());
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D, "mps_ext ", op,
              ": rotary_dim (cos's last dimension) must be "
              "even and 2 to head_dim (",
              D, "), got ", R);
  TORCH_CHECK(D <= QK_ROPE_MAX_HEAD_DIM, "mps_ext ", op, ": head_dim of 2 to ", QK_ROPE_MAX_HEAD_DIM,
              " is supported (a simdgroup keeps a head in registers), got ", D);
  TORCH_CHECK(qk_rope_slots(D, R) <= QK_ROPE_SLOTS, "mps_ext ", op, ": a lane holds ", QK_ROPE_SLOTS,
              " elements of a head, 2 * ceil(rotary_dim / 64) + ceil((head_dim - rotary_dim) / 32) of them (any even "
              "rotary_dim of a head_dim up to 192; multiples of 64 at 256), got head_dim ",
              D, " and rotary_dim ", R);
  for (const at::Tensor* t : {&k, &cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == dt, "mps_ext ", op,
                ": q, k, cos and sin must have one dtype (the model "
                "casts cos and sin to q's), got q ",
                dt, " and ", t->scalar_type());
  }
  for (const at::Tensor* t : {&k, &cos, &sin}) {
    TORCH_CHECK(t->device() == q.device(), "mps_ext ", op, ": q is on ", q.device(), " and another input on ",
                t->device());
  }
  for (const auto* w : {&q_weight, &k_weight}) {
    if (!w->has_value()) continue;
    const at::Tensor& t = **w;
    TORCH_CHECK(t.dim() == 1 && t.size(0) == D && t.scalar_type() == dt && t.device() == q.device(), "mps_ext ", op,
                ": q_weight and k_weight must be 1-D of head_dim (", D, ") in q's dtype (", dt, ") on q's device, got ",
                t.sizes(), " ", t.scalar_type(), " on ", t.device());
  }
  TORCH_CHECK(variant == "zero_centred" || variant == "weight", "mps_ext ", op,
              ": variant must be 'weight' (q_norm(x) = "
              "weight * normed.to(dtype): Qwen3, LFM2) or 'zero_centred' (= (normed * (1 + weight)).to(dtype): "
              "Qwen3.5), got '",
              std::string(variant), "'");
}

// q_out [B, Hq, T, D] and k_out [B, Hk, T, D], contiguous (run_qk_norm_rope).
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                                                const c10::optional<at::Tensor>& k_weight, double eps,
                                                c10::string_view variant) {
  check_qk_norm_rope("qk_norm_rope", q, k, cos, sin, q_weight, k_weight, variant);
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hk = k.size(2);
  auto q_out = at::empty({B, Hq, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto k_out = at::empty({B, Hk, T, D}, k.options().memory_format(at::MemoryFormat::Contiguous));
  run_qk_norm_rope("qk_norm_rope", q, k, cos, sin, q_weight, k_weight, eps, variant, q_out, k_out, 0, nullptr, nullptr);
  return {q_out, k_out};
}

// qk_norm_rope with the KV cache append (kv_cache.cpp's kv_append) in the
// same dispatch: k normed and rotated into rows start .. start + T - 1 of
// k_cache, v [B, T, Hk, D] (as k, before the model's transpose) copied
// into the same rows of v_cache (both [B, Hk, capacity, D], contiguous);
// returns q_out [B, Hq, T, D]. Bit for bit qk_norm_rope then kv_append.
at::Tensor qk_norm_rope_append(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                               const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                               const c10::optional<at::Tensor>& k_weight, double eps, c10::string_view variant,
                               at::Tensor& k_cache, at::Tensor& v_cache, int64_t start) {
  const char* op = "qk_norm_rope_append";
  check_qk_norm_rope(op, q, k, cos, sin, q_weight, k_weight, variant);
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hk = k.size(2);
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == q.scalar_type() && v.device() == q.device(), "mps_ext ", op,
              ": v must be k's shape ", k.sizes(), " and q's dtype and device, got ", v.sizes(), " ", v.scalar_type(),
              " on ", v.device());
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(), "mps_ext ", op,
                ": k_cache and v_cache must be q's dtype and device, got ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(0) == B && k_cache.size(1) == Hk && k_cache.size(3) == D,
              "mps_ext ", op, ": k_cache and v_cache must be contiguous [", B, ", ", Hk, ", capacity, ", D,
              "] of one shape, got ", k_cache.sizes(), " and ", v_cache.sizes(),
              k_cache.is_contiguous() && v_cache.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(start >= 0 && start + T <= k_cache.size(2), "mps_ext ", op, ": rows ", start, " to ", start + T,
              " do not fit a cache of capacity ", k_cache.size(2));
  TORCH_CHECK(fits_32bit(k_cache.numel()), "mps_ext ", op, ": tensors past 2^31 elements are not supported");
  auto q_out = at::empty({B, Hq, T, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  run_qk_norm_rope(op, q, k, cos, sin, q_weight, k_weight, eps, variant, q_out, k_cache, start, &v, &v_cache);
  return q_out;
}

using c10::DispatchKey;

const RoutedOp kRmsNorm(FamilyId::norm, "mps_ext::rms_norm");
const RoutedOp kAddRmsNorm(FamilyId::norm, "mps_ext::add_rms_norm");
const RoutedOp kQkNormRope(FamilyId::norm, "mps_ext::qk_norm_rope");
const RoutedOp kQkNormRopeAppend(FamilyId::norm, "mps_ext::qk_norm_rope_append");

template <DispatchKey K>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view variant) {
  return run_own(kRmsNorm, K, [&] { return rms_norm(x, weight, eps, variant); });
}

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps, c10::string_view variant) {
  return run_own(kAddRmsNorm, K, [&] { return add_rms_norm(x, residual, weight, eps, variant); });
}

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin, const c10::optional<at::Tensor>& q_weight,
                                                     const c10::optional<at::Tensor>& k_weight, double eps,
                                                     c10::string_view variant) {
  return run_own(kQkNormRope, K, [&] { return qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, variant); });
}

template <DispatchKey K>
at::Tensor qk_norm_rope_append_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& cos, const at::Tensor& sin,
                                    const c10::optional<at::Tensor>& q_weight,
                                    const c10::optional<at::Tensor>& k_weight, double eps, c10::string_view variant,
                                    at::Tensor& k_cache, at::Tensor& v_cache, int64_t start) {
  return run_own(kQkNormRopeAppend, K, [&] {
    return qk_norm_rope_append(q, k, v, cos, sin, q_weight, k_weight, eps, variant, k_cache, v_cache, start);
  });
}

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
template <DispatchKey K>
void register_norm(FamilyOps& ops) {
  ops.own("rms_norm(Tensor x, Tensor weight, float eps, str variant=\"weight\") -> Tensor", TORCH_FN(rms_norm_impl<K>));
  ops.own(
      "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, str variant=\"weight\") -> (Tensor, Tensor)",
      TORCH_FN(add_rms_norm_impl<K>));
  ops.own("qk_norm_rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? q_weight, Tensor? k_weight, float eps, "
          "str variant=\"weight\") -> (Tensor, Tensor)",
          TORCH_FN(qk_norm_rope_impl<K>));
  ops.own("qk_norm_rope_append(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor? q_weight, "
          "Tensor? k_weight, float eps, str variant, Tensor(a!) k_cache, Tensor(b!) v_cache, int start) -> Tensor",
          TORCH_FN(qk_norm_rope_append_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(norm, mps_ext::register_norm)
