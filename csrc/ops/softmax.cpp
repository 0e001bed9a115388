// _softmax, _log_softmax, _softmax_backward_data, _log_softmax_backward_data.
// Kernels: kernels_metal/softmax.metal.
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include "backend/launch.h"
#include "ops/ops.h"
#include "ops/registration.h"
#include "ops/registry.h"
#include "softmax_params.h"

namespace mps_ext {
namespace {

// Must match SEGMENT_ELEMENTS and BLOCK_ELEMENTS in softmax.metal.
constexpr int64_t kSegmentElements = 4;
constexpr int64_t kBlockElements = 16;
// Block threadgroups stay at 512 threads: a pipeline's
// maxTotalThreadsPerThreadgroup can be below 1024 on a real GPU.
constexpr int64_t kBlockThreads = 512;
constexpr int64_t kSegmentMax = 32 * kSegmentElements;   // one simdgroup
constexpr int64_t kBlockMax = kBlockThreads * kBlockElements;
constexpr uint32_t kSegmentThreads = 256;
constexpr uint32_t kSplitThreads = 256;
constexpr int64_t kSplitChunk = 2048;

const char* type_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    default: TORCH_CHECK(false, "mps_ext softmax: no kernel for ", t);
  }
}

bool is_kernel_float(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

uint32_t next_pow2(int64_t v) {
  uint32_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

// The variant policy, by row length D:
//   D <= 128    segment: lanes_per_row = next_pow2(D / 4) lanes of a
//               simdgroup per row, 256 threads per threadgroup, so short rows
//               pack 256 / lanes_per_row rows per threadgroup.
//   D <= 8192   block: one threadgroup per row, D / 16 threads rounded up to
//               a whole simdgroup (32 to 512).
//   longer      split: chunks of 2048 elements, one threadgroup each, in two
//               dispatches. A 128K-vocabulary row becomes 63 threadgroups.
// Segment and block read each element once; split reads it twice.
enum class Shape { kSegment, kBlock, kSplit };
struct Plan {
  Shape shape;
  uint32_t threads;
  uint32_t lanes = 0;
  int64_t chunks = 0;
};

Plan plan(int64_t D) {
  if (D <= kSegmentMax) {
    uint32_t lanes = std::min<uint32_t>(32, next_pow2((D + kSegmentElements - 1) / kSegmentElements));
    return {Shape::kSegment, kSegmentThreads, lanes};
  }
  if (D <= kBlockMax) {
    int64_t threads = (D + kBlockElements - 1) / kBlockElements;
    threads = std::min<int64_t>(kBlockThreads, (threads + 31) / 32 * 32);
    return {Shape::kBlock, static_cast<uint32_t>(threads)};
  }
  return {Shape::kSplit, kSplitThreads, 0, (D + kSplitChunk - 1) / kSplitChunk};
}

// Rows: every dimension but `dim`, outermost first, with each tensor's strides.
SoftmaxParams row_params(const at::Tensor& x, const at::Tensor* y, const at::Tensor& out, int64_t dim) {
  SoftmaxParams p{};
  p.rows = 1;
  p.row_length = x.dim() == 0 ? 1 : x.size(dim);
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d == dim) continue;
    p.row_sizes[p.rank] = x.size(d);
    p.x_strides[p.rank] = x.stride(d);
    p.y_strides[p.rank] = y ? y->stride(d) : 0;
    p.out_strides[p.rank] = out.stride(d);
    p.rows *= x.size(d);
    ++p.rank;
  }
  if (x.dim() > 0) {
    p.x_dim_stride = x.stride(dim);
    p.y_dim_stride = y ? y->stride(dim) : 0;
    p.out_dim_stride = out.stride(dim);
  }
  return p;
}

uint32_t grid_dim(int64_t v, const char* what) {
  TORCH_CHECK(v <= 0xffffffffll, "mps_ext softmax: too many ", what, " (", v, ")");
  return static_cast<uint32_t>(v);
}

// One forward or backward pass. `y` is the forward output for backward.
void run(const at::Tensor& x, const at::Tensor* y, const at::Tensor& out, int64_t dim, bool log) {
  SoftmaxParams p = row_params(x, y, out, dim);
  p.log = log ? 1 : 0;
  const Plan pl = plan(p.row_length);
  const bool backward = y != nullptr;
  const std::string prefix = backward ? "softmax_backward_" : "softmax_";
  const std::string types = std::string(type_name(x.scalar_type())) + "_" + type_name(out.scalar_type());

  auto args = [&](std::initializer_list<KernelArg> extra) {
    std::vector<KernelArg> a = {KernelArg::of(out), KernelArg::of(x), KernelArg::value(p)};
    if (backward) a.push_back(KernelArg::of(*y));
    a.insert(a.end(), extra);
    return a;
  };

  if (pl.shape == Shape::kSegment) {
    p.lanes_per_row = pl.lanes;
    int64_t rows_per_group = pl.threads / pl.lanes;
    Launch l{"softmax", prefix + "segment_" + types, args({}),
             {grid_dim((p.rows + rows_per_group - 1) / rows_per_group, "rows"), 1, 1}, {pl.threads, 1, 1}};
    return launch(l);
  }
  if (pl.shape == Shape::kBlock) {
    Launch l{"softmax", prefix + "block_" + types, args({}), {grid_dim(p.rows, "rows"), 1, 1}, {pl.threads, 1, 1}};
    return launch(l);
  }
  p.chunk_length = kSplitChunk;
  p.chunks = pl.chunks;
  // (max, sum) per chunk forward, sum per chunk backward: float2 or float.
  at::Tensor partials = at::empty({p.rows * p.chunks * (backward ? 1 : 2)}, x.options().dtype(at::kFloat));
  std::array<uint32_t, 3> grid{grid_dim(p.chunks, "chunks"), grid_dim(p.rows, "rows"), 1};
  std::vector<KernelArg> first = {KernelArg::of(partials), KernelArg::of(x), KernelArg::value(p)};
  if (backward) first.push_back(KernelArg::of(*y));
  launch(Launch{"softmax", prefix + "partial_" + type_name(x.scalar_type()), first, grid, {pl.threads, 1, 1}});
  launch(Launch{"softmax", prefix + "finish_" + types, args({KernelArg::of(partials)}), grid, {pl.threads, 1, 1}});
}

