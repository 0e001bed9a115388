// torch.ops.mps_ext.kv_append: the KV cache append of an attention layer,
// one dispatch (kernels_metal/kv_cache.metal), for mps_ext.optimize's
// attention forward (mps_ext/passes/attention.py), where transformers'
// DynamicLayer.update makes two torch.cat calls that re-copy the whole cache
// every token. torch.ops.mps_ext.kv_decode_attention: a decoded token's
// attention over that cache, grouped-query, each key and value row read once
// for all the query heads that share it (torch's decode kernels read it once
// per query head).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>

#include "backend/launch.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "kv_cache_params.h"
#include "ops/ops.h"

namespace mps_ext {
namespace {

// Writes k and v [B, H, T, D] (views: the head dimension contiguous) at rows
// start .. start + T - 1 of k_cache and v_cache [B, H, capacity, D]
// (contiguous), in place.
void kv_append(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  check_float(k_cache, "kv_append", "k_cache");
  const auto dt = k_cache.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&v_cache, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == dt, "mps_ext kv_append: the caches and the new rows must have one dtype, got ", dt,
                " and ", t->scalar_type());
    TORCH_CHECK(t->device() == k_cache.device(), "mps_ext kv_append: k_cache is on ", k_cache.device(),
                " and another tensor on ", t->device());
  }
  TORCH_CHECK(
      k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
      "mps_ext kv_append: k_cache and v_cache must be contiguous [batch, heads, capacity, head_dim] of one "
      "shape, got ",
      k_cache.sizes(), " and ", v_cache.sizes(),
      k_cache.is_contiguous() && v_cache.is_contiguous() ? "" : " (not contiguous)");
  const int64_t B = k_cache.size(0), H = k_cache.size(1), cap = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
              "mps_ext kv_append: k and v must be [", B, ", ", H, ", tokens, ", D, "] as the caches ", k_cache.sizes(),
              ", got ", k.sizes(), " and ", v.sizes());
  const int64_t T = k.size(2);
  TORCH_CHECK(start >= 0 && start + T <= cap, "mps_ext kv_append: rows ", start, " to ", start + T,
              " do not fit a cache of capacity ", cap);
  if (B == 0 || H == 0 || T == 0 || D == 0) return;
  // The kernel indexes the head dimension as contiguous.
  auto last_contiguous = [](const at::Tensor& t) { return t.size(-1) == 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor kc = last_contiguous(k), vc = last_contiguous(v);
  auto extent = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return last + 1;
  };
  TORCH_CHECK(fits_32bit(k_cache.numel()) && fits_32bit(extent(kc)) && fits_32bit(extent(vc)),
              "mps_ext kv_append: tensors past 2^31 elements are not supported, got caches ", k_cache.sizes());
  TORCH_CHECK(H <= UINT32_MAX && T <= 65535 && B <= 65535,
              "mps_ext kv_append: at most 65535 tokens and batch "
              "rows a call, got ",
              T, " and ", B);
  KvAppendParams p{};
  p.heads = static_cast<uint32_t>(H);
  p.head_dim = static_cast<uint32_t>(D);
  p.capacity = static_cast<uint32_t>(cap);
  p.start = static_cast<uint32_t>(start);
  p.k_stride_b = stride_or_zero(kc, 0), p.k_stride_h = stride_or_zero(kc, 1), p.k_stride_t = stride_or_zero(kc, 2);
  p.v_stride_b = stride_or_zero(vc, 0), p.v_stride_h = stride_or_zero(vc, 1), p.v_stride_t = stride_or_zero(vc, 2);
  // The threads loop over the row: a lower pipeline limit means more passes.
  const std::string kernel = std::string("kv_append_") + kernel_type_name(dt);
  const int64_t threads =
      std::min(thread_budget(k_cache.device(), "kv_cache", kernel, KV_APPEND_MAX_THREADS), ceil_div(D, 32) * 32);
  launch(Launch{
      "kv_cache",
      kernel,
      {KernelArg::of(k_cache), KernelArg::of(v_cache), KernelArg::of(kc), KernelArg::of(vc), KernelArg::value(p)},
      {static_cast<uint32_t>(H), static_cast<uint32_t>(T), static_cast<uint32_t>(B)},
      {static_cast<uint32_t>(threads), 1, 1}});
}

