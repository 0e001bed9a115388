// torch.ops.mps_ext.linear_attention_decode: a Gated DeltaNet layer's decode
// step (Qwen3-Next, Qwen3.5/3.6-MoE linear attention) between its input and
// output projections, one dispatch (kernels_metal/linear_attention.metal).
// transformers' torch code for the same step (its fallbacks for
// causal_conv1d_update and FLA's fused_recurrent_gated_delta_rule, the
// kernels a Mac does not have) is about 80 ops a layer; mps_ext.optimize
// (mps_ext/passes/linear_attention.py) puts the layers on this op.
//
// In place: the convolution window `conv_state` [B, conv_dim, K] (the
// model's dtype) and the recurrent state [B, v_heads, dk, dv] (float32), as
// transformers' cache holds them. Returns the gated RMSNorm's output
// [B, v_heads * dv] in the model's dtype, the output projection's input.
//
// torch.ops.mps_ext.linear_attention_chunk: the same layers' prefill core,
// transformers' torch_chunk_gated_delta_rule (FLA's chunk_gated_delta_rule)
// from q, k, v, g, beta and an optional float32 initial state to the output
// [B, T, v_heads, dv] (the inputs' dtype) and the final float32 state; two
// dispatches whatever the length (linear_attention_chunk_prep,
// linear_attention_chunk_state) where transformers' code is ~688 ops a
// layer at 4k tokens.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <tuple>

#include "backend/launch.h"
#include "linear_attention_params.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

void check_rows(const at::Tensor& t, const char* name, int64_t batch, int64_t width, c10::ScalarType dt) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == width && t.scalar_type() == dt &&
                  (t.stride(1) == 1 || width == 1) && t.stride(0) >= width && t.stride(0) <= UINT32_MAX,
              "linear_attention_decode: ", name, " must be [", batch, ", ", width, "] in ", dt,
              " with contiguous rows, got ", t.sizes(), " ", t.scalar_type(), " strides ", t.strides());
}

void check_vector(const at::Tensor& t, const char* name, int64_t n, c10::ScalarType dt) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == dt && t.is_contiguous(),
              "linear_attention_decode: ", name, " must be contiguous [", n, "] in ", dt, ", got ", t.sizes(), " ",
              t.scalar_type());
}

