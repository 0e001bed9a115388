// torch.ops.mps_ext.short_conv_decode: an LFM2 conv layer's decode step
// (transformers' Lfm2ShortConv / Lfm2MoeShortConv) between in_proj and
// out_proj, one dispatch (kernels_metal/short_conv.metal). transformers'
// torch code for the same step is 5 ops (B * x, causal_conv1d_update's
// fallback: cat, copy_ into the state, conv1d; C * y); mps_ext.optimize
// (mps_ext/passes/short_conv.py) puts the layers on this op.
//
// BCx: in_proj's output for one token a sequence, [batch, 1, 3 * hidden]
// (B, C and x its thirds, as the layer's transpose and chunk read it), rows
// contiguous. In place: the window `conv_state` [batch, hidden, K] as
// transformers' cache holds it, moved one step on with B * x as its last
// tap. Returns C * conv(window) [batch, 1, hidden] contiguous in BCx's
// dtype, out_proj's input.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <initializer_list>

#include "backend/launch.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "short_conv_params.h"

namespace mps_ext {
namespace {

at::Tensor short_conv_decode(const at::Tensor& BCx, at::Tensor& conv_state, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias_opt) {
  TORCH_CHECK(BCx.defined() && weight.defined(), "short_conv_decode: BCx and weight are required; got None");
  TORCH_CHECK(conv_state.defined(), "short_conv_decode: conv_state is the layer's cache after a prefill (transformers: "
                                    "past_key_values.get_conv_state(layer_idx)); got None");
  const auto dt = BCx.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "short_conv_decode: BCx must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(BCx.dim() == 3 && BCx.size(1) == 1 && BCx.size(2) % 3 == 0 && BCx.size(2) > 0 && (BCx.stride(2) == 1) &&
                  BCx.stride(0) >= BCx.size(2) && BCx.stride(0) <= UINT32_MAX,
              "short_conv_decode: BCx must be in_proj's output for one token a sequence, [batch, 1, 3 * hidden] "
              "with contiguous rows, got ",
              BCx.sizes(), " strides ", BCx.strides());
  const int64_t batch = BCx.size(0), hidden = BCx.size(2) / 3;
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(0) == batch && conv_state.size(1) == hidden &&
                  conv_state.size(2) >= 1 && conv_state.scalar_type() == dt && conv_state.is_contiguous(),
              "short_conv_decode: conv_state must be contiguous [", batch, ", ", hidden, ", kernel size] in ", dt,
              ", got ", conv_state.sizes(), " ", conv_state.scalar_type(),
              conv_state.is_contiguous() ? "" : " (not contiguous)");
  const int64_t k = conv_state.size(2);
  TORCH_CHECK(k <= SC_MAX_K, "short_conv_decode: takes windows (conv_state's last dimension) of 1 to ", SC_MAX_K,
              " taps, got ", k);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == hidden && weight.size(1) == k && weight.scalar_type() == dt &&
                  weight.is_contiguous(),
              "short_conv_decode: weight must be contiguous [", hidden, ", ", k, "] in ", dt,
              " (the conv's weight squeezed), got ", weight.sizes(), " ", weight.scalar_type());
  const bool has_bias = bias_opt.has_value() && bias_opt->defined();
  if (has_bias)
    TORCH_CHECK(bias_opt->dim() == 1 && bias_opt->size(0) == hidden && bias_opt->scalar_type() == dt &&
                    bias_opt->is_contiguous(),
                "short_conv_decode: bias must be None or contiguous [", hidden, "] in ", dt, ", got ",
                bias_opt->sizes(), " ", bias_opt->scalar_type());
  const auto device = BCx.device();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&conv_state, &weight})
    TORCH_CHECK(t->device() == device, "short_conv_decode: every tensor must be on ", device, ", one is on ",
                t->device());
  TORCH_CHECK(!has_bias || bias_opt->device() == device, "short_conv_decode: every tensor must be on ", device,
              ", bias is on ", bias_opt->device());
  TORCH_CHECK(conv_state.numel() <= UINT32_MAX && batch * BCx.stride(0) <= UINT32_MAX,
              "short_conv_decode: conv_state and BCx must have fewer than 2^32 elements (32-bit indices)");

  at::Tensor out = at::empty({batch, 1, hidden}, BCx.options());
  if (batch == 0) return out;
  ShortConvParams p{};
  p.batch = static_cast<uint32_t>(batch);
  p.hidden = static_cast<uint32_t>(hidden);
  p.conv_k = static_cast<uint32_t>(k);
  p.bcx_stride = static_cast<uint32_t>(BCx.stride(0));
  p.has_bias = has_bias ? 1 : 0;
  // Where torch's CPU convolution adds the bias (the order the tests compare
  // with, bit for bit): oneDNN's float32 and bfloat16 kernels start the sum
  // with it; float16 takes torch's unfold-and-GEMM path (slow_conv2d), which
  // adds it to the GEMM's sum.
  p.bias_last = dt == at::kHalf ? 1 : 0;
  const at::Tensor& bias = has_bias ? *bias_opt : weight;  // bound but not read without a bias
  launch(Launch{"short_conv",
                std::string("short_conv_decode_") + kernel_type_name(dt),
                {KernelArg::of(out), KernelArg::of(conv_state), KernelArg::of(BCx), KernelArg::of(weight),
                 KernelArg::of(bias), KernelArg::value(p)},
                {static_cast<uint32_t>(ceil_div(hidden, SC_THREADS)), static_cast<uint32_t>(batch), 1},
                {SC_THREADS, 1, 1}});
  return out;
}

using c10::DispatchKey;

const RoutedOp kShortConvDecode(FamilyId::short_conv, "mps_ext::short_conv_decode");

template <DispatchKey K>
at::Tensor short_conv_decode_impl(const at::Tensor& BCx, at::Tensor& conv_state, const at::Tensor& weight,
                                  const c10::optional<at::Tensor>& bias) {
  return run_own(kShortConvDecode, K, [&] { return short_conv_decode(BCx, conv_state, weight, bias); });
}

// Its Meta (fake) kernel, for torch.compile, is in mps_ext/_meta.py.
template <DispatchKey K>
void register_short_conv(FamilyOps& ops) {
  ops.own("short_conv_decode(Tensor BCx, Tensor(a!) conv_state, Tensor weight, Tensor? bias) -> Tensor",
          TORCH_FN(short_conv_decode_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(short_conv, mps_ext::register_short_conv)
