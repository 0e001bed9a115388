// Linear layers: aten::linear, aten::mm and aten::addmm.
// - Decode: 1 to 8 activation rows (or, for mm, 1 to 8 columns of the other
//   operand), as matrix-vector products. Kernels: kernels_metal/linear.metal.
// - Prefill: more rows in float16 and bfloat16, as gmm_tiled's dense product
//   (grouped_mm.cpp's dense_tiled: a grouped product with one group), with
//   the bias, if any, added after (beta = alpha = 1 only). float32 stays
//   torch's: the tile stages float32 in 4-byte pieces, its one type below
//   the goal of 0.9x MLX's steel GEMM (gmm_tiled_f32 0.89x in the
//   grouped case), and no dense float32 figure is counted against the
//   published fp16 one of torch's (docs/dev/policy.md ## linear).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>

#include "attention_gate_params.h"
#include "backend/launch.h"
#include "linear_params.h"
#include "ops/norm.h"
#include "dispatch/kernel_choice.h"
#include "ops/ops.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

// One matrix-vector problem, y[r, n] = alpha * x[r, :] . w[n, :] + beta * bias[r, n],
// given as 2-D strided views (x [rows, K], w [N, K], y and bias [rows, N])
// of the caller's tensors: setting it up moves no data.
// With `norm` (rms_norm_linear), x is rms_norm(norm.x) ([rows, K],
// contiguous), which the kernel computes itself into norm.normed. With
// `gated` (sigmoid_gate_linear), x is sigmoid_gate(gated.x, gated.gate),
// which the kernel stages itself as rows of K (x stands for their shape).
struct GatedRows {
  at::Tensor x, gate;
  GateRowsParams params;
};
struct Problem {
  at::Tensor x, w, y, bias;   // bias undefined: none
  float alpha = 1, beta = 0;  // as the kernel takes them
  const NormedRows* norm = nullptr;
  const GatedRows* gated = nullptr;
};

const char* type_name(c10::ScalarType t) {
  const char* name = t == at::kFloat || t == at::kHalf || t == at::kBFloat16 ? kernel_type_name(t) : nullptr;
  TORCH_CHECK(name, "mps_ext linear: no kernel for ", t);
  return name;
}

// gemv_cols: how many threadgroups split K. The fewest that make
// target_threadgroups with the column blocks, within limits:
// - every threadgroup takes at least one chunk of DECODE_COLS_K_CHUNK rows;
// - the partial sums, written and read back once each (2 * splits * rows *
//   N floats), stay within half the weight's bytes (K * N * itemsize), so
//   that a small K with many rows keeps fewer threadgroups rather than
//   double its traffic. (Half, not less: it lets N >= 2048 reach the target
//   down to K = 768 at 8 rows, a Qwen3 expert's down projection; the
//   partial sums are small enough to stay in the system-level cache.)
// - the kernel's 32-bit split * chunks products stay below 2^31.
// Splitting costs a second dispatch, gemv_cols_finish, which adds the splits'
// sums in a fixed order: one kernel launch and a wait for the first to drain
// (a few microseconds on a GPU), against a weight the columns alone would
// spread over a fifth of an 80-core GPU's threadgroups (N = 4096 in half: 64
// blocks). The
// alternatives need more: float atomics on y lose the fixed order and need y
// zeroed first, and a last-threadgroup-finishes counter needs a zeroed
// counter buffer, itself a fill (a blit or a dispatch) on every call.
int64_t cols_splits(const DeviceProfile& gpu, int64_t blocks, int64_t k, int64_t rows, int64_t itemsize) {
  const int64_t target = target_threadgroups(gpu);
  if (blocks >= target || k == 0) return 1;
  const int64_t chunks = (k + DECODE_COLS_K_CHUNK - 1) / DECODE_COLS_K_CHUNK;
  int64_t splits = (target + blocks - 1) / blocks;
  splits = std::min({splits, chunks, k * itemsize / (16 * rows), INT32_MAX / chunks});
  return std::max<int64_t>(splits, 1);
}