at::Tensor linear_attention_decode(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                                   at::Tensor& conv_state, at::Tensor& recurrent_state, const at::Tensor& conv_weight,
                                   const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& norm_weight,
                                   int64_t k_heads, double eps) {
  TORCH_CHECK(conv_state.defined() && recurrent_state.defined(),
              "linear_attention_decode: conv_state and recurrent_state are the layer's cache after a prefill "
              "(transformers: cache_params.get_conv_state / get_recurrent_state); got None");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&qkv, &z, &b, &a, &conv_weight, &A_log, &dt_bias, &norm_weight})
    TORCH_CHECK(t->defined(), "linear_attention_decode: qkv, z, b, a, conv_weight, A_log, dt_bias and norm_weight "
                              "are required; got None");
  const auto dt = qkv.scalar_type();
  const char* type = kernel_type_name(dt);
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "linear_attention_decode: qkv must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(qkv.dim() == 2, "linear_attention_decode: qkv [batch, conv_dim] (one token per sequence) expected, got ",
              qkv.sizes());
  TORCH_CHECK(
      recurrent_state.dim() == 4 && recurrent_state.scalar_type() == at::kFloat && recurrent_state.is_contiguous(),
      "linear_attention_decode: recurrent_state must be contiguous float32 [batch, v_heads, dk, dv], got ",
      recurrent_state.sizes(), " ", recurrent_state.scalar_type());
  const int64_t batch = qkv.size(0), conv_dim = qkv.size(1);
  const int64_t v_heads = recurrent_state.size(1), dk = recurrent_state.size(2), dv = recurrent_state.size(3);
  TORCH_CHECK(recurrent_state.size(0) == batch, "linear_attention_decode: recurrent_state holds ",
              recurrent_state.size(0), " sequences, qkv ", batch);
  TORCH_CHECK(k_heads >= 1 && v_heads % k_heads == 0, "linear_attention_decode: v_heads (", v_heads,
              ") must be a multiple of k_heads (", k_heads, ")");
  TORCH_CHECK(conv_dim == 2 * k_heads * dk + v_heads * dv, "linear_attention_decode: qkv holds ", conv_dim,
              " channels; 2 * k_heads * dk + v_heads * dv = ", 2 * k_heads * dk + v_heads * dv,
              " from k_heads and recurrent_state's shape");
  const int64_t ratio = v_heads / k_heads;
  TORCH_CHECK(dk >= 1 && dk <= LA_MAX_DK && dv >= 1 && ratio * dv <= LA_MAX_COLS && ratio <= LA_MAX_RATIO,
              "linear_attention_decode: takes key heads of 1 to ", LA_MAX_DK, ", at most ", LA_MAX_RATIO,
              " value heads per key head and ", LA_MAX_COLS, " value channels per key head; got dk ", dk, ", ", ratio,
              " value heads of ", dv);
  check_rows(z, "z", batch, v_heads * dv, dt);
  check_rows(b, "b", batch, v_heads, dt);
  check_rows(a, "a", batch, v_heads, dt);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == batch && conv_state.size(1) == conv_dim &&
                  conv_state.size(2) >= 1 && conv_state.scalar_type() == dt && conv_state.is_contiguous(),
              "linear_attention_decode: conv_state must be contiguous [", batch, ", ", conv_dim, ", kernel size] in ",
              dt, ", got ", conv_state.sizes(), " ", conv_state.scalar_type());
  const int64_t conv_k = conv_state.size(2);
  TORCH_CHECK(conv_k <= 32 && (conv_k & (conv_k - 1)) == 0,
              "linear_attention_decode: the convolution's window (conv_state's last dimension) must be 1, 2, 4, 8, 16 "
              "or 32 (a lane per tap), got ",
              conv_k);
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == conv_dim && conv_weight.size(1) == conv_k &&
                  conv_weight.scalar_type() == dt && conv_weight.is_contiguous(),
              "linear_attention_decode: conv_weight must be contiguous [", conv_dim, ", ", conv_k, "] in ", dt,
              ", got ", conv_weight.sizes(), " ", conv_weight.scalar_type());
  check_vector(A_log, "A_log", v_heads, dt);
  check_vector(dt_bias, "dt_bias", v_heads, dt);
  check_vector(norm_weight, "norm_weight", dv, dt);
  const auto device = qkv.device();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&z, &b, &a, &conv_state, &recurrent_state,
                                                                      &conv_weight, &A_log, &dt_bias, &norm_weight})
    TORCH_CHECK(t->device() == device, "linear_attention_decode: every tensor must be on ", device, ", one is on ",
                t->device());
  TORCH_CHECK(
      conv_state.numel() <= UINT32_MAX && recurrent_state.numel() <= UINT32_MAX && batch * qkv.stride(0) <= UINT32_MAX,
      "linear_attention_decode: the states must have fewer than 2^32 elements (32-bit indices)");

  at::Tensor out = at::empty({batch, v_heads * dv}, qkv.options());
  if (batch == 0) return out;
  LinearAttentionParams p{};
  p.batch = static_cast<uint32_t>(batch);
  p.k_heads = static_cast<uint32_t>(k_heads);
  p.v_heads = static_cast<uint32_t>(v_heads);
  p.dk = static_cast<uint32_t>(dk);
  p.dv = static_cast<uint32_t>(dv);
  p.ratio = static_cast<uint32_t>(ratio);
  p.conv_dim = static_cast<uint32_t>(conv_dim);
  p.conv_k = static_cast<uint32_t>(conv_k);
  // A state column over as few threads as keep LA_ROWS rows each; as many
  // columns at once as the pipeline's threads hold (one key head's value
  // heads: 2 x 128 columns for Qwen3.6, in four passes of 64 at 1024
  // threads, eight of 32 at 512). Fewer columns at once change no sum: a
  // column's rows are summed by the same parts in the same order, so the
  // result is the same bit for bit. The least: one column, parts <= 32
  // threads, a simdgroup.
  const std::string kernel = std::string("linear_attention_decode_") + type;
  const int64_t parts = ceil_div(dk, LA_ROWS);
  const int64_t budget = thread_budget(device, "linear_attention", kernel, LA_MAX_THREADS, ceil_div(parts, 32) * 32);
  const int64_t cols = std::min<int64_t>(ratio * dv, budget / parts);
  p.row_parts = static_cast<uint32_t>(parts);
  p.cols = static_cast<uint32_t>(cols);
  p.qkv_stride = static_cast<uint32_t>(qkv.stride(0));
  p.z_stride = static_cast<uint32_t>(z.stride(0));
  p.b_stride = static_cast<uint32_t>(b.stride(0));
  p.a_stride = static_cast<uint32_t>(a.stride(0));
  p.out_stride = static_cast<uint32_t>(out.stride(0));
  p.q_scale = static_cast<float>(std::sqrt(static_cast<double>(dk)));
  p.norm_eps = static_cast<float>(eps);
  // Whole simdgroups: the convolution's lanes and the norms' sums are simd
  // operations (within the budget: it is a multiple of 32).
  const int64_t threads = ceil_div(parts * cols, 32) * 32;
  launch(Launch{"linear_attention",
                kernel,
                {KernelArg::of(out), KernelArg::of(conv_state), KernelArg::of(recurrent_state), KernelArg::of(qkv),
                 KernelArg::of(z), KernelArg::of(b), KernelArg::of(a), KernelArg::of(conv_weight), KernelArg::of(A_log),
                 KernelArg::of(dt_bias), KernelArg::of(norm_weight), KernelArg::value(p)},
                {static_cast<uint32_t>(k_heads), static_cast<uint32_t>(batch), 1},
                {static_cast<uint32_t>(threads), 1, 1}});
  return out;
}

