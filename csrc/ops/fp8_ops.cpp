// The fp8 family's ops on float8 tensors beyond moves and conversions
// (fp8.cpp): .item(), comparisons and torch.equal, indexing, index_put_,
// where, masked_fill_, gather, repeat, flip. Torch 2.9-2.14 refuse all of
// them for float8 on MPS; 2.15 has some for float8_e4m3fn (the policy,
// mps_ext/_policy.py, leaves those to it) and none for float8_e5m2.
//
// Moving values needs no arithmetic: gather, indexing, index_put_, where,
// masked_fill_, repeat and flip run torch's own kernels on uint8 views of
// the same bytes (exact, NaN payloads and -0 included). Comparisons need the
// values: each float8 operand is decoded by fp8.metal into float16, which
// holds every float8_e4m3fn and float8_e5m2 value exactly (so NaN != NaN and
// -0 == +0 as in float arithmetic), and torch compares those. A number or a
// 0-dim tensor compared with a float8 tensor is first rounded to float8, as
// torch's CPU comparisons do (they compute in the promoted dtype).
// As in fp8.cpp, other dtypes pass through to torch's kernel, uncounted,
// and the same code runs for CPU tensors as torch.ops.mps_ext.<op> (tests).
#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <torch/library.h>

#include "ops/fp8.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

at::Tensor bytes(const at::Tensor& t) { return t.view(at::kByte); }

Reason not_strided(const at::Tensor& t) { return t.layout() == at::kStrided ? Reason() : because::not_strided; }

std::string cast_first(const std::string& what) {
  return "mps_ext fp8: " + what +
         " is arithmetic on float8 values, which no torch release runs on MPS; cast first, e.g. "
         "x.to(torch.bfloat16)";
}

// t's values as float16 (exact for float8), in t's memory layout where it
// is dense (torch's comparisons give their output the inputs' layout).
at::Tensor decode(const at::Tensor& t) {
  at::Tensor out = at::empty_like(t, t.options().dtype(at::kHalf));
  if (!fp8_convert(out, t)) TORCH_CHECK(fp8_convert(out, t.contiguous()), "mps_ext fp8: cannot decode ", t.sizes());
  return out;
}

// A 0-dim tensor on another device than `device` (a CPU scalar beside MPS
// tensors, which torch's kernels accept) moved there, so that float8 kernels
// of one device see it.
at::Tensor on(const at::Tensor& t, const c10::Device& device) {
  return t.dim() == 0 && t.device() != device ? t.to(device) : t;
}
c10::Device device_of(const at::Tensor& a, const at::Tensor& b) { return a.dim() > 0 ? a.device() : b.device(); }

// The family's ops as route sees them (the comparisons: in their macro).
const RoutedOp kEqual(FamilyId::fp8, "aten::equal");
const RoutedOp kLocalScalarDense(FamilyId::fp8, "aten::_local_scalar_dense");
const RoutedOp kGather(FamilyId::fp8, "aten::gather");
const RoutedOp kIndexTensor(FamilyId::fp8, "aten::index.Tensor");
const RoutedOp kIndexPutImpl(FamilyId::fp8, "aten::_index_put_impl_");
const RoutedOp kWhereSelf(FamilyId::fp8, "aten::where.self");
const RoutedOp kMaskedFillScalar(FamilyId::fp8, "aten::masked_fill_.Scalar");
const RoutedOp kMaskedFillTensor(FamilyId::fp8, "aten::masked_fill_.Tensor");
const RoutedOp kRepeat(FamilyId::fp8, "aten::repeat");
const RoutedOp kFlip(FamilyId::fp8, "aten::flip");