// The variant policy.
// - Layout: gemv_rows when the weight is contiguous along K (F.linear's
//   [N, K]), gemv_cols when it is contiguous along N ([K, N], as in x @ W);
//   otherwise gemv_rows with element loads.
// - VEC (16-byte loads): gemv_rows needs the weight rows and the activation
//   rows 16-byte aligned and contiguous along K; gemv_cols needs the weight
//   rows along N aligned. Storage offsets or pointers that break alignment
//   take element loads.
// - Row variant: the smallest of 1, 2, 4, 8 activation rows that holds them.
// - Both aim at target_threadgroups (4 per core of the GPU's profile), with
//   as much work per threadgroup as that leaves:
//   gemv_rows: decode_geometry (dispatch/kernel_choice.h), up to 16 outputs per
//   threadgroup, Q = 2 per simdgroup from 4 on.
//   gemv_cols: a threadgroup owns 128 bytes of columns (32 elements without
//   VEC); when those blocks are fewer than the target, K is split
//   (cols_splits).
void run(const Problem& pr) {
  const int64_t rows = pr.x.size(0), n = pr.w.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxDecodeRows, "mps_ext linear: ", rows, " rows reached the GEMV kernel");
  GemvParams p{};
  p.rows = rows;
  p.n_out = n;
  p.k = pr.x.size(1);
  // (Staged rows, gated: rows of K, contiguous.)
  p.x_row_stride = pr.gated ? p.k : pr.x.stride(0);
  p.x_k_stride = pr.gated ? 1 : pr.x.stride(1);
  p.w_n_stride = pr.w.stride(0);
  p.w_k_stride = pr.w.stride(1);
  p.y_row_stride = pr.y.stride(0);
  p.y_n_stride = pr.y.stride(1);
  p.alpha = pr.alpha;
  p.beta = pr.beta;
  p.has_bias = pr.bias.defined() ? 1 : 0;
  if (p.has_bias) {
    p.bias_row_stride = pr.bias.stride(0);
    p.bias_n_stride = pr.bias.stride(1);
  }
  p.splits = 1;

  const int64_t variant = row_variant(rows);
  const int64_t itemsize = pr.w.itemsize();
  const DeviceProfile gpu = device_profile(pr.w.device());
  const std::string type = type_name(pr.w.scalar_type());
  const bool cols = p.w_n_stride == 1 && p.w_k_stride != 1 && n > 1;
  // Without a bias the output stands in for buffer 4, and without a split
  // for gemv_cols' partial sums (buffer 5): the kernels never touch them then.
  at::Tensor partials;
  auto args = [&] {
    const at::Tensor& x = pr.norm ? pr.norm->x : pr.gated ? pr.gated->x : pr.x;
    std::vector<KernelArg> a{KernelArg::of(pr.y), KernelArg::of(x), KernelArg::of(pr.w), KernelArg::value(p),
                             KernelArg::of(pr.bias.defined() ? pr.bias : pr.y)};
    if (cols) a.push_back(KernelArg::of(partials.defined() ? partials : pr.y));
    if (pr.norm) {
      a.push_back(KernelArg::of(pr.norm->normed));
      a.push_back(KernelArg::of(pr.norm->weight));
      a.push_back(KernelArg::value(pr.norm->params));
      // Without a residual the kernel reads none and writes no sums: x and
      // normed stand in for them.
      const bool add = pr.norm->residual.defined();
      a.push_back(KernelArg::of(add ? pr.norm->residual : pr.norm->x));
      a.push_back(KernelArg::of(add ? pr.norm->sum : pr.norm->normed));
    }
    if (pr.gated) {
      a.push_back(KernelArg::of(pr.gated->gate));
      a.push_back(KernelArg::value(pr.gated->params));
    }
    return a;
  };
  TORCH_CHECK(!(cols && (pr.norm || pr.gated)), "mps_ext rms_norm_linear, sigmoid_gate_linear: the weight must be "
                                                "contiguous along K");
  if (cols) {
    const bool vec = aligned16(pr.w, p.w_k_stride);
    const int64_t blocks = ceil_div(n, decode_cols_columns(vec, itemsize));
    const int64_t splits = cols_splits(gpu, blocks, p.k, rows, itemsize);
    const std::string finish = "gemv_cols_finish_" + type;
    if (splits > 1) {
      // The second dispatch's kernel can run (fixed threads: its least),
      // else the first is not encoded either.
      thread_budget(pr.w.device(), "linear", finish, DECODE_COLS_THREADS, DECODE_COLS_THREADS);
      p.splits = static_cast<uint32_t>(splits);
      partials = at::empty({splits, rows, n}, pr.x.options().dtype(at::kFloat));
    }
    launch(Launch{"linear",
                  "gemv_cols_" + type + "_r" + std::to_string(variant) + (vec ? "_vec" : "_scalar"),
                  args(),
                  {static_cast<uint32_t>(blocks), p.splits, 1},
                  {DECODE_COLS_THREADS, 1, 1}});
    if (p.splits > 1)
      launch(Launch{
          "linear",
          finish,
          args(),
          {static_cast<uint32_t>((n + DECODE_COLS_THREADS - 1) / DECODE_COLS_THREADS), static_cast<uint32_t>(rows), 1},
          {DECODE_COLS_THREADS, 1, 1}});
    return;
  }
  // (Gated: the rows staged in threadgroup memory, 16-byte aligned, as the
  // fresh output of sigmoid_gate that gemv_rows would read.)
  const bool x_vec =
      pr.gated ? rows == 1 || (p.k * itemsize) % 16 == 0 : aligned16(pr.x, rows > 1 ? p.x_row_stride : 0);
  const bool vec = p.w_k_stride == 1 && p.x_k_stride == 1 && aligned16(pr.w, p.w_n_stride) && x_vec;
  // The same variant and geometry with the norm as without (the sums' order
  // is the variant's): rms_norm_gemv_rows is bit for bit rms_norm, then this.
  DecodeGeometry g = decode_geometry(gpu, n, 1, 2, false, rows);
  const char* family = pr.gated                      ? "sigmoid_gate_gemv_rows_"
                       : !pr.norm                    ? "gemv_rows_"
                       : pr.norm->residual.defined() ? "add_rms_norm_gemv_rows_"
                                                     : "rms_norm_gemv_rows_";
  const std::string kernel = std::string(family) + type + "_r" + std::to_string(variant) + "_q" +
                             std::to_string(g.outputs_per_simdgroup) + (vec ? "_vec" : "_scalar");
  g = fit_threads(g, n, thread_budget(pr.w.device(), "linear", kernel, DECODE_MAX_THREADS));
  launch(Launch{"linear",
                kernel,
                args(),
                {static_cast<uint32_t>(g.threadgroups), 1, 1},
                {static_cast<uint32_t>(32 * g.simdgroups), 1, 1}});
}

