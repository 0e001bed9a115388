// _softmax, _log_softmax, _softmax_backward_data, _log_softmax_backward_data.
// Kernels: kernels_metal/softmax.metal.
#include <ATen/ATen.h>
#include <ATen/WrapDimUtils.h>

#include <algorithm>
#include <array>

#include "backend/launch.h"
#include "ops/ops.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "dispatch/kernel_choice.h"
#include "softmax_params.h"

namespace mps_ext {
namespace {

constexpr int64_t kSegmentThreads = SOFTMAX_SEGMENT_THREADS;
constexpr int64_t kBlockThreads = SOFTMAX_BLOCK_MAX_THREADS;
constexpr int64_t kStridedThreads = SOFTMAX_STRIDED_MAX_THREADS;
constexpr int64_t kSplitThreads = SOFTMAX_SPLIT_THREADS;
constexpr int64_t kSplitChunk = SOFTMAX_SPLIT_CHUNK;
static_assert(kSplitChunk % (kSplitThreads * 8) == 0, "a split thread holds whole 16-byte pieces");

const char* type_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    default: TORCH_CHECK(false, "mps_ext softmax: no kernel for ", t);
  }
}

bool is_kernel_float(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

uint32_t log2_of(int64_t pow2) {
  uint32_t s = 0;
  while ((int64_t{1} << s) < pow2) ++s;
  return s;
}

// The tensors of one pass: x (input or grad_output), y (forward output, for
// backward) and out.
struct Tensors {
  const at::Tensor& x;
  const at::Tensor* y;
  const at::Tensor& out;
  template <class F>
  bool all(F f) const {
    return f(x) && (!y || f(*y)) && f(out);
  }
};

// Rows: every dimension but `dim`, outermost first, with each tensor's
// strides; then fewer of them: size-1 dimensions dropped, and a dimension
// merged into the one outside it when every tensor steps over the pair
// contiguously. Each remaining one costs the kernels a division per row.
SoftmaxParams row_params(const Tensors& t, int64_t dim) {
  SoftmaxParams p{};
  p.rows = 1;
  p.row_length = t.x.dim() == 0 ? 1 : t.x.size(dim);
  for (int64_t d = 0; d < t.x.dim(); ++d) {
    if (d == dim || t.x.size(d) == 1) continue;
    const int64_t size = t.x.size(d), xs = t.x.stride(d), ys = t.y ? t.y->stride(d) : 0, os = t.out.stride(d);
    const uint32_t r = p.rank;
    if (r > 0 && p.x_strides[r - 1] == xs * size && p.y_strides[r - 1] == ys * size &&
        p.out_strides[r - 1] == os * size) {
      p.row_sizes[r - 1] *= size;
      p.x_strides[r - 1] = xs;
      p.y_strides[r - 1] = ys;
      p.out_strides[r - 1] = os;
    } else {
      p.row_sizes[r] = size;
      p.x_strides[r] = xs;
      p.y_strides[r] = ys;
      p.out_strides[r] = os;
      ++p.rank;
    }
    p.rows *= size;
  }
  if (t.x.dim() > 0) {
    p.x_dim_stride = t.x.stride(dim);
    p.y_dim_stride = t.y ? t.y->stride(dim) : 0;
    p.out_dim_stride = t.out.stride(dim);
  }
  return p;
}

// Largest offset of a tensor's elements, in elements.
int64_t max_offset(const at::Tensor& t) {
  int64_t m = 0;
  for (int64_t d = 0; d < t.dim(); ++d) m += (t.size(d) - 1) * t.stride(d);
  return m;
}

// 16-byte accesses along the rows: every tensor contiguous along the softmax
// dimension and every row start (and, in split rows, chunk start) 16-byte
// aligned.
bool rows_aligned16(const Tensors& t, const SoftmaxParams& p) {
  if (p.x_dim_stride != 1 || p.out_dim_stride != 1 || (t.y && p.y_dim_stride != 1)) return false;
  auto rows_aligned = [&](const at::Tensor& x, const int64_t* strides) {
    if (!base_aligned16(x)) return false;
    for (uint32_t d = 0; d < p.rank; ++d)
      if ((strides[d] * x.itemsize()) % 16 != 0) return false;
    return true;
  };
  return rows_aligned(t.x, p.x_strides) && rows_aligned(t.out, p.out_strides) &&
         (!t.y || rows_aligned(*t.y, p.y_strides));
}

// The variant policy, by row length D and layout:
//   strided  the softmax dimension is not contiguous but the last row
//            dimension is, in every tensor (softmax over dim 1 of
//            [32, 1024, 16]): 2^lanes_shift consecutive inner rows per
//            threadgroup (as many as the inner dimension has, up to 32;
//            halved, down to 4, while the rows are too long), each thread
//            holding up to SOFTMAX_STRIDED_ELEMENTS of its row (16
//            backward), so D <= 32 * 512 / rows per threadgroup.
//   segment  D <= 128 (256 with 16-byte accesses when input and output are
//            both 16-bit):
//            lanes_per_row = next_pow2(D / elements per lane) lanes of a
//            simdgroup per row (element accesses: next_pow2(D), up to 32),
//            256 threads per threadgroup, so short rows pack
//            256 / lanes_per_row rows per threadgroup.
//   block    D <= 8192: one threadgroup per row, D / 16 threads rounded up
//            to a whole simdgroup (32 to 512).
//   split    longer: chunks of 2048 elements, one threadgroup each, in two
//            dispatches. A 128K-vocabulary row becomes 63 threadgroups.
// The block and strided shapes take at most the threads their pipeline
// allows (`budget`, thread_budget): rows too long for them there take the
// next shape (block, split). Segment and split threadgroups are fixed, 256
// threads: their least.
// Segment, block and strided read each element once; split reads it twice.
// 16-byte accesses (_vec) where rows_aligned16; 64-bit indices (_i64) where
// an offset can pass 2^31 (never with 16-byte accesses: such tensors are
// rare, and their kernels stay simple).
enum class Shape { kSegment, kBlock, kStrided, kSplit };
struct Plan {
  Shape shape;
  uint32_t threads = 0;
  uint32_t lanes_shift = 0;
  int64_t chunks = 0;
  std::array<uint32_t, 3> grid{1, 1, 1};
};

uint32_t grid_dim(int64_t v, const char* what) {
  TORCH_CHECK(v <= 0xffffffffll, "mps_ext softmax: too many ", what, " (", v, ")");
  return static_cast<uint32_t>(v);
}

// The strided plan, or threads == 0 if the layout or length do not fit it.
// budget(shape): the threads that shape's kernel may have here.
template <class Budget>
Plan strided_plan(const Tensors& t, const SoftmaxParams& p, bool backward, const Budget& budget) {
  Plan pl{Shape::kStrided};
  if (p.rank == 0 || p.x_dim_stride == 1) return pl;
  const uint32_t last = p.rank - 1;
  if (p.x_strides[last] != 1 || p.out_strides[last] != 1 || (t.y && p.y_strides[last] != 1)) return pl;
  const int64_t inner = p.row_sizes[last], D = p.row_length;
  const int64_t elements = backward ? SOFTMAX_STRIDED_BACKWARD_ELEMENTS : SOFTMAX_STRIDED_ELEMENTS;
  // A power of two: rows and their threads are.
  int64_t most = 32;
  for (const int64_t limit = budget(Shape::kStrided); 2 * most <= limit;) most *= 2;
  int64_t rows_here = std::min<int64_t>(32, next_pow2(inner));
  while (rows_here > 4 && D > elements * (most / rows_here)) rows_here /= 2;
  if (D > elements * (most / rows_here)) return pl;
  const int64_t threads_per_row = next_pow2((D + elements - 1) / elements);
  pl.threads = static_cast<uint32_t>(std::max<int64_t>(32, rows_here * threads_per_row));
  pl.lanes_shift = log2_of(rows_here);
  pl.grid = {grid_dim((inner + rows_here - 1) / rows_here, "rows"), grid_dim(p.rows / inner, "rows"), 1};
  return pl;
}

// wider_itemsize: of the input and output types, the wider (the vector
// variants' pieces are 16 bytes of it).
template <class Budget>
Plan plan(const Tensors& t, const SoftmaxParams& p, bool vec, int64_t wider_itemsize, bool backward,
          const Budget& budget) {
  Plan strided = strided_plan(t, p, backward, budget);
  if (strided.threads) return strided;
  const int64_t D = p.row_length;
  const int64_t piece = vec ? 16 / wider_itemsize : 1;
  const int64_t per_lane = std::max<int64_t>(piece, SOFTMAX_SEGMENT_ELEMENTS);
  if (D <= 32 * per_lane) {
    // Element accesses (rows not 16-byte aligned): a lane per element, up
    // to 32, so that each load instruction covers whole rows, or 32
    // consecutive elements of one; a row that starts mid-line then crosses
    // at most one line boundary per instruction.
    const int64_t lanes = std::min<int64_t>(32, next_pow2(vec ? (D + per_lane - 1) / per_lane : D));
    Plan pl{Shape::kSegment, static_cast<uint32_t>(kSegmentThreads), log2_of(lanes)};
    pl.grid[0] = grid_dim((p.rows * lanes + kSegmentThreads - 1) / kSegmentThreads, "rows");
    return pl;
  }
  const int64_t block_threads = D <= kBlockThreads * SOFTMAX_BLOCK_ELEMENTS ? budget(Shape::kBlock) : 0;
  if (D <= block_threads * SOFTMAX_BLOCK_ELEMENTS) {
    const int64_t pieces = (D + piece - 1) / piece,
                  per_thread = SOFTMAX_BLOCK_ELEMENTS / std::min(piece, int64_t{SOFTMAX_BLOCK_ELEMENTS});
    const int64_t threads = std::min<int64_t>(block_threads, ((pieces + per_thread - 1) / per_thread + 31) / 32 * 32);
    Plan pl{Shape::kBlock, static_cast<uint32_t>(threads)};
    pl.grid[0] = grid_dim(p.rows, "rows");
    return pl;
  }
  Plan pl{Shape::kSplit, static_cast<uint32_t>(kSplitThreads)};
  pl.chunks = (D + kSplitChunk - 1) / kSplitChunk;
  pl.grid = {grid_dim(pl.chunks, "chunks"), grid_dim(p.rows, "rows"), 1};
  return pl;
}

// One forward or backward pass. `y` is the forward output for backward.
void run(const at::Tensor& x, const at::Tensor* y, const at::Tensor& out, int64_t dim, bool log) {
  const Tensors t{x, y, out};
  SoftmaxParams p = row_params(t, dim);
  p.log = log ? 1 : 0;
  const bool backward = y != nullptr;
  int64_t largest = std::max({p.rows, p.row_length, max_offset(x), max_offset(out), y ? max_offset(*y) : 0});
  const bool wide = !fits_32bit(largest + kSplitChunk + kBlockThreads * SOFTMAX_BLOCK_ELEMENTS);
  const bool vec = !wide && rows_aligned16(t, p);
  const std::string prefix = backward ? "softmax_backward_" : "softmax_";
  const std::string types = std::string(type_name(x.scalar_type())) + "_" + type_name(out.scalar_type());
  // The strided shape has no vector variant.
  auto variant = [&](Shape s) { return wide ? "_i64" : vec && s != Shape::kStrided ? "_i32_vec" : "_i32"; };
  auto kernel = [&](Shape s) {
    const char* shape = s == Shape::kSegment   ? "segment_"
                        : s == Shape::kBlock   ? "block_"
                        : s == Shape::kStrided ? "strided_"
                                               : "finish_";
    return prefix + shape + types + variant(s);
  };
  auto budget = [&](Shape s) {
    return thread_budget(x.device(), "softmax", kernel(s), s == Shape::kBlock ? kBlockThreads : kStridedThreads);
  };
  const Plan pl = plan(t, p, vec, std::max(x.itemsize(), out.itemsize()), backward, budget);
  p.lanes_shift = pl.lanes_shift;

  auto args = [&](std::initializer_list<KernelArg> extra) {
    std::vector<KernelArg> a = {KernelArg::of(out), KernelArg::of(x), KernelArg::value(p)};
    if (backward) a.push_back(KernelArg::of(*y));
    a.insert(a.end(), extra);
    return a;
  };
  const std::array<uint32_t, 3> threads{pl.threads, 1, 1};
  if (pl.shape != Shape::kSplit) return launch(Launch{"softmax", kernel(pl.shape), args({}), pl.grid, threads});
  // The second dispatch's kernel can run (its fixed threads: its least),
  // else the first is not encoded either.
  thread_budget(x.device(), "softmax", kernel(Shape::kSplit), kSplitThreads, kSplitThreads);

  p.chunks = pl.chunks;
  p.partials_stride = (pl.chunks + 31) / 32 * 32;
  TORCH_CHECK(wide || fits_32bit(p.rows * p.partials_stride), "mps_ext softmax: internal: partials past 2^31");
  // (max, sum) per chunk forward, sum per chunk backward: float2 or float.
  at::Tensor partials = at::empty({p.rows * p.partials_stride * (backward ? 1 : 2)}, x.options().dtype(at::kFloat));
  std::vector<KernelArg> first = {KernelArg::of(partials), KernelArg::of(x), KernelArg::value(p)};
  if (backward) first.push_back(KernelArg::of(*y));
  launch(Launch{"softmax", prefix + "partial_" + type_name(x.scalar_type()) + variant(Shape::kSplit), first, pl.grid,
                threads});
  launch(Launch{"softmax", kernel(Shape::kSplit), args({KernelArg::of(partials)}), pl.grid, threads});
}

Reason dims_unsupported(const at::Tensor& t) {
  if (t.layout() != at::kStrided) return because::not_strided;
  if (t.dim() > MPS_EXT_MAX_DIMS + 1) return because::dims_past_9;
  return {};
}

}  // namespace

