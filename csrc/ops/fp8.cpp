// FP8 tensors on MPS: the aten ops that refuse float8 on MPS in torch
// 2.9-2.14 (and float8_e5m2 in 2.15), handled for float8 tensors. Every
// other dtype passes through to the captured stock kernel, uncounted (the
// dispatcher overrides an op for all dtypes; these calls are torch's, not a
// fallback of ours: PassThrough in dispatch/registry.h, an unboxed call).
//
// What refuses, read from each release (README "FP8 tensors on MPS"):
// copy_ between dtypes and strided copies go through MPSGraph casts or
// Metal copy kernels with no float8 instantiation (getMPSDataType: "does
// not have support for that dtype"), and so do fill_/zero_, cat and
// index_select. empty/empty_strided accept float8 (they refuse only
// float64), views are dtype-blind, and printing converts float8 to half
// first (torch/_tensor_str.py), which is a copy_. So overriding copy_,
// fill_, zero_, cat and index_select covers .to("mps"), .cpu(), .to(dtype),
// clone, contiguous, zeros, cat, index_select and print.
//
// Conversions run in kernels_metal/fp8.metal; moves that need no conversion
// (same dtype) run torch's own kernels on uint8 views of the same bytes (a
// float8 tensor and its uint8 view share storage, and torch handles uint8
// everywhere). On torch 2.15, whose MPS kernels take float8_e4m3fn, the
// policy (mps_ext/_policy.py) sends every call without a float8_e5m2 tensor
// to torch's kernel (in route: a rule with kept dtypes).
// All of this is device-agnostic: the same code runs for CPU tensors as
// torch.ops.mps_ext.<op> through the CPU Metal executor, which is how CI
// tests it. Only the cross-device branch of copy_ cannot run there.
#include "ops/fp8.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>

#include "backend/launch.h"
#include "fp8_params.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

// Dimensions of dst (and src, expanded to it) with size-1 dimensions dropped
// and dimensions merged where both tensors step through them as one.
struct Dims {
  std::vector<int64_t> sizes, dst_strides, src_strides;
};
Dims merged_dims(const at::Tensor& dst, const at::Tensor& src) {
  Dims m;
  for (int64_t d = 0; d < dst.dim(); ++d) {
    if (dst.size(d) == 1) continue;
    if (!m.sizes.empty() && m.dst_strides.back() == dst.stride(d) * dst.size(d) &&
        m.src_strides.back() == src.stride(d) * dst.size(d)) {
      m.sizes.back() *= dst.size(d);
      m.dst_strides.back() = dst.stride(d);
      m.src_strides.back() = src.stride(d);
      continue;
    }
    m.sizes.push_back(dst.size(d));
    m.dst_strides.push_back(dst.stride(d));
    m.src_strides.push_back(src.stride(d));
  }
  return m;
}

at::Tensor bytes(const at::Tensor& t) { return t.view(at::kByte); }

}  // namespace

bool is_fp8(c10::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

uint8_t fp8_code(c10::ScalarType dtype, const c10::Scalar& value) {
  // Two elements: torch fills a single one by another path, without the check.
  at::Tensor two = at::empty({2}, at::TensorOptions().dtype(dtype));
  call_stock<at::Tensor>("aten::fill_.Scalar", c10::DispatchKey::CPU, two, value);
  return bytes(two)[0].item<uint8_t>();
}

bool fp8_convert(const at::Tensor& dst, const at::Tensor& src) {
  const int64_t numel = dst.numel();
  if (numel == 0) return true;
  Dims m = merged_dims(dst, src);
  if (m.sizes.size() > MPS_EXT_MAX_DIMS) return false;
  Fp8ConvertParams p{};
  p.numel = numel;
  p.rank = static_cast<uint32_t>(m.sizes.size());
  for (size_t d = 0; d < m.sizes.size(); ++d) {
    p.sizes[d] = m.sizes[d];
    p.dst_strides[d] = m.dst_strides[d];
    p.src_strides[d] = m.src_strides[d];
  }
  // One merged dimension of stride 1 on both sides (or none: one element)
  // is a flat run; 32-bit indices while it stays below 2^31.
  const bool flat = p.rank == 0 || (p.rank == 1 && p.dst_strides[0] == 1 && p.src_strides[0] == 1);
  // The dense kernel moves FP8_CONVERT_PER_THREAD elements with one vector
  // access, which must be aligned to its size on both sides (a view may
  // start anywhere); a misaligned flat run takes the strided kernel.
  auto vector_aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % (FP8_CONVERT_PER_THREAD * t.element_size()) == 0;
  };
  const bool dense = flat && numel < INT32_MAX - FP8_CONVERT_PER_THREAD && vector_aligned(dst) && vector_aligned(src);
  const int64_t threads = (numel + FP8_CONVERT_PER_THREAD - 1) / FP8_CONVERT_PER_THREAD;
  int64_t groups = (threads + FP8_CONVERT_THREADS - 1) / FP8_CONVERT_THREADS;
  // A transposing copy (src contiguous along the first of two dimensions,
  // dst along the second): by tiles, so that both sides are read and
  // written along their contiguous dimension.
  if (p.rank == 2 && p.src_strides[0] == 1 && p.dst_strides[1] == 1) {
    const int64_t tiles = ceil_div(p.sizes[1], FP8_CONVERT_TILE);
    groups = ceil_div(p.sizes[0], FP8_CONVERT_TILE) * tiles;
    TORCH_CHECK(tiles <= 0xffffffffll, "mps_ext fp8: tensor too large (", numel, " elements)");
    p.tiles = static_cast<uint32_t>(tiles);
  }
  TORCH_CHECK(groups <= 0xffffffffll, "mps_ext fp8: tensor too large (", numel, " elements)");
  const std::string kernel = std::string("fp8_convert_") + (dense ? "dense_" : "strided_") +
                             kernel_type_name(src.scalar_type()) + "_" + kernel_type_name(dst.scalar_type());
  launch(Launch{"fp8",
                kernel,
                {KernelArg::of(dst), KernelArg::of(src), KernelArg::value(p)},
                {static_cast<uint32_t>(groups), 1, 1},
                {FP8_CONVERT_THREADS, 1, 1}});
  return true;
}

