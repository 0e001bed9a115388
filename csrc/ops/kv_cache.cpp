// torch.ops.mps_ext.sigmoid_gate and torch.ops.mps_ext.kv_append: an
// attention layer's output gate and its KV cache append, one dispatch each
// (kernels_metal/attention.metal), for mps_ext.optimize's attention forward
// (mps_ext/passes/attention.py). Eager, the gate is three (a copy of q_proj's
// strided gate half, sigmoid, mul) and transformers' DynamicLayer.update two
// torch.cat calls that re-copy the whole cache every token.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <string>

#include "attention_params.h"
#include "backend/launch.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

void check_float(const at::Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "mps_ext ", op, ": ", name,
              " must be float32, float16 or bfloat16, got ", dt);
}

// The stride between rows of the last dimension of `t` if its leading
// dimensions collapse into one (a view of rows: q_proj's gate half does), -1
// otherwise.
int64_t row_stride(const at::Tensor& t) {
  const int64_t n = t.size(-1);
  int64_t stride = -1, next = -1;  // the stride the next outer dimension must have
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
    } else if (t.stride(d) != next) {
      return -1;
    }
    next = t.stride(d) * t.size(d);
  }
  return stride < 0 ? n : stride;
}

// out = x * sigmoid(gate): x and gate of one shape and dtype; gate may be a
// strided view whose last dimension is contiguous. out is contiguous.
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& gate) {
  check_float(x, "sigmoid_gate", "x");
  TORCH_CHECK(gate.scalar_type() == x.scalar_type(), "mps_ext sigmoid_gate: gate must be in x's dtype (",
              x.scalar_type(), "), got ", gate.scalar_type());
  TORCH_CHECK(gate.sizes() == x.sizes(), "mps_ext sigmoid_gate: x and gate must have one shape (no broadcasting), "
              "got ", x.sizes(), " and ", gate.sizes());
  TORCH_CHECK(x.device() == gate.device(), "mps_ext sigmoid_gate: x is on ", x.device(), " and gate on ",
              gate.device());
  TORCH_CHECK(x.dim() >= 1, "mps_ext sigmoid_gate: x and gate must have a last dimension, got 0-d tensors");
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t n = x.size(-1);
  const at::Tensor xc = x.contiguous();
  // The kernel reads gate as rows of contiguous elements; a layout that is
  // not (rare: q_proj's gate half is) is copied first.
  at::Tensor g = gate;
  int64_t gs = (n == 1 || g.stride(-1) == 1) ? row_stride(g) : -1;
  if (gs < 0) g = g.contiguous(), gs = n;
  const int64_t rows = out.numel() / n;
  TORCH_CHECK(fits_32bit(out.numel()) && fits_32bit((rows - 1) * gs + n) && rows <= UINT32_MAX,
              "mps_ext sigmoid_gate: tensors past 2^31 elements are not supported, got ", rows, " rows of ", n);
  SigmoidGateParams p{};
  p.rows = static_cast<uint32_t>(rows);
  p.n = static_cast<uint32_t>(n);
  p.gate_row_stride = static_cast<uint32_t>(rows > 1 ? gs : n);
  // A thread per element: a lower pipeline limit means more column blocks.
  const std::string kernel = std::string("sigmoid_gate_") + kernel_type_name(x.scalar_type());
  const int64_t threads =
      std::min(thread_budget(x.device(), "attention", kernel, SIGMOID_GATE_THREADS), ceil_div(n, 32) * 32);
  launch(Launch{"attention", kernel,
                {KernelArg::of(out), KernelArg::of(xc), KernelArg::of(g), KernelArg::value(p)},
                {static_cast<uint32_t>(ceil_div(n, threads)), static_cast<uint32_t>(rows), 1},
                {static_cast<uint32_t>(threads), 1, 1}});
  return out;
}

// Writes k and v [B, H, T, D] (views: the head dimension contiguous) at rows
// start .. start + T - 1 of k_cache and v_cache [B, H, capacity, D]
// (contiguous), in place.
void kv_append(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, int64_t start) {
  check_float(k_cache, "kv_append", "k_cache");
  const auto dt = k_cache.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&v_cache, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == dt, "mps_ext kv_append: the caches and the new rows must have one dtype, got ",
                dt, " and ", t->scalar_type());
    TORCH_CHECK(t->device() == k_cache.device(), "mps_ext kv_append: k_cache is on ", k_cache.device(),
                " and another tensor on ", t->device());
  }
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "mps_ext kv_append: k_cache and v_cache must be contiguous [batch, heads, capacity, head_dim] of one "
              "shape, got ", k_cache.sizes(), " and ", v_cache.sizes(), k_cache.is_contiguous() &&
              v_cache.is_contiguous() ? "" : " (not contiguous)");
  const int64_t B = k_cache.size(0), H = k_cache.size(1), cap = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
              "mps_ext kv_append: k and v must be [", B, ", ", H, ", tokens, ", D, "] as the caches ",
              k_cache.sizes(), ", got ", k.sizes(), " and ", v.sizes());
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
  TORCH_CHECK(H <= UINT32_MAX && T <= 65535 && B <= 65535, "mps_ext kv_append: at most 65535 tokens and batch "
              "rows a call, got ", T, " and ", B);
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
  const int64_t threads = std::min(thread_budget(k_cache.device(), "attention", kernel, KV_APPEND_MAX_THREADS),
                                   ceil_div(D, 32) * 32);
  launch(Launch{"attention", kernel,
                {KernelArg::of(k_cache), KernelArg::of(v_cache), KernelArg::of(kc), KernelArg::of(vc),
                 KernelArg::value(p)},
                {static_cast<uint32_t>(H), static_cast<uint32_t>(T), static_cast<uint32_t>(B)},
                {static_cast<uint32_t>(threads), 1, 1}});
}

using c10::DispatchKey;

// Counted with the norm family, as qk_norm_rope: the attention's pieces of mps_ext.optimize.
const RoutedOp kSigmoidGate(FamilyId::norm, "mps_ext::sigmoid_gate");
const RoutedOp kKvAppend(FamilyId::norm, "mps_ext::kv_append");

template <DispatchKey K>
at::Tensor sigmoid_gate_impl(const at::Tensor& x, const at::Tensor& gate) {
  return run_own(kSigmoidGate, K, [&] { return sigmoid_gate(x, gate); });
}

template <DispatchKey K>
void kv_append_impl(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    int64_t start) {
  run_own(kKvAppend, K, [&] {
    kv_append(k_cache, v_cache, k, v, start);
    return true;
  });
}

}  // namespace
}  // namespace mps_ext

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
TORCH_LIBRARY_FRAGMENT(mps_ext, m) {
  m.def("sigmoid_gate(Tensor x, Tensor gate) -> Tensor");
  m.def("kv_append(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, int start) -> ()");
}

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) {
  m.impl("sigmoid_gate", TORCH_FN(mps_ext::sigmoid_gate_impl<c10::DispatchKey::CPU>));
  m.impl("kv_append", TORCH_FN(mps_ext::kv_append_impl<c10::DispatchKey::CPU>));
}

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) {
  m.impl("sigmoid_gate", TORCH_FN(mps_ext::sigmoid_gate_impl<c10::DispatchKey::MPS>));
  m.impl("kv_append", TORCH_FN(mps_ext::kv_append_impl<c10::DispatchKey::MPS>));
}
#endif