// rms_norm_linear's weight: F.linear's [N, K], contiguous along K (the
// rows kernel); an error naming the argument otherwise.
void check_normed_weight(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "mps_ext ", op, ": weight must be [N, ", x.size(-1),
              "] (F.linear's, K the norm's row), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(), "mps_ext ", op,
              ": weight must be x's dtype and device (", x.scalar_type(), " on ", x.device(), "), got ",
              weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(weight.stride(1) == 1 || weight.size(1) == 1, "mps_ext ", op,
              ": weight must be contiguous along K (F.linear's [N, K] layout), got strides ", weight.strides());
  if (bias && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                    bias->device() == x.device(),
                "mps_ext ", op, ": bias must be 1-D of N = ", weight.size(0), " in x's dtype and device, got ",
                bias->sizes(), " ", bias->scalar_type(), " on ", bias->device());
}

bool kernel_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

Reason dtypes_unsupported(std::initializer_list<const at::Tensor*> ts) {
  c10::ScalarType t = (*ts.begin())->scalar_type();
  if (!kernel_dtype(t)) return because::dtype_not_float(t);
  for (const at::Tensor* x : ts) {
    if (!x->defined()) continue;
    if (x->scalar_type() != t) return because::mixed_dtypes;
    if (x->layout() != at::kStrided) return because::not_strided;
  }
  return {};
}

// The activation of linear as [rows, K] strides, if its leading dimensions
// flatten without a copy.
bool flat_rows(const at::Tensor& x, int64_t& row_stride) {
  row_stride = 0;
  int64_t expected = -1;
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.size(d) == 1) continue;
    if (expected == -1) {
      row_stride = x.stride(d);
      expected = x.stride(d) * x.size(d);
    } else {
      if (x.stride(d) != expected) return false;
      expected *= x.size(d);
    }
  }
  return true;
}

// Rows of F.linear's activation: every dimension but the last.
int64_t leading_rows(const at::Tensor& input) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) rows *= input.size(d);
  return rows;
}

// The kernels index the activation in 32 bits (the weight, the output and
// the bias in 64): an activation view reaching past 2^31 elements is left to
// the stock kernel.
Reason activation_unsupported(const at::Tensor& x) {
  int64_t last = 0;
  for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
  if (last > INT32_MAX || (x.dim() > 0 && x.size(-1) > INT32_MAX)) return because::activation_offsets_past_2_31;
  return {};
}

// More than 8 rows: the tile's product a [M, K] @ b [K, N], if it takes it.
bool tile_rows(int64_t rows) { return rows > kMaxDecodeRows; }
// mm/addmm: the tile where neither operand is a GEMV's few rows (or columns).
bool mm_on_tile(const at::Tensor& mat1, const at::Tensor& mat2) {
  return tile_rows(std::min(mat1.size(0), mat2.size(1)));
}