// ------------------------------------------------------------ comparisons --
// `op` is the aten name of the overload ("aten::lt.Tensor").
template <c10::DispatchKey K, class Stock>
at::Tensor compare_tensor(const RoutedOp& op, const Stock& stock, const at::Tensor& self_, const at::Tensor& other_) {
  if (!is_fp8(self_.scalar_type()) && !is_fp8(other_.scalar_type())) return stock(self_, other_);
  const c10::Device device = device_of(self_, other_);
  const at::Tensor self = on(self_, device), other = on(other_, device);
  return route<at::Tensor(const at::Tensor&, const at::Tensor&)>(
      op, K, (not_strided(self) || not_strided(other)),
      [&] {
        // torch's promotion, and its error for float8 beside another dtype.
        const c10::ScalarType common = at::result_type(self, other);
        auto value = [&](const at::Tensor& t) { return is_fp8(common) ? decode(t.to(common)) : t.to(common); };
        return op.call_stock<at::Tensor>(K, value(self), value(other));
      },
      self, other);
}

template <c10::DispatchKey K, class Stock>
at::Tensor compare_scalar(const RoutedOp& op, const Stock& stock, const at::Tensor& self, const c10::Scalar& other) {
  if (!is_fp8(self.scalar_type())) return stock(self, other);
  return route<at::Tensor(const at::Tensor&, const c10::Scalar&)>(
      op, K, not_strided(self),
      [&] {
        const c10::ScalarType common = at::result_type(self, other);
        if (!is_fp8(common)) return op.call_stock<at::Tensor>(K, self.to(common), other);
        // The number rounded to float8 by torch's CPU cast (saturating), as a
        // double holding that float8 value exactly.
        const c10::Scalar rounded = at::scalar_to_tensor(other).to(common).to(at::kDouble).item();
        return op.call_stock<at::Tensor>(K, decode(self), rounded);
      },
      self, other);
}

#define MPS_EXT_FP8_COMPARISON(NAME)                                           \
  template <c10::DispatchKey K>                                                \
  at::Tensor NAME##_tensor(const at::Tensor& self, const at::Tensor& other) {  \
    static const PassThrough<at::_ops::NAME##_Tensor> stock(K);                \
    static const RoutedOp op(FamilyId::fp8, "aten::" #NAME ".Tensor");         \
    return compare_tensor<K>(op, stock, self, other);                          \
  }                                                                            \
  template <c10::DispatchKey K>                                                \
  at::Tensor NAME##_scalar(const at::Tensor& self, const c10::Scalar& other) { \
    static const PassThrough<at::_ops::NAME##_Scalar> stock(K);                \
    static const RoutedOp op(FamilyId::fp8, "aten::" #NAME ".Scalar");         \
    return compare_scalar<K>(op, stock, self, other);                          \
  }
MPS_EXT_FP8_COMPARISON(eq)
MPS_EXT_FP8_COMPARISON(ne)
MPS_EXT_FP8_COMPARISON(lt)
MPS_EXT_FP8_COMPARISON(le)
MPS_EXT_FP8_COMPARISON(gt)
MPS_EXT_FP8_COMPARISON(ge)
#undef MPS_EXT_FP8_COMPARISON

template <c10::DispatchKey K>
bool equal_impl(const at::Tensor& self, const at::Tensor& other) {
  if (!is_fp8(self.scalar_type()) && !is_fp8(other.scalar_type())) {
    static const PassThrough<at::_ops::equal> stock(K);
    return stock(self, other);
  }
  return route<decltype(equal_impl<K>)>(
      kEqual, K, (not_strided(self) || not_strided(other)),
      [&] {
        at::result_type(self, other);  // torch's error for float8 beside another dtype
        if (self.sizes() != other.sizes()) return false;
        // Values, not bytes: NaN != NaN, -0 == +0 (torch.equal of floats).
        return call_stock<bool>("aten::equal", K, decode(self), decode(other));
      },
      self, other);
}

// ------------------------------------------------------------------ .item --
template <c10::DispatchKey K>
c10::Scalar local_scalar_dense_impl(const at::Tensor& self) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::_local_scalar_dense> stock(K);
    return stock(self);
  }
  return route<decltype(local_scalar_dense_impl<K>)>(
      kLocalScalarDense, K, Reason(),
      [&] {
        // The byte, moved by torch's uint8 copy, read by torch's CPU kernel.
        const at::Tensor cpu = bytes(self).to(at::kCPU).view(self.scalar_type());
        return call_stock<c10::Scalar>("aten::_local_scalar_dense", c10::DispatchKey::CPU, cpu);
      },
      self);
}