namespace {

// The family's ops as route sees them.
const RoutedOp kCopy(FamilyId::fp8, "aten::copy_"), kFillScalar(FamilyId::fp8, "aten::fill_.Scalar"),
    kFillTensor(FamilyId::fp8, "aten::fill_.Tensor"), kZero(FamilyId::fp8, "aten::zero_"),
    kCat(FamilyId::fp8, "aten::cat"), kIndexSelect(FamilyId::fp8, "aten::index_select");

// ---------------------------------------------------------------- copy_ --
Reason copy_unsupported(const at::Tensor& self, const at::Tensor& src) {
  if (self.layout() != at::kStrided || src.layout() != at::kStrided) return because::not_strided;
  if (self.is_neg() || src.is_neg() || self.is_conj() || src.is_conj()) return because::neg_or_conj;
  return {};
}

template <c10::DispatchKey K>
void copy_fp8(at::Tensor& self, const at::Tensor& src_, bool non_blocking) {
  if (self.is_same(src_) || self.numel() == 0) return;
  // torch's error for a destination whose elements share memory (an
  // expanded tensor), which its TensorIterator raises on every device:
  // threads writing one element would race.
  at::assert_no_internal_overlap(self);
  at::Tensor src = src_.expand(self.sizes());  // torch's message if it does not broadcast
  const c10::ScalarType to = self.scalar_type(), from = src.scalar_type();
  if (self.device() != src.device()) {
    // Convert where the data is, then move bytes (or let torch move a dtype
    // it handles): the conversion never crosses devices.
    at::Tensor converted = from == to ? src : src.to(to);
    if (is_fp8(to)) call_stock<at::Tensor>("aten::copy_", K, bytes(self), bytes(converted), non_blocking);
    else call_stock<at::Tensor>("aten::copy_", K, self, converted, non_blocking);
    return;
  }
  at::assert_no_overlap(self, src);  // torch's error for partly overlapping copies
  if (to == from) {                  // a move of bytes, NaN payloads included, as torch does it
    call_stock<at::Tensor>("aten::copy_", K, bytes(self), bytes(src), non_blocking);
    return;
  }
  auto convertible = [](c10::ScalarType t) {  // fp8.metal's kernels
    return is_fp8(t) || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
  };
  if (convertible(to) && convertible(from)) {
    TORCH_CHECK(fp8_convert(self, src), "mps_ext fp8: copy_ of a tensor with more than ", MPS_EXT_MAX_DIMS,
                " dimensions that do not merge");
    return;
  }
  // Another dtype on one side: through float32, as torch's own conversions
  // of float8 go (its Float8 types convert through float).
  if (is_fp8(to)) {
    at::Tensor f = at::empty(src.sizes(), src.options().dtype(at::kFloat));
    call_stock<at::Tensor>("aten::copy_", K, f, src, non_blocking);
    TORCH_CHECK(fp8_convert(self, f), "mps_ext fp8: copy_ with more than ", MPS_EXT_MAX_DIMS, " dimensions");
  } else {
    at::Tensor f = at::empty(src.sizes(), src.options().dtype(at::kFloat));
    TORCH_CHECK(fp8_convert(f, src), "mps_ext fp8: copy_ with more than ", MPS_EXT_MAX_DIMS, " dimensions");
    call_stock<at::Tensor>("aten::copy_", K, self, f, non_blocking);
  }
}

template <c10::DispatchKey K>
at::Tensor& copy_impl(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  if (!is_fp8(self.scalar_type()) && !is_fp8(src.scalar_type())) {
    static const PassThrough<at::_ops::copy_> stock(K);
    stock(self, src, non_blocking);
    return self;
  }
  route<decltype(copy_impl<K>)>(
      kCopy, K, copy_unsupported(self, src),
      [&] {
        copy_fp8<K>(self, src, non_blocking);
        return self;
      },
      self, src, non_blocking);
  return self;
}

// ---------------------------------------------------------- fill_, zero_ --
// For an op on a float8 `self`.
Reason self_unsupported(const at::Tensor& self) {
  if (self.layout() != at::kStrided) return because::not_strided;
  return {};
}

// Fills float8 `self` with the byte torch's CPU fill_ writes for `value`
// (its conversion and its overflow checks, done on a CPU tensor by aten's
// own CPU kernel: the CPU key may carry this override too, in tests),
// through torch's fill_ of the uint8 view.
template <c10::DispatchKey K>
at::Tensor fill_fp8(at::Tensor& self, const c10::Scalar& value) {
  const int64_t byte = fp8_code(self.scalar_type(), value);
  return call_stock<at::Tensor>("aten::fill_.Scalar", K, bytes(self), c10::Scalar(byte));
}

template <c10::DispatchKey K>
at::Tensor& fill_scalar_impl(at::Tensor& self, const c10::Scalar& value) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::fill__Scalar> stock(K);
    stock(self, value);
    return self;
  }
  route<decltype(fill_scalar_impl<K>)>(
      kFillScalar, K, self_unsupported(self), [&] { return fill_fp8<K>(self, value); }, self, value);
  return self;
}

