// constant_pad_nd. Kernel: kernels_metal/pad.metal. One dispatch per call;
// nothing about the shape is cached (MPSGraph built a graph per shape).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "backend/launch.h"
#include "ops/ops.h"
#include "ops/registration.h"
#include "ops/registry.h"
#include "pad_params.h"

namespace mps_ext {
namespace {

constexpr uint32_t kThreads = 256;

// The output shape and, per dimension, how far the input is shifted.
// Checks and messages follow torch's constant_pad_nd.
struct Geometry {
  std::vector<int64_t> out_sizes;
  std::vector<int64_t> pad_before;  // negative: cropped
};

Geometry geometry(const at::Tensor& self, c10::IntArrayRef pad) {
  TORCH_CHECK(pad.size() % 2 == 0, "Length of pad must be even but instead it equals ", pad.size());
  const int64_t ndim = self.dim();
  const int64_t npad = static_cast<int64_t>(pad.size()) / 2;
  TORCH_CHECK(ndim >= npad, "Length of pad should be no more than twice the number of dimensions of the input. ",
              "Pad length is ", pad.size(), "while the input has ", ndim, "dimensions.");
  Geometry g;
  g.out_sizes = self.sizes().vec();
  g.pad_before.assign(ndim, 0);
  for (int64_t i = ndim - npad; i < ndim; ++i) {
    int64_t k = 2 * (ndim - i - 1);
    int64_t size = self.size(i);
    // torch crops with narrow() first, left then right: same checks.
    if (pad[k] < 0) {
      size += pad[k];
      TORCH_CHECK(size >= 0, "narrow(): length must be non-negative.");
    }
    if (pad[k + 1] < 0) {
      size += pad[k + 1];
      TORCH_CHECK(size >= 0, "narrow(): length must be non-negative.");
    }
    g.out_sizes[i] = size + std::max<int64_t>(pad[k], 0) + std::max<int64_t>(pad[k + 1], 0);
    g.pad_before[i] = pad[k];
  }
  return g;
}

// The fill value as the output dtype's bits, converted (and range-checked)
// the way torch's fill_ does.
uint64_t fill_bits(const c10::Scalar& value, c10::ScalarType dtype) {
  uint64_t bits = 0;
  AT_DISPATCH_V2(dtype, "constant_pad_nd", AT_WRAP([&] {
                   scalar_t v = value.to<scalar_t>();
                   if constexpr (sizeof(scalar_t) <= sizeof(bits)) {  // wider types go to the stock kernel
                     std::memcpy(&bits, &v, sizeof(scalar_t));
                   }
                 }),
                 AT_EXPAND(AT_ALL_TYPES_AND_COMPLEX), at::kHalf, at::kBFloat16, at::kBool, at::kComplexHalf,
                 AT_EXPAND(AT_FLOAT8_TYPES), AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  return bits;
}

const char* size_name(int64_t itemsize) {
  switch (itemsize) {
    case 1: return "1";
    case 2: return "2";
    case 4: return "4";
    default: return "8";
  }
}

}  // namespace

std::string pad_unsupported(const at::Tensor& self, c10::IntArrayRef) {
  if (self.layout() != at::kStrided) return "layout is not strided";
  if (self.is_quantized()) return "quantized tensor";
  int64_t itemsize = self.itemsize();
  if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
    return std::string("dtype ") + c10::toString(self.scalar_type()) + " (elements of 1, 2, 4 or 8 bytes are handled)";
  if (self.dim() > MPS_EXT_MAX_DIMS) return "more than 8 dimensions";
  return "";
}

at::Tensor constant_pad(const at::Tensor& self, c10::IntArrayRef pad, const c10::Scalar& value) {
  Geometry g = geometry(self, pad);
  // With nothing to fill, aten returns a copy of the cropped input (clone()
  // keeps its stride order) and never converts the fill value; so do we.
  if (std::none_of(pad.begin(), pad.end(), [](int64_t p) { return p > 0; })) {
    at::Tensor cropped = self;
    for (int64_t d = 0; d < self.dim(); ++d)
      if (cropped.size(d) != g.out_sizes[d])
        cropped = cropped.narrow(d, std::max<int64_t>(-g.pad_before[d], 0), g.out_sizes[d]);
    return cropped.clone();
  }
  uint64_t fill = fill_bits(value, self.scalar_type());
  auto out = at::empty(g.out_sizes, self.options().memory_format(self.suggest_memory_format()));
  const int64_t numel = out.numel();
  if (numel == 0) return out;

  // Dimensions in the output's memory order, outermost first, so that
  // consecutive threads write consecutive addresses.
  const int64_t ndim = self.dim();
  std::vector<int64_t> order(ndim);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return out.stride(a) > out.stride(b); });

  PadParams p{};
  p.numel = numel;
  p.rank = static_cast<uint32_t>(ndim);
  p.fill_bits = fill;
  int64_t max_offset = 0;
  for (int64_t k = 0; k < ndim; ++k) {
    int64_t d = order[k];
    p.out_sizes[k] = g.out_sizes[d];
    p.in_sizes[k] = self.size(d);
    p.in_strides[k] = self.stride(d);
    p.pad_before[k] = g.pad_before[d];
    max_offset += (self.size(d) - 1) * std::abs(self.stride(d));
  }
  // Index width: 32-bit arithmetic is faster on the GPU; any offset past
  // 2^31 needs the 64-bit variant.
  const bool wide = numel > INT32_MAX - 2 * PAD_ELEMENTS_PER_THREAD || max_offset > INT32_MAX;
  const int64_t threads = (numel + PAD_ELEMENTS_PER_THREAD - 1) / PAD_ELEMENTS_PER_THREAD;
  TORCH_CHECK(threads <= 0xffffffffll, "mps_ext constant_pad_nd: output too large (", numel, " elements)");
  const int64_t groups = (threads + kThreads - 1) / kThreads;
  std::string kernel = std::string("constant_pad_") + size_name(self.itemsize()) + (wide ? "_i64" : "_i32");
  launch(Launch{"pad", kernel, {KernelArg::of(out), KernelArg::of(self), KernelArg::value(p)},
                {static_cast<uint32_t>(groups), 1, 1}, {kThreads, 1, 1}});
  return out;
}


// -------------------------------------------------------- registration --
namespace {

template <c10::DispatchKey K>
at::Tensor constant_pad_impl(const at::Tensor& self, c10::SymIntArrayRef pad, const c10::Scalar& value) {
  c10::IntArrayRef p = C10_AS_INTARRAYREF_SLOW(pad);
  return route(family("pad"), "aten::constant_pad_nd", K, pad_unsupported(self, p),
               [&] { return constant_pad(self, p, value); }, self, pad, value);
}

template <c10::DispatchKey K>
void register_pad(torch::Library& m) {
  m.impl("constant_pad_nd", TORCH_FN(constant_pad_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY("pad", mps_ext::register_pad, "aten::constant_pad_nd")