// ----------------------------------------------------------- byte moves --
template <c10::DispatchKey K>
at::Tensor gather_impl(const at::Tensor& self, int64_t dim, const at::Tensor& index, bool sparse_grad) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::gather> stock(K);
    return stock(self, dim, index, sparse_grad);
  }
  return route<decltype(gather_impl<K>)>(
      kGather, K, not_strided(self),
      [&] {
        return call_stock<at::Tensor>("aten::gather", K, bytes(self), dim, index, sparse_grad).view(self.scalar_type());
      },
      self, dim, index, sparse_grad);
}

using Indices = c10::List<std::optional<at::Tensor>>;

template <c10::DispatchKey K>
at::Tensor index_impl(const at::Tensor& self, const Indices& indices) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::index_Tensor> stock(K);
    return stock(self, indices);
  }
  return route<decltype(index_impl<K>)>(
      kIndexTensor, K, not_strided(self),
      [&] { return call_stock<at::Tensor>("aten::index.Tensor", K, bytes(self), indices).view(self.scalar_type()); },
      self, indices);
}

template <c10::DispatchKey K>
at::Tensor& index_put_impl(at::Tensor& self, const Indices& indices, const at::Tensor& values, bool accumulate,
                           bool unsafe) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::_index_put_impl_> stock(K);
    stock(self, indices, values, accumulate, unsafe);
    return self;
  }
  route<decltype(index_put_impl<K>)>(
      kIndexPutImpl, K, (not_strided(self) || not_strided(values)),
      [&] {
        TORCH_CHECK(values.scalar_type() == self.scalar_type(),
                    "Index put requires the source and destination dtypes match, got ", self.scalar_type(),
                    " for the destination and ", values.scalar_type(), " for the source.");
        TORCH_CHECK(!accumulate, cast_first("index_put_ with accumulate=True"));
        call_stock<at::Tensor>("aten::_index_put_impl_", K, bytes(self), indices, bytes(values), accumulate, unsafe);
        return self;
      },
      self, indices, values, accumulate, unsafe);
  return self;
}

template <c10::DispatchKey K>
at::Tensor where_impl(const at::Tensor& condition, const at::Tensor& self_, const at::Tensor& other_) {
  if (!is_fp8(self_.scalar_type()) && !is_fp8(other_.scalar_type())) {
    static const PassThrough<at::_ops::where_self> stock(K);
    return stock(condition, self_, other_);
  }
  const c10::Device device = self_.dim() > 0 ? self_.device() : device_of(other_, condition);
  const at::Tensor self = on(self_, device), other = on(other_, device);
  return route<decltype(where_impl<K>)>(
      kWhereSelf, K, (not_strided(self) || not_strided(other)),
      [&] {
        const c10::ScalarType common = at::result_type(self, other);
        const at::Tensor a = self.to(common), b = other.to(common);
        if (!is_fp8(common)) return call_stock<at::Tensor>("aten::where.self", K, condition, a, b);
        return call_stock<at::Tensor>("aten::where.self", K, condition, bytes(a), bytes(b)).view(common);
      },
      condition, self, other);
}

template <c10::DispatchKey K>
at::Tensor& masked_fill_scalar_impl(at::Tensor& self, const at::Tensor& mask, const c10::Scalar& value) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::masked_fill__Scalar> stock(K);
    stock(self, mask, value);
    return self;
  }
  route<decltype(masked_fill_scalar_impl<K>)>(
      kMaskedFillScalar, K, not_strided(self),
      [&] {
        // The value rounded as fill_ rounds it (with its overflow error, as
        // masked_fill_ of float16 has).
        const int64_t code = fp8_code(self.scalar_type(), value);
        call_stock<at::Tensor>("aten::masked_fill_.Scalar", K, bytes(self), mask, c10::Scalar(code));
        return self;
      },
      self, mask, value);
  return self;
}