std::string dims_unsupported(const at::Tensor& t) {
  if (t.layout() != at::kStrided) return "layout is not strided";
  if (t.dim() > MPS_EXT_MAX_DIMS + 1) return "more than 9 dimensions";
  return "";
}

}  // namespace

std::string softmax_unsupported(const at::Tensor& self) {
  if (!is_kernel_float(self.scalar_type()))
    return std::string("dtype ") + c10::toString(self.scalar_type()) + " (float32, float16 and bfloat16 are handled)";
  return dims_unsupported(self);
}

at::Tensor softmax_forward(const at::Tensor& self, int64_t dim, bool half_to_float, bool log) {
  dim = at::maybe_wrap_dim(dim, self.dim());
  TORCH_CHECK(!half_to_float || self.scalar_type() == at::kHalf, "conversion is supported for Half type only");
  auto out = at::empty(self.sizes(), self.options().dtype(half_to_float ? at::kFloat : self.scalar_type()));
  if (self.numel() > 0) run(self, nullptr, out, dim, log);
  return out;
}

std::string softmax_backward_unsupported(const at::Tensor& grad, const at::Tensor& output,
                                         c10::ScalarType input_dtype) {
  std::string why = softmax_unsupported(grad);
  if (!why.empty()) return why;
  why = dims_unsupported(output);
  if (!why.empty()) return why;
  bool same = input_dtype == grad.scalar_type();
  bool from_half_to_float = grad.scalar_type() == at::kFloat && input_dtype == at::kHalf;
  if (!same && !from_half_to_float)
    return std::string("gradient ") + c10::toString(grad.scalar_type()) + " to input dtype " +
           c10::toString(input_dtype);
  return "";
}

at::Tensor softmax_backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                            c10::ScalarType input_dtype, bool log) {
  TORCH_CHECK(grad.device() == output.device(), "Expected all tensors to be on the same device, but found at least "
              "two devices, ", grad.device(), " and ", output.device(), "!");
  TORCH_CHECK(grad.sizes() == output.sizes(), "grad_output and output must have the same shape, got ", grad.sizes(),
              " and ", output.sizes());
  TORCH_CHECK(grad.scalar_type() == output.scalar_type(), "expected grad_output and output to have the same dtype, "
              "but got ", grad.scalar_type(), " and ", output.scalar_type());
  dim = at::maybe_wrap_dim(dim, grad.dim());
  auto out = at::empty(grad.sizes(), grad.options().dtype(input_dtype));
  if (grad.numel() > 0) run(grad, &output, out, dim, log);
  return out;
}


// -------------------------------------------------------- registration --
namespace {

using c10::DispatchKey;

template <DispatchKey K>
at::Tensor softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route(family("softmax"), "aten::_softmax", K, softmax_unsupported(self),
               [&] { return softmax_forward(self, dim, half_to_float, false); }, self, dim, half_to_float);
}

template <DispatchKey K>
at::Tensor log_softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route(family("softmax"), "aten::_log_softmax", K, softmax_unsupported(self),
               [&] { return softmax_forward(self, dim, half_to_float, true); }, self, dim, half_to_float);
}

template <DispatchKey K>
at::Tensor softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                 c10::ScalarType input_dtype) {
  return route(family("softmax"), "aten::_softmax_backward_data", K,
               softmax_backward_unsupported(grad, output, input_dtype),
               [&] { return softmax_backward(grad, output, dim, input_dtype, false); }, grad, output, dim,
               input_dtype);
}

template <DispatchKey K>
at::Tensor log_softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                     c10::ScalarType input_dtype) {
  return route(family("softmax"), "aten::_log_softmax_backward_data", K,
               softmax_backward_unsupported(grad, output, input_dtype),
               [&] { return softmax_backward(grad, output, dim, input_dtype, true); }, grad, output, dim,
               input_dtype);
}

template <DispatchKey K>
void register_softmax(torch::Library& m) {
  m.impl("_softmax", TORCH_FN(softmax_impl<K>));
  m.impl("_log_softmax", TORCH_FN(log_softmax_impl<K>));
  m.impl("_softmax_backward_data", TORCH_FN(softmax_backward_impl<K>));
  m.impl("_log_softmax_backward_data", TORCH_FN(log_softmax_backward_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY("softmax", mps_ext::register_softmax, "aten::_softmax", "aten::_log_softmax",
               "aten::_softmax_backward_data", "aten::_log_softmax_backward_data")
