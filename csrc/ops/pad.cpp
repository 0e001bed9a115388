// constant_pad_nd. Kernel: kernels_metal/pad.metal. One dispatch per call;
// nothing about the shape is cached (MPSGraph built a graph per shape).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "backend/launch.h"
#include "dispatch/kernel_choice.h"
#include "ops/ops.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "pad_params.h"

namespace mps_ext {
namespace {

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

// One dimension as the kernel sees it (PadParams).
struct Dim {
  int64_t out, in, stride, pad_before;
};

// Fewer dimensions, same pad: drops unpadded dimensions of size 1 and merges
// an unpadded dimension into the one outside it when the input steps over
// it contiguously (its stride is the inner one's times its size). A typical
// F.pad of the last two dimensions of a contiguous [N, C, H, W] becomes
// [N * C, H, W]. `dims` is in the output's memory order, outermost first.
std::vector<Dim> merge_dims(const std::vector<Dim>& dims) {
  std::vector<Dim> kept;
  for (const Dim& d : dims)
    if (!(d.out == 1 && d.in == 1 && d.pad_before == 0)) kept.push_back(d);
  if (kept.empty()) return {Dim{1, 1, 1, 0}};
  std::vector<Dim> merged{kept.back()};  // built innermost first
  for (int64_t k = static_cast<int64_t>(kept.size()) - 2; k >= 0; --k) {
    Dim& inner = merged.back();
    const Dim& outer = kept[k];
    if (inner.out == inner.in && inner.pad_before == 0 && outer.stride == inner.stride * inner.in) {
      inner = Dim{outer.out * inner.out, outer.in * inner.in, inner.stride, outer.pad_before * inner.out};
    } else {
      merged.push_back(outer);
    }
  }
  std::reverse(merged.begin(), merged.end());
  return merged;
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

Reason pad_unsupported(const at::Tensor& self, c10::IntArrayRef) {
  if (self.layout() != at::kStrided) return because::not_strided;
  if (self.is_quantized()) return because::quantized;
  int64_t itemsize = self.itemsize();
  if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
    return because::dtype_not_1248_bytes(self.scalar_type());
  if (self.dim() > MPS_EXT_MAX_DIMS) return because::dims_past_8;
  return {};
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

  // Dimensions in the output's memory order, outermost first: the output
  // is contiguous in that order.
  const int64_t ndim = self.dim();
  std::vector<int64_t> order(ndim);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return out.stride(a) > out.stride(b); });
  std::vector<Dim> dims;
  for (int64_t d : order) dims.push_back({g.out_sizes[d], self.size(d), self.stride(d), g.pad_before[d]});
  dims = merge_dims(dims);

  PadParams p{};
  p.rank = static_cast<uint32_t>(dims.size());
  p.fill_bits = fill;
  int64_t max_offset = 0, rows = 1;
  for (size_t k = 0; k < dims.size(); ++k) {
    p.out_sizes[k] = dims[k].out;
    p.in_sizes[k] = dims[k].in;
    p.in_strides[k] = dims[k].stride;
    p.pad_before[k] = dims[k].pad_before;
    max_offset += std::max<int64_t>(dims[k].in - 1, 0) * dims[k].stride;
    if (k + 1 < dims.size()) rows *= dims[k].out;
  }
  // A simdgroup per segment of a row, starting at a cache line (128 bytes);
  // a row with `head` bytes before its first line spans at most this many.
  const int64_t itemsize = self.itemsize();
  TORCH_INTERNAL_ASSERT(base_aligned16(out));  // ours: the kernel's vector stores need it
  const int64_t segments = (dims.back().out * itemsize + 127 + PAD_SEGMENT_BYTES - 1) / PAD_SEGMENT_BYTES;
  const int64_t tasks = rows * segments;
  TORCH_CHECK(tasks <= INT32_MAX && rows <= INT32_MAX, "mps_ext constant_pad_nd: output too large (", numel,
              " elements)");
  p.segments_per_row = static_cast<uint32_t>(segments);
  p.tasks = static_cast<uint32_t>(tasks);
  // Index width: 32-bit arithmetic is faster on the GPU (64-bit integer math
  // is emulated); any offset past 2^31 needs the 64-bit variant.
  const bool wide = !fits_32bit(numel + PAD_SEGMENT_BYTES) || !fits_32bit(max_offset);
  const int64_t groups = (tasks + PAD_THREADS / 32 - 1) / (PAD_THREADS / 32);
  std::string kernel = std::string("constant_pad_") + size_name(itemsize) + (wide ? "_i64" : "_i32");
  launch(Launch{"pad",
                kernel,
                {KernelArg::of(out), KernelArg::of(self), KernelArg::value(p)},
                {static_cast<uint32_t>(groups), 1, 1},
                {PAD_THREADS, 1, 1}});
  return out;
}

// -------------------------------------------------------- registration --
namespace {

const RoutedOp kConstantPad(FamilyId::pad, "aten::constant_pad_nd");

template <c10::DispatchKey K>
at::Tensor constant_pad_impl(const at::Tensor& self, c10::SymIntArrayRef pad, const c10::Scalar& value) {
  c10::IntArrayRef p = C10_AS_INTARRAYREF_SLOW(pad);
  return route<decltype(constant_pad_impl<K>)>(
      kConstantPad, K, pad_unsupported(self, p), [&] { return constant_pad(self, p, value); }, self, pad, value);
}

template <c10::DispatchKey K>
void register_pad(FamilyOps& ops) {
  ops.aten("constant_pad_nd", TORCH_FN(constant_pad_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(pad, mps_ext::register_pad)