// A decoded token's attention: q [B, Hq, 1, D] against k and v [B, Hkv, n,
// D] (views; the head dimension contiguous), Hq a multiple of Hkv, every key
// visible (the causal mask of one query row at the end of the cache);
// returns [B, Hq, 1, D]. Blocks of keys per threadgroup: enough threadgroups
// to fill a GPU (kDecodeThreadgroups over B * Hkv), at least
// kDecodeMinBlockKeys keys each; one block writes the output, several add
// kv_decode_merge's dispatch.
constexpr int64_t kDecodeThreadgroups = KV_DECODE_MAX_BLOCKS;
constexpr int64_t kDecodeMinBlockKeys = 128;

at::Tensor kv_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  check_float(q, "kv_decode_attention", "q");
  const auto dt = q.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k, &v}) {
    TORCH_CHECK(t->scalar_type() == dt, "mps_ext kv_decode_attention: q, k and v must have one dtype, got ", dt,
                " and ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), "mps_ext kv_decode_attention: q is on ", q.device(), " and k or v on ",
                t->device());
  }
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1,
              "mps_ext kv_decode_attention: q must be [batch, q_heads, 1, head_dim] (one decoded token), got ",
              q.sizes());
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D,
              "mps_ext kv_decode_attention: k and v must be [", B, ", kv_heads, keys, ", D, "] as q ", q.sizes(),
              ", got ", k.sizes(), " and ", v.sizes());
  const int64_t Hkv = k.size(1), n = k.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "mps_ext kv_decode_attention: the query heads (", Hq,
              ") must be a multiple of the key-value heads (", Hkv, ")");
  const int64_t gqa = Hq / Hkv;
  TORCH_CHECK(gqa <= KV_DECODE_MAX_SIMDGROUPS, "mps_ext kv_decode_attention: at most ", KV_DECODE_MAX_SIMDGROUPS,
              " query heads per key-value head, got ", gqa);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "mps_ext kv_decode_attention: head_dim must be 64, 128 or 256, got ", D);
  TORCH_CHECK(n > 0 || B == 0, "mps_ext kv_decode_attention: no keys to attend to (k has ", n, " rows)");
  TORCH_CHECK(std::isfinite(scale), "mps_ext kv_decode_attention: scale must be finite, got ", scale);
  auto out = at::empty({B, Hq, 1, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0 || Hq == 0) return out;
  // The kernel indexes the head dimension as contiguous.
  auto last_contiguous = [](const at::Tensor& t) { return t.size(-1) == 1 || t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = last_contiguous(q), kc = last_contiguous(k), vc = last_contiguous(v);
  auto extent = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return last + 1;
  };
  const int64_t tile = KV_DECODE_TILE_ELEMS / D;
  const int64_t want_blocks = std::max<int64_t>(1, ceil_div(kDecodeThreadgroups, B * Hkv));
  const int64_t per_block =
      ceil_div(std::max(kDecodeMinBlockKeys, ceil_div(n, want_blocks)), tile) * tile;  // whole tiles
  const int64_t blocks = ceil_div(n, per_block);
  TORCH_CHECK(fits_32bit(extent(qc)) && fits_32bit(extent(kc)) && fits_32bit(extent(vc)) &&
                  fits_32bit(B * Hq * blocks * D) && fits_32bit(n + per_block),
              "mps_ext kv_decode_attention: tensors past 2^31 elements are not supported, got k ", k.sizes());
  TORCH_CHECK(blocks <= KV_DECODE_MAX_BLOCKS, "mps_ext kv_decode_attention: ", blocks,
              " blocks of keys");  // by the rule above
  TORCH_CHECK(B <= 65535, "mps_ext kv_decode_attention: at most 65535 sequences a call, got ", B);
  const std::string type = kernel_type_name(dt);
  const std::string kernel = "kv_decode_attention_" + type + "_" + std::to_string(D);
  const std::string merge = "kv_decode_merge_" + type;
  // A query head per simdgroup at least; the rest of the threadgroup's
  // simdgroups walk other keys of the tile (streams) where gqa leaves room.
  const int64_t budget = thread_budget(q.device(), "kv_cache", kernel, KV_DECODE_MAX_SIMDGROUPS * 32, 32 * gqa);
  const int64_t streams =
      std::clamp<int64_t>(std::min<int64_t>(KV_DECODE_STREAM_SIMDGROUPS, budget / 32) / gqa, 1, budget / (32 * gqa));
  if (blocks > 1) thread_budget(q.device(), "kv_cache", merge, KV_DECODE_MAX_HEAD_DIM, D);  // before the first
  DecodeAttentionParams p{};
  p.q_heads = static_cast<uint32_t>(Hq);
  p.kv_heads = static_cast<uint32_t>(Hkv);
  p.gqa = static_cast<uint32_t>(gqa);
  p.streams = static_cast<uint32_t>(streams);
  p.keys = static_cast<uint32_t>(n);
  p.keys_per_block = static_cast<uint32_t>(per_block);
  p.blocks = static_cast<uint32_t>(blocks);
  p.q_stride_b = stride_or_zero(qc, 0), p.q_stride_h = stride_or_zero(qc, 1);
  p.k_stride_b = stride_or_zero(kc, 0), p.k_stride_h = stride_or_zero(kc, 1), p.k_stride_t = stride_or_zero(kc, 2);
  p.v_stride_b = stride_or_zero(vc, 0), p.v_stride_h = stride_or_zero(vc, 1), p.v_stride_t = stride_or_zero(vc, 2);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
  // One block: the kernel writes out and never touches the partials (out bound in their place).
  const at::Tensor partial_o = blocks > 1 ? at::empty({B * Hq * blocks * D}, q.options().dtype(at::kFloat)) : out;
  const at::Tensor partial_ml = blocks > 1 ? at::empty({B * Hq * blocks * 2}, q.options().dtype(at::kFloat)) : out;
  launch(Launch{"kv_cache",
                kernel,
                {KernelArg::of(qc), KernelArg::of(kc), KernelArg::of(vc), KernelArg::of(out), KernelArg::of(partial_o),
                 KernelArg::of(partial_ml), KernelArg::value(p)},
                {static_cast<uint32_t>(Hkv), static_cast<uint32_t>(blocks), static_cast<uint32_t>(B)},
                {static_cast<uint32_t>(32 * gqa * streams), 1, 1}});
  if (blocks > 1) {
    launch(Launch{"kv_cache",
                  merge,
                  {KernelArg::of(partial_o), KernelArg::of(partial_ml), KernelArg::of(out),
                   KernelArg::value(static_cast<uint32_t>(D)), KernelArg::value(static_cast<uint32_t>(blocks))},
                  {static_cast<uint32_t>(Hq), static_cast<uint32_t>(B), 1},
                  {static_cast<uint32_t>(D), 1, 1}});
  }
  return out;
}

using c10::DispatchKey;

const RoutedOp kKvAppend(FamilyId::kv_cache, "mps_ext::kv_append");

template <DispatchKey K>
void kv_append_impl(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  run_own(kKvAppend, K, [&] {
    kv_append(k_cache, v_cache, k, v, start);
    return true;
  });
}

const RoutedOp kKvDecodeAttention(FamilyId::kv_cache, "mps_ext::kv_decode_attention");

template <DispatchKey K>
at::Tensor kv_decode_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return run_own(kKvDecodeAttention, K, [&] { return kv_decode_attention(q, k, v, scale); });
}

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
template <DispatchKey K>
void register_kv_cache(FamilyOps& ops) {
  ops.own("kv_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, int start) -> ()",
          TORCH_FN(kv_append_impl<K>));
  ops.own("kv_decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor",
          TORCH_FN(kv_decode_attention_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(kv_cache, mps_ext::register_kv_cache)