Reason tile_unsupported(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat) return because::float32_rows_past_8;
  return dense_tiled_unsupported(a, b);
}

// The tile's product into y, then torch's semantics of the bias: y += bias
// (broadcast), a second rounding (the tile has no bias epilogue; torch's
// MPS addmm also adds the bias as an MPSGraph op of its own after the
// product). One extra dispatch for the models with a bias on a projection.
void run_tile(const at::Tensor& a, const at::Tensor& b, const at::Tensor& y, const at::Tensor& bias) {
  dense_tiled(a, b, y);
  if (bias.defined()) y.add_(bias);
}

// alpha and beta as the kernel's float, converted as aten's addmm converts
// them (to its opmath type, float for every dtype handled here): a value
// out of float's range raises torch's error. With K == 0 aten computes no
// product and converts nothing (nor do we).
float to_float(const c10::Scalar& v, int64_t k) { return k > 0 ? v.to<float>() : static_cast<float>(v.toDouble()); }

}  // namespace

// ------------------------------------------------------------- F.linear --
Reason linear_unsupported(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  Reason why = dtypes_unsupported({&input, &weight, bias ? &*bias : &weight});
  if (why) return why;
  if (input.dim() == 0 || weight.dim() != 2 || input.size(-1) != weight.size(1))
    return because::shapes_torch_rejects;  // its error follows
  if (bias && bias->defined() && !(bias->dim() == 1 && bias->size(0) == weight.size(0))) return because::bias_not_1d_n;
  int64_t row_stride;
  if (!flat_rows(input, row_stride)) return because::rows_do_not_flatten;
  const int64_t rows = leading_rows(input);
  if (tile_rows(rows))
    return tile_unsupported(input.as_strided({rows, input.size(-1)}, {row_stride, input.stride(-1)}), weight.t());
  return activation_unsupported(input);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t k = input.size(-1), n = weight.size(0);
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, input.options());
  if (y.numel() == 0) return y;
  const int64_t rows = leading_rows(input);
  int64_t row_stride;
  flat_rows(input, row_stride);
  Problem pr;
  pr.x = input.as_strided({rows, k}, {row_stride, input.stride(-1)});
  pr.w = weight;
  pr.y = y.view({rows, n});
  if (tile_rows(rows)) {
    run_tile(pr.x, weight.t(), pr.y, bias && bias->defined() ? *bias : at::Tensor());
    return y;
  }
  if (bias && bias->defined()) {
    pr.bias = bias->expand({rows, n});
    pr.beta = 1;
  }
  run(pr);
  return y;
}

