// torch.ops.mps_ext.kv_append: the KV cache append of an attention layer,
// one dispatch (kernels_metal/kv_cache.metal), for mps_ext.optimize's
// attention forward (mps_ext/passes/attention.py), where transformers'
// DynamicLayer.update makes two torch.cat calls that re-copy the whole cache
// every token.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
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
  auto stride = [](const at::Tensor& t, int64_t d) { return static_cast<uint32_t>(t.size(d) > 1 ? t.stride(d) : 0); };
  p.k_stride_b = stride(kc, 0), p.k_stride_h = stride(kc, 1), p.k_stride_t = stride(kc, 2);
  p.v_stride_b = stride(vc, 0), p.v_stride_h = stride(vc, 1), p.v_stride_t = stride(vc, 2);
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

using c10::DispatchKey;

const RoutedOp kKvAppend(FamilyId::kv_cache, "mps_ext::kv_append");

template <DispatchKey K>
void kv_append_impl(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  run_own(kKvAppend, K, [&] {
    kv_append(k_cache, v_cache, k, v, start);
    return true;
  });
}

// Its Meta (fake) kernel, for torch.compile, is in mps_ext/_meta.py.
template <DispatchKey K>
void register_kv_cache(FamilyOps& ops) {
  ops.own("kv_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, int start) -> ()",
          TORCH_FN(kv_append_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(kv_cache, mps_ext::register_kv_cache)