template <c10::DispatchKey K>
at::Tensor& fill_tensor_impl(at::Tensor& self, const at::Tensor& value) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::fill__Tensor> stock(K);
    stock(self, value);
    return self;
  }
  route<decltype(fill_tensor_impl<K>)>(
      kFillTensor, K, self_unsupported(self),
      [&] {
        TORCH_CHECK(value.dim() == 0, "fill_ only supports 0-dimension value tensor but got tensor with ", value.dim(),
                    " dimensions.");
        // The value's own float8 bytes may sit on the GPU: read it through copy_.
        return fill_fp8<K>(self, value.to(at::kCPU).item());
      },
      self, value);
  return self;
}

template <c10::DispatchKey K>
at::Tensor& zero_impl(at::Tensor& self) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::zero_> stock(K);
    stock(self);
    return self;
  }
  route<decltype(zero_impl<K>)>(
      kZero, K, self_unsupported(self), [&] { return call_stock<at::Tensor>("aten::zero_", K, bytes(self)); }, self);
  return self;
}

// ------------------------------------------------------ cat, index_select --
template <c10::DispatchKey K>
at::Tensor cat_impl(const at::ITensorListRef& tensors, int64_t dim) {
  std::vector<at::Tensor> list(tensors.begin(), tensors.end());
  const bool fp8 = std::any_of(list.begin(), list.end(), [](const at::Tensor& t) { return is_fp8(t.scalar_type()); });
  if (!fp8) {
    static const PassThrough<at::_ops::cat> stock(K);
    return stock(tensors, dim);
  }
  return route<decltype(cat_impl<K>)>(
      kCat, K, Reason(),
      [&] {
        c10::ScalarType out = list.front().scalar_type();
        // torch's error for float8 with any other dtype
        for (const auto& t : list) out = c10::promoteTypes(out, t.scalar_type());
        std::vector<at::Tensor> b;
        for (const auto& t : list) b.push_back(bytes(t));
        return call_stock<at::Tensor>("aten::cat", K, b, dim).view(out);
      },
      list, dim);
}

template <c10::DispatchKey K>
at::Tensor index_select_impl(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::index_select> stock(K);
    return stock(self, dim, index);
  }
  return route<decltype(index_select_impl<K>)>(
      kIndexSelect, K, self_unsupported(self),
      [&] { return call_stock<at::Tensor>("aten::index_select", K, bytes(self), dim, index).view(self.scalar_type()); },
      self, dim, index);
}

template <c10::DispatchKey K>
void register_fp8(FamilyOps& ops) {
  ops.aten("copy_", TORCH_FN(copy_impl<K>));
  ops.aten("fill_.Scalar", TORCH_FN(fill_scalar_impl<K>));
  ops.aten("fill_.Tensor", TORCH_FN(fill_tensor_impl<K>));
  ops.aten("zero_", TORCH_FN(zero_impl<K>));
  ops.aten("cat", TORCH_FN(cat_impl<K>));
  ops.aten("index_select", TORCH_FN(index_select_impl<K>));
  register_fp8_tensor_ops<K>(ops);  // fp8_ops.cpp
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(fp8, mps_ext::register_fp8)