// ----------------------------------------------------- rms_norm_linear --
namespace {

// The GEMV of rows a kernel stages itself (x_rows: [rows, K], their shape)
// into y [..., N], with the bias if any.
Problem staged_problem(const at::Tensor& x_rows, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& y) {
  const int64_t rows = x_rows.size(0), n = weight.size(0);
  Problem pr;
  pr.x = x_rows;
  pr.w = weight;
  pr.y = y.view({rows, n});
  if (bias && bias->defined()) {
    pr.bias = bias->expand({rows, n});
    pr.beta = 1;
  }
  return pr;
}

// The norm of x's rows (of x + residual's, with one) and F.linear of the
// normed rows, one dispatch of rms_norm_gemv_rows (add_rms_norm_gemv_rows)
// into normed, y and the sums: true; false, with nothing launched, where the
// kernel does not take them (more than 8 rows, normed rows past its
// threadgroup memory, N = 0), for the caller to run the ops. Arguments
// checked by the caller; x has rows.
bool norm_gemv(const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& norm_weight,
               double eps, bool zero_centred, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
               const at::Tensor& normed, const at::Tensor* sum, const at::Tensor& y) {
  const int64_t k = x.size(-1), n = weight.size(0), rows = leading_rows(x);
  if (!gemv_norms_rows(rows, k, x.itemsize()) || n == 0) return false;
  const NormedRows norm = normed_rows(op, x, norm_weight, normed, eps, zero_centred, residual, sum);
  Problem pr = staged_problem(norm.normed, weight, bias, y);  // (normed: the rows as the kernel keeps them)
  pr.norm = &norm;
  run(pr);
  return true;
}

at::Tensor like_rows(const at::Tensor& x) {
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor product_of(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  return at::empty(out_shape, x.options());
}

}  // namespace

// (rms_norm(x), F.linear(rms_norm(x), weight, bias)) in one dispatch,
// rms_norm_gemv_rows: a decoder layer's input norm and the fused projection
// that reads it (mps_ext/passes/decoder.py). Bit for bit mps_ext.rms_norm
// then mps_ext's linear: the kernel norms as rms_norm's team would, and
// picks the linear's variant and geometry. 1 to 8 rows whose normed bytes
// fit the kernel's threadgroup memory; larger calls are the two ops.
std::tuple<at::Tensor, at::Tensor> rms_norm_linear(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                                   c10::string_view variant, const at::Tensor& weight,
                                                   const c10::optional<at::Tensor>& bias) {
  const bool zero_centred = check_norm("rms_norm_linear", x, norm_weight, variant);
  check_normed_weight("rms_norm_linear", x, weight, bias);
  at::Tensor normed = like_rows(x), y = product_of(x, weight.size(0));
  if (leading_rows(x) == 0) return {normed, y};
  if (!norm_gemv("rms_norm_linear", x, nullptr, norm_weight, eps, zero_centred, weight, bias, normed, nullptr, y)) {
    normed = rms_norm(x, norm_weight, eps, variant);  // the two ops, as the model's code calls them
    return {normed, at::linear(normed, weight, bias)};
  }
  return {normed, y};
}

// (x + residual, rms_norm(x + residual), F.linear(rms_norm(x + residual),
// weight)), add_rms_norm_gemv_rows: a decoder layer's residual add, its
// post-attention norm and the MoE router that reads it (moe.cpp's
// add_rms_norm_moe_layer), one dispatch, bit for bit mps_ext.add_rms_norm
// then mps_ext's linear; nullopt where the kernel does not take them
// (norm_gemv) or the weight is not contiguous along K, for the caller to
// run those ops.
c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> add_rms_norm_gemv(const at::Tensor& x,
                                                                                const at::Tensor& residual,
                                                                                const at::Tensor& norm_weight,
                                                                                double eps, c10::string_view variant,
                                                                                const at::Tensor& weight) {
  const char* op = "add_rms_norm_moe_layer";
  const bool zero_centred = check_norm(op, x, norm_weight, variant);
  check_residual(op, x, residual);
  if (weight.dim() != 2 || !(weight.stride(1) == 1 || weight.size(1) == 1) || leading_rows(x) == 0) return c10::nullopt;
  check_normed_weight(op, x, weight, c10::nullopt);
  at::Tensor sum = like_rows(x), normed = like_rows(x), y = product_of(x, weight.size(0));
  if (!norm_gemv(op, x, &residual, norm_weight, eps, zero_centred, weight, c10::nullopt, normed, &sum, y))
    return c10::nullopt;
  return std::make_tuple(sum, normed, y);
}

// ------------------------------------------------- sigmoid_gate_linear --
namespace {

// gate's rows as the kernel reads them: `rows` rows (x's leading
// dimensions) of K = heads * head_dim, each head's head_dim elements
// contiguous; false where gate is not laid out so (the caller copies it).
bool gate_rows(const at::Tensor& gate, int64_t x_dims, GateRowsParams& gp) {
  const int64_t d = gate.size(-1);
  if (!(gate.stride(-1) == 1 || d == 1)) return false;
  int64_t row_stride = 0;
  if (gate.dim() == x_dims) {  // [..., K]
    gp.head_dim = static_cast<uint32_t>(d);
    gp.gate_head_stride = 0;
    if (!flat_rows(gate, row_stride)) return false;
  } else {  // [..., heads, head_dim]: flat_rows of [..., heads] checks the leading dimensions
    gp.head_dim = static_cast<uint32_t>(d);
    gp.gate_head_stride = static_cast<uint32_t>(gate.size(-2) > 1 ? gate.stride(-2) : 0);
    if (gate.stride(-2) < 0 || !flat_rows(gate.select(-1, 0), row_stride)) return false;
  }
  if (row_stride < 0) return false;
  int64_t last = 0;
  for (int64_t i = 0; i < gate.dim(); ++i) last += (gate.size(i) - 1) * gate.stride(i);
  if (last > INT32_MAX) return false;
  gp.gate_row_stride = static_cast<uint32_t>(row_stride);
  return true;
}

// sigmoid_gate_linear's arguments: x [..., K]; gate of x's shape, or with
// its last dimension split in (heads, head_dim) as q_proj leaves it; the
// weight F.linear's [N, K], contiguous along K, and the bias, as
// rms_norm_linear's.
void check_gate_linear(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias) {
  const char* op = "sigmoid_gate_linear";
  check_float(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "mps_ext sigmoid_gate_linear: x must have a last dimension, got a 0-d tensor");
  TORCH_CHECK(gate.scalar_type() == x.scalar_type() && gate.device() == x.device(),
              "mps_ext sigmoid_gate_linear: gate must be x's dtype and device (", x.scalar_type(), " on ", x.device(),
              "), got ", gate.scalar_type(), " on ", gate.device());
  const bool same = gate.sizes() == x.sizes();
  const bool split = gate.dim() == x.dim() + 1 &&
                     gate.sizes().slice(0, x.dim() - 1) == x.sizes().slice(0, x.dim() - 1) &&
                     gate.size(-2) * gate.size(-1) == x.size(-1);
  TORCH_CHECK(same || split, "mps_ext sigmoid_gate_linear: gate must be x's shape ", x.sizes(),
              ", or it with the last dimension split in (heads, head_dim), got ", gate.sizes());
  check_normed_weight(op, x, weight, bias);
}

}  // namespace

// F.linear(x * sigmoid(gate), weight, bias) in one dispatch,
// sigmoid_gate_gemv_rows: an attention layer's output gate and its o_proj
// (Qwen3.5/3.6, Qwen3-Next; mps_ext/passes/attention.py). Bit for bit
// mps_ext.sigmoid_gate then mps_ext's linear: the kernel rounds the gated
// rows as sigmoid_gate does and picks the linear's variant and geometry. 1
// to 8 rows whose bytes fit the kernel's threadgroup memory; other calls
// (and K = 0 or N = 0) are the two ops.
at::Tensor sigmoid_gate_linear(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias) {
  check_gate_linear(x, gate, weight, bias);
  const int64_t k = x.size(-1), n = weight.size(0), rows = leading_rows(x);
  at::Tensor y = product_of(x, n);
  if (rows == 0) return y;
  if (!gemv_norms_rows(rows, k, x.itemsize()) || n == 0 || k == 0) {
    const at::Tensor gated = sigmoid_gate(x.reshape(gate.sizes()), gate).view(x.sizes());
    return at::linear(gated, weight, bias);  // the two ops, as the model's code calls them
  }
  GatedRows g;
  g.x = x.stride(-1) == 1 || k == 1 ? x : x.contiguous();
  int64_t x_row_stride;
  if (!flat_rows(g.x, x_row_stride) || x_row_stride < 0 || activation_unsupported(g.x)) {
    g.x = x.contiguous();
    x_row_stride = k;
  }
  g.gate = gate;
  GateRowsParams& gp = g.params;
  if (!gate_rows(g.gate, x.dim(), gp)) {
    g.gate = gate.contiguous();
    TORCH_CHECK(gate_rows(g.gate, x.dim(), gp), "mps_ext sigmoid_gate_linear: gate's layout");
  }
  gp.rows = static_cast<uint32_t>(rows);
  gp.n = static_cast<uint32_t>(k);
  gp.x_row_stride = static_cast<uint32_t>(rows > 1 ? x_row_stride : k);
  Problem pr = staged_problem(g.x.as_strided({rows, k}, {x_row_stride, 1}), weight, bias, y);
  pr.gated = &g;
  run(pr);
  return y;
}

// ----------------------------------------------------------- mm / addmm --
// mat1 [M, K] @ mat2 [K, N]: the activation is mat1 when M <= 8 (mat2 is the
// weight, seen as [N, K]); else mat2's N <= 8 columns, with mat1 the weight
// and the output written transposed.
Reason mm_unsupported(const RoutedOp& op, const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor* self,
                      c10::DispatchKey key) {
  Reason why = dtypes_unsupported({&mat1, &mat2, self ? self : &mat1});
  if (why) return why;
  if (mat1.dim() != 2 || mat2.dim() != 2 || mat1.size(1) != mat2.size(0))
    return because::shapes_torch_rejects;  // its error follows
  if (self && !self->defined()) return {};
  if (mm_on_tile(mat1, mat2)) return tile_unsupported(mat1, mat2);
  // (The activation: see mm_transposed below.)
  why = activation_unsupported(mat1.size(0) <= mat2.size(1) && mat1.size(0) <= kMaxDecodeRows ? mat1 : mat2);
  if (why) return why;
  const int64_t rows = std::min(mat1.size(0), mat2.size(1));
  // The policy from torch 2.14 on MPS: one row to torch's own GEMV.
  if (rows == 1)
    if (Reason policy = op.picked(key, Condition::one_row)) return policy;
  return {};
}

// addmm's epilogue on the tile: the bias added (beta = 1) or not read
// (beta = 0), the product unscaled (alpha = 1).
static Reason epilogue_unsupported(const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                                   const c10::Scalar& alpha) {
  if (!mm_on_tile(mat1, mat2)) return {};
  if (beta.isComplex() || alpha.isComplex()) return because::tile_beta_alpha;
  const double b = beta.toDouble(), a = alpha.toDouble();
  return a != 1 || (b != 0 && b != 1) ? because::tile_beta_alpha : Reason{};
}

// The activation is mat1 when it has at most 8 rows and no more rows than
// mat2 has columns; otherwise it is mat2's columns, and the whole product
// is computed transposed: y^T = mat2^T @ mat1^T.
static bool mm_transposed(const at::Tensor& mat1, const at::Tensor& mat2) {
  return !(mat1.size(0) <= mat2.size(1) && mat1.size(0) <= kMaxDecodeRows);
}

static Problem mm_problem(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& y) {
  Problem pr;
  if (mm_transposed(mat1, mat2)) {
    pr.x = mat2.t();
    pr.w = mat1;
    pr.y = y.t();
  } else {
    pr.x = mat1;
    pr.w = mat2.t();
    pr.y = y;
  }
  return pr;
}

Reason out_unsupported(const at::Tensor& out, const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor* self) {
  if (out.scalar_type() != mat1.scalar_type()) return because::out_of_another_dtype;
  if (out.dim() != 2 || out.size(0) != mat1.size(0) || out.size(1) != mat2.size(1)) return because::out_needs_resizing;
  if (!out.is_contiguous()) return because::out_not_contiguous;
  // The kernels read the inputs while other threadgroups write the output.
  for (const at::Tensor* t : {&mat1, &mat2, self})
    if (t && t->defined() && at::get_overlap_status(out, *t) != at::MemOverlapStatus::No)
      return because::out_overlaps_input;
  return {};
}

// mat1 @ mat2 written into y ([M, N], contiguous); K == 0 writes zeros.
static void mm_into(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& y) {
  if (y.numel() == 0) return;
  if (mm_on_tile(mat1, mat2)) run_tile(mat1, mat2, y, at::Tensor());
  else run(mm_problem(mat1, mat2, y));
}

static void addmm_into(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                       const c10::Scalar& alpha, const at::Tensor& y) {
  const int64_t M = mat1.size(0), N = mat2.size(1);
  TORCH_CHECK(self.dim() <= 2, "addmm: self must be a matrix or broadcastable to one, got ", self.dim(), " dims");
  at::Tensor b = self.expand({M, N});  // torch's error if it does not broadcast
  if (y.numel() == 0) return;
  if (mm_on_tile(mat1, mat2)) {
    // (beta is 0 or 1 and alpha 1: epilogue_unsupported. beta == 0: the
    // bias is not read, so NaN or inf in it do not reach y.)
    run_tile(mat1, mat2, y, beta.toDouble() != 0 ? self : at::Tensor());
    return;
  }
  Problem pr = mm_problem(mat1, mat2, y);
  const int64_t k = mat1.size(1);
  pr.alpha = to_float(alpha, k);
  const float beta_f = to_float(beta, k);
  // beta == 0: the bias is not read, so NaN or inf in it do not reach y.
  if (beta_f != 0) {
    pr.bias = mm_transposed(mat1, mat2) ? b.t() : b;
    pr.beta = beta_f;
  }
  run(pr);
}

at::Tensor mm(const at::Tensor& mat1, const at::Tensor& mat2) {
  at::Tensor y = at::empty({mat1.size(0), mat2.size(1)}, mat1.options());
  mm_into(mat1, mat2, y);
  return y;
}

at::Tensor& mm_out(const at::Tensor& mat1, const at::Tensor& mat2, at::Tensor& out) {
  mm_into(mat1, mat2, out);
  return out;
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                 const c10::Scalar& alpha) {
  at::Tensor y = at::empty({mat1.size(0), mat2.size(1)}, mat1.options());
  addmm_into(self, mat1, mat2, beta, alpha, y);
  return y;
}

at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                      const c10::Scalar& alpha, at::Tensor& out) {
  addmm_into(self, mat1, mat2, beta, alpha, out);
  return out;
}