Reason softmax_unsupported(const at::Tensor& self) {
  if (!is_kernel_float(self.scalar_type())) return because::dtype_not_float(self.scalar_type());
  return dims_unsupported(self);
}

at::Tensor softmax_forward(const at::Tensor& self, int64_t dim, bool half_to_float, bool log) {
  dim = at::maybe_wrap_dim(dim, self.dim());
  TORCH_CHECK(!half_to_float || self.scalar_type() == at::kHalf, "conversion is supported for Half type only");
  auto out = at::empty(self.sizes(), self.options().dtype(half_to_float ? at::kFloat : self.scalar_type()));
  if (self.numel() > 0) run(self, nullptr, out, dim, log);
  return out;
}

Reason softmax_backward_unsupported(const at::Tensor& grad, const at::Tensor& output, c10::ScalarType input_dtype) {
  Reason why = softmax_unsupported(grad);
  if (why) return why;
  why = dims_unsupported(output);
  if (why) return why;
  bool same = input_dtype == grad.scalar_type();
  bool from_half_to_float = grad.scalar_type() == at::kFloat && input_dtype == at::kHalf;
  if (!same && !from_half_to_float) return because::gradient_dtype(grad.scalar_type(), input_dtype);
  return {};
}

at::Tensor softmax_backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim, c10::ScalarType input_dtype,
                            bool log) {
  TORCH_CHECK(grad.device() == output.device(),
              "Expected all tensors to be on the same device, but found at least "
              "two devices, ",
              grad.device(), " and ", output.device(), "!");
  TORCH_CHECK(grad.sizes() == output.sizes(), "grad_output and output must have the same shape, got ", grad.sizes(),
              " and ", output.sizes());
  TORCH_CHECK(grad.scalar_type() == output.scalar_type(),
              "expected grad_output and output to have the same dtype, "
              "but got ",
              grad.scalar_type(), " and ", output.scalar_type());
  dim = at::maybe_wrap_dim(dim, grad.dim());
  auto out = at::empty(grad.sizes(), grad.options().dtype(input_dtype));
  if (grad.numel() > 0) run(grad, &output, out, dim, log);
  return out;
}