// The prefill core. Shapes as transformers' torch_chunk_gated_delta_rule
// takes them: q, k [B, T, k_heads, dk], v [B, T, v_heads, dv] (any strides),
// g [B, T, v_heads] float32 (log decay), beta [B, T, v_heads] in q's dtype,
// initial_state [B, v_heads, dk, dv] float32 or None.
void check_offsets(const at::Tensor& t, const char* name) {
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0, "linear_attention_chunk: ", name, " has a negative stride");
    last += (t.size(d) - 1) * t.stride(d);
  }
  TORCH_CHECK(last <= UINT32_MAX, "linear_attention_chunk: ", name,
              " spans 2^32 elements or more (the kernels' 32-bit indices)");
}

std::tuple<at::Tensor, at::Tensor> linear_attention_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g, const at::Tensor& beta,
                                                          const c10::optional<at::Tensor>& initial_state,
                                                          bool use_qk_l2norm) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "linear_attention_chunk: q must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.sizes() == k.sizes(),
              "linear_attention_chunk: q and k must be [batch, tokens, k_heads, dk] of one shape and v [batch, "
              "tokens, v_heads, dv]; got q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  const int64_t batch = q.size(0), tokens = q.size(1), k_heads = q.size(2), dk = q.size(3);
  const int64_t v_heads = v.size(2), dv = v.size(3);
  TORCH_CHECK(v.size(0) == batch && v.size(1) == tokens, "linear_attention_chunk: v is ", v.sizes(), ", q ", q.sizes(),
              ": batch and tokens must agree");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt && beta.scalar_type() == dt,
              "linear_attention_chunk: k, v and beta must be in q's dtype ", dt, ", got ", k.scalar_type(), ", ",
              v.scalar_type(), ", ", beta.scalar_type());
  TORCH_CHECK(g.scalar_type() == at::kFloat,
              "linear_attention_chunk: g (the log decay) must be float32, as transformers computes it; got ",
              g.scalar_type());
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == batch && t->size(1) == tokens && t->size(2) == v_heads,
                "linear_attention_chunk: g and beta must be [", batch, ", ", tokens, ", ", v_heads, "], got ",
                t->sizes());
  TORCH_CHECK(k_heads >= 1 && v_heads % k_heads == 0, "linear_attention_chunk: v_heads (", v_heads,
              ") must be a multiple of k_heads (", k_heads, ")");
  TORCH_CHECK(dk >= 1 && dk <= LA_MAX_DK && dv >= 1, "linear_attention_chunk: takes key heads of 1 to ", LA_MAX_DK,
              " and value heads of at least 1; got dk ", dk, ", dv ", dv);
  const auto device = q.device();
  for (const at::Tensor* t : {&k, &v, &g, &beta})
    TORCH_CHECK(t->device() == device, "linear_attention_chunk: every tensor must be on ", device, ", one is on ",
                t->device());
  const bool has_initial = initial_state.has_value() && initial_state->defined();
  if (has_initial) {
    const at::Tensor& s = *initial_state;
    TORCH_CHECK(s.dim() == 4 && s.size(0) == batch && s.size(1) == v_heads && s.size(2) == dk && s.size(3) == dv &&
                    s.scalar_type() == at::kFloat && s.is_contiguous() && s.device() == device,
                "linear_attention_chunk: initial_state must be contiguous float32 [", batch, ", ", v_heads, ", ", dk,
                ", ", dv, "] on ", device, ", got ", s.sizes(), " ", s.scalar_type());
  }
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) check_offsets(*t, "an input");
  const int64_t chunks = ceil_div(tokens, LA_CHUNK), rows = batch * v_heads * chunks * LA_CHUNK;
  TORCH_CHECK(rows * std::max<int64_t>({LA_FRAG_PAD(dk), LA_FRAG_PAD(dv), LA_CHUNK}) <= UINT32_MAX &&
                  batch * v_heads * dk * dv <= UINT32_MAX && batch * tokens * v_heads * dv <= UINT32_MAX,
              "linear_attention_chunk: ", batch, " sequences of ", tokens,
              " tokens need scratch of 2^32 elements or more (the kernels' 32-bit indices); split the batch");

  at::Tensor out = at::empty({batch, tokens, v_heads, dv}, q.options());
  at::Tensor state = at::empty({batch, v_heads, dk, dv}, q.options().dtype(at::kFloat));
  if (tokens == 0 || batch == 0 || v_heads == 0) {
    if (has_initial) state.copy_(*initial_state);
    else state.zero_();
    return {out, state};
  }
  LinearAttentionChunkParams p{};
  p.batch = static_cast<uint32_t>(batch);
  p.tokens = static_cast<uint32_t>(tokens);
  p.k_heads = static_cast<uint32_t>(k_heads);
  p.v_heads = static_cast<uint32_t>(v_heads);
  p.dk = static_cast<uint32_t>(dk);
  p.dv = static_cast<uint32_t>(dv);
  p.ratio = static_cast<uint32_t>(v_heads / k_heads);
  p.chunks = static_cast<uint32_t>(chunks);
  // Scratch rows padded to whole 8 x 8 fragments (the kernels' simdgroup matrices).
  const int64_t dkp = LA_FRAG_PAD(dk), dvp = LA_FRAG_PAD(dv);
  int64_t tile = LA_MAX_TILE;  // a power of two (the kernel's thread layout), the state slice within LA_STATE_ELEMS
  while (tile * dkp > LA_STATE_ELEMS) tile /= 2;
  p.tile = static_cast<uint32_t>(tile);
  p.l2norm = use_qk_l2norm ? 1u : 0u;
  p.has_initial = has_initial ? 1u : 0u;
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = static_cast<uint32_t>(q.stride(d));
    p.k_stride[d] = static_cast<uint32_t>(k.stride(d));
    p.v_stride[d] = static_cast<uint32_t>(v.stride(d));
  }
  for (int d = 0; d < 3; ++d) {
    p.g_stride[d] = static_cast<uint32_t>(g.stride(d));
    p.beta_stride[d] = static_cast<uint32_t>(beta.stride(d));
  }
  p.q_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));

  const char* type = kernel_type_name(dt);
  const std::string prep = std::string("linear_attention_chunk_prep_") + type;
  const std::string pass = std::string("linear_attention_chunk_state_") + type;
  // Both kernels run their fixed threadgroup (their least) or neither is encoded.
  for (const std::string* name : {&prep, &pass})
    thread_budget(device, "linear_attention", *name, LA_CHUNK_THREADS, LA_CHUNK_THREADS);
  // float32 scratch between the two dispatches, per (sequence, value head,
  // padded token): q and k decayed, w [.., dkp], u [.., dvp] (rows padded to
  // whole fragments, zeros in the padding), the intra-chunk attention [..,
  // LA_CHUNK]; the chunks' decays.
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor qd = at::empty({rows, dkp}, f32), kd = at::empty({rows, dkp}, f32), w = at::empty({rows, dkp}, f32);
  at::Tensor u = at::empty({rows, dvp}, f32), attn = at::empty({rows, LA_CHUNK}, f32);
  at::Tensor decay = at::empty({batch * v_heads * chunks}, f32);
  const std::array<uint32_t, 3> threads{LA_CHUNK_THREADS, 1, 1};
  launch(Launch{"linear_attention",
                prep,
                {KernelArg::of(qd), KernelArg::of(kd), KernelArg::of(w), KernelArg::of(u), KernelArg::of(attn),
                 KernelArg::of(decay), KernelArg::of(q), KernelArg::of(k), KernelArg::of(v), KernelArg::of(g),
                 KernelArg::of(beta), KernelArg::value(p)},
                {static_cast<uint32_t>(chunks), static_cast<uint32_t>(v_heads), static_cast<uint32_t>(batch)},
                threads});
  // Without an initial state the kernel reads none: the final state's
  // buffer stands in for the binding.
  const at::Tensor& init = has_initial ? *initial_state : state;
  launch(Launch{
      "linear_attention",
      pass,
      {KernelArg::of(out), KernelArg::of(state), KernelArg::of(init), KernelArg::of(qd), KernelArg::of(kd),
       KernelArg::of(w), KernelArg::of(u), KernelArg::of(attn), KernelArg::of(decay), KernelArg::value(p)},
      {static_cast<uint32_t>(ceil_div(dv, p.tile)), static_cast<uint32_t>(v_heads), static_cast<uint32_t>(batch)},
      threads});
  return {out, state};
}