// -------------------------------------------------------- registration --
namespace {

using c10::DispatchKey;

const RoutedOp kLinear(FamilyId::linear, "aten::linear"), kMm(FamilyId::linear, "aten::mm"),
    kAddmm(FamilyId::linear, "aten::addmm"), kMmOut(FamilyId::linear, "aten::mm.out"),
    kAddmmOut(FamilyId::linear, "aten::addmm.out");

Reason addmm_unsupported(const RoutedOp& op, const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                         const c10::Scalar& beta, const c10::Scalar& alpha, c10::DispatchKey key) {
  Reason why = mm_unsupported(op, mat1, mat2, &self, key);
  return why ? why : epilogue_unsupported(mat1, mat2, beta, alpha);
}

template <DispatchKey K>
at::Tensor linear_impl(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return route<decltype(linear_impl<K>)>(
      kLinear, K, linear_unsupported(input, weight, bias), [&] { return mps_ext::linear(input, weight, bias); }, input,
      weight, bias);
}

template <DispatchKey K>
at::Tensor mm_impl(const at::Tensor& self, const at::Tensor& mat2) {
  return route<decltype(mm_impl<K>)>(
      kMm, K, mm_unsupported(kMm, self, mat2, nullptr, K), [&] { return mps_ext::mm(self, mat2); }, self, mat2);
}

template <DispatchKey K>
at::Tensor addmm_impl(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                      const c10::Scalar& alpha) {
  return route<decltype(addmm_impl<K>)>(
      kAddmm, K, addmm_unsupported(kAddmm, self, mat1, mat2, beta, alpha, K),
      [&] { return mps_ext::addmm(self, mat1, mat2, beta, alpha); }, self, mat1, mat2, beta, alpha);
}

// The out= forms are what torch.compile's inductor calls for matmuls
// (extern_kernels.mm / addmm with out=). The result is written into `out`
// when it already has the product's shape and dtype, is contiguous and
// overlaps no input (inductor allocates it so); anything else, and every
// error, is the stock kernel's.
template <DispatchKey K>
at::Tensor& mm_out_impl(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  Reason why = mm_unsupported(kMmOut, self, mat2, nullptr, K);
  if (!why) why = out_unsupported(out, self, mat2, nullptr);
  route<decltype(mm_out_impl<K>)>(kMmOut, K, why, [&] { return mps_ext::mm_out(self, mat2, out); }, self, mat2, out);
  return out;
}

template <DispatchKey K>
at::Tensor& addmm_out_impl(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                           const c10::Scalar& beta, const c10::Scalar& alpha, at::Tensor& out) {
  Reason why = addmm_unsupported(kAddmmOut, self, mat1, mat2, beta, alpha, K);
  if (!why) why = out_unsupported(out, mat1, mat2, &self);
  route<decltype(addmm_out_impl<K>)>(
      kAddmmOut, K, why, [&] { return mps_ext::addmm_out(self, mat1, mat2, beta, alpha, out); }, self, mat1, mat2, beta,
      alpha, out);
  return out;
}

const RoutedOp kRmsNormLinear(FamilyId::linear, "mps_ext::rms_norm_linear");

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor> rms_norm_linear_impl(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                                        c10::string_view variant, const at::Tensor& weight,
                                                        const c10::optional<at::Tensor>& bias) {
  return run_own(kRmsNormLinear, K,
                 [&] { return mps_ext::rms_norm_linear(x, norm_weight, eps, variant, weight, bias); });
}

const RoutedOp kSigmoidGateLinear(FamilyId::linear, "mps_ext::sigmoid_gate_linear");

template <DispatchKey K>
at::Tensor sigmoid_gate_linear_impl(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias) {
  return run_own(kSigmoidGateLinear, K, [&] { return mps_ext::sigmoid_gate_linear(x, gate, weight, bias); });
}

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
template <DispatchKey K>
void register_linear(FamilyOps& ops) {
  ops.own("rms_norm_linear(Tensor x, Tensor norm_weight, float eps, str variant, Tensor weight, Tensor? bias) -> "
          "(Tensor, Tensor)",
          TORCH_FN(rms_norm_linear_impl<K>));
  ops.own("sigmoid_gate_linear(Tensor x, Tensor gate, Tensor weight, Tensor? bias) -> Tensor",
          TORCH_FN(sigmoid_gate_linear_impl<K>));
  ops.aten("linear", TORCH_FN(linear_impl<K>));
  ops.aten("mm", TORCH_FN(mm_impl<K>));
  ops.aten("addmm", TORCH_FN(addmm_impl<K>));
  ops.aten("mm.out", TORCH_FN(mm_out_impl<K>));
  ops.aten("addmm.out", TORCH_FN(addmm_out_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(linear, mps_ext::register_linear)