// -------------------------------------------------------- registration --
namespace {

using c10::DispatchKey;

const RoutedOp kSoftmax(FamilyId::softmax, "aten::_softmax"), kLogSoftmax(FamilyId::softmax, "aten::_log_softmax"),
    kSoftmaxBackward(FamilyId::softmax, "aten::_softmax_backward_data"),
    kLogSoftmaxBackward(FamilyId::softmax, "aten::_log_softmax_backward_data");

template <DispatchKey K>
at::Tensor softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route<decltype(softmax_impl<K>)>(
      kSoftmax, K, softmax_unsupported(self), [&] { return softmax_forward(self, dim, half_to_float, false); }, self,
      dim, half_to_float);
}

template <DispatchKey K>
at::Tensor log_softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route<decltype(log_softmax_impl<K>)>(
      kLogSoftmax, K, softmax_unsupported(self), [&] { return softmax_forward(self, dim, half_to_float, true); }, self,
      dim, half_to_float);
}

template <DispatchKey K>
at::Tensor softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                 c10::ScalarType input_dtype) {
  return route<decltype(softmax_backward_impl<K>)>(
      kSoftmaxBackward, K, softmax_backward_unsupported(grad, output, input_dtype),
      [&] { return softmax_backward(grad, output, dim, input_dtype, false); }, grad, output, dim, input_dtype);
}

template <DispatchKey K>
at::Tensor log_softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                     c10::ScalarType input_dtype) {
  return route<decltype(log_softmax_backward_impl<K>)>(
      kLogSoftmaxBackward, K, softmax_backward_unsupported(grad, output, input_dtype),
      [&] { return softmax_backward(grad, output, dim, input_dtype, true); }, grad, output, dim, input_dtype);
}

template <DispatchKey K>
void register_softmax(FamilyOps& ops) {
  ops.aten("_softmax", TORCH_FN(softmax_impl<K>));
  ops.aten("_log_softmax", TORCH_FN(log_softmax_impl<K>));
  ops.aten("_softmax_backward_data", TORCH_FN(softmax_backward_impl<K>));
  ops.aten("_log_softmax_backward_data", TORCH_FN(log_softmax_backward_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(softmax, mps_ext::register_softmax)