template <c10::DispatchKey K>
at::Tensor& masked_fill_tensor_impl(at::Tensor& self, const at::Tensor& mask, const at::Tensor& value) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::masked_fill__Tensor> stock(K);
    stock(self, mask, value);
    return self;
  }
  route<decltype(masked_fill_tensor_impl<K>)>(
      kMaskedFillTensor, K, not_strided(self),
      [&] {
        TORCH_CHECK(value.dim() == 0, "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with ",
                    value.dim(), " dimension(s).");
        // The value's own float8 bytes may sit on the GPU: read it through copy_.
        const int64_t code = fp8_code(self.scalar_type(), value.to(at::kCPU).item());
        call_stock<at::Tensor>("aten::masked_fill_.Scalar", K, bytes(self), mask, c10::Scalar(code));
        return self;
      },
      self, mask, on(value, self.device()));
  return self;
}

template <c10::DispatchKey K>
at::Tensor repeat_impl(const at::Tensor& self, c10::SymIntArrayRef repeats) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::repeat> stock(K);
    return stock(self, repeats);
  }
  return route<decltype(repeat_impl<K>)>(
      kRepeat, K, not_strided(self),
      [&] {
        return call_stock<at::Tensor>("aten::repeat", K, bytes(self), C10_AS_INTARRAYREF_SLOW(repeats))
            .view(self.scalar_type());
      },
      self, repeats);
}

template <c10::DispatchKey K>
at::Tensor flip_impl(const at::Tensor& self, at::IntArrayRef dims) {
  if (!is_fp8(self.scalar_type())) {
    static const PassThrough<at::_ops::flip> stock(K);
    return stock(self, dims);
  }
  return route<decltype(flip_impl<K>)>(
      kFlip, K, not_strided(self),
      [&] { return call_stock<at::Tensor>("aten::flip", K, bytes(self), dims).view(self.scalar_type()); }, self, dims);
}

}  // namespace

template <c10::DispatchKey K>
void register_fp8_tensor_ops(FamilyOps& ops) {
  ops.aten("_local_scalar_dense", TORCH_FN(local_scalar_dense_impl<K>));
  ops.aten("equal", TORCH_FN(equal_impl<K>));
  ops.aten("eq.Tensor", TORCH_FN(eq_tensor<K>));
  ops.aten("eq.Scalar", TORCH_FN(eq_scalar<K>));
  ops.aten("ne.Tensor", TORCH_FN(ne_tensor<K>));
  ops.aten("ne.Scalar", TORCH_FN(ne_scalar<K>));
  ops.aten("lt.Tensor", TORCH_FN(lt_tensor<K>));
  ops.aten("lt.Scalar", TORCH_FN(lt_scalar<K>));
  ops.aten("le.Tensor", TORCH_FN(le_tensor<K>));
  ops.aten("le.Scalar", TORCH_FN(le_scalar<K>));
  ops.aten("gt.Tensor", TORCH_FN(gt_tensor<K>));
  ops.aten("gt.Scalar", TORCH_FN(gt_scalar<K>));
  ops.aten("ge.Tensor", TORCH_FN(ge_tensor<K>));
  ops.aten("ge.Scalar", TORCH_FN(ge_scalar<K>));
  ops.aten("index.Tensor", TORCH_FN(index_impl<K>));
  ops.aten("_index_put_impl_", TORCH_FN(index_put_impl<K>));
  ops.aten("where.self", TORCH_FN(where_impl<K>));
  ops.aten("masked_fill_.Scalar", TORCH_FN(masked_fill_scalar_impl<K>));
  ops.aten("masked_fill_.Tensor", TORCH_FN(masked_fill_tensor_impl<K>));
  ops.aten("gather", TORCH_FN(gather_impl<K>));
  ops.aten("repeat", TORCH_FN(repeat_impl<K>));
  ops.aten("flip", TORCH_FN(flip_impl<K>));
}

template void register_fp8_tensor_ops<c10::DispatchKey::CPU>(FamilyOps&);
template void register_fp8_tensor_ops<c10::DispatchKey::MPS>(FamilyOps&);

}  // namespace mps_ext