using c10::DispatchKey;

const RoutedOp kLinearAttentionDecode(FamilyId::linear_attention, "mps_ext::linear_attention_decode");

template <DispatchKey K>
at::Tensor linear_attention_decode_impl(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b,
                                        const at::Tensor& a, at::Tensor& conv_state, at::Tensor& recurrent_state,
                                        const at::Tensor& conv_weight, const at::Tensor& A_log,
                                        const at::Tensor& dt_bias, const at::Tensor& norm_weight, int64_t k_heads,
                                        double eps) {
  return run_own(kLinearAttentionDecode, K, [&] {
    return linear_attention_decode(qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias, norm_weight,
                                   k_heads, eps);
  });
}

const RoutedOp kLinearAttentionChunk(FamilyId::linear_attention, "mps_ext::linear_attention_chunk");

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor> linear_attention_chunk_impl(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& g,
                                                               const at::Tensor& beta,
                                                               const c10::optional<at::Tensor>& initial_state,
                                                               bool use_qk_l2norm) {
  return run_own(kLinearAttentionChunk, K,
                 [&] { return linear_attention_chunk(q, k, v, g, beta, initial_state, use_qk_l2norm); });
}

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
template <DispatchKey K>
void register_linear_attention(FamilyOps& ops) {
  ops.own("linear_attention_chunk(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? initial_state, "
          "bool use_qk_l2norm) -> (Tensor, Tensor)",
          TORCH_FN(linear_attention_chunk_impl<K>));
  ops.own("linear_attention_decode(Tensor qkv, Tensor z, Tensor b, Tensor a, Tensor(a!) conv_state, "
          "Tensor(b!) recurrent_state, Tensor conv_weight, Tensor A_log, Tensor dt_bias, Tensor norm_weight, "
          "int k_heads, float eps) -> Tensor",
          TORCH_FN(linear_attention_decode_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(linear_attention, mps_ext::register_linear_attention)
