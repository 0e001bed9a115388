// Grouped matrix products for mixture-of-experts layers: aten::_grouped_mm
// (F.grouped_mm) and aten::_scaled_grouped_mm (fp8 experts, row-wise
// scales). Kernels: kernels_metal/grouped_mm.metal.
//
// The offsets never reach the host: nothing here reads `offs` (no .item(),
// .cpu(), .tolist(), no data pointer of it). Launch geometry comes from
// shapes alone: the decode kernel has one slot per row of the jagged
// operand, the tiled kernel one tile per 64 rows, and each threadgroup finds
// its group in `offs` on the GPU; threadgroups with no work exit at once.
// (torch 2.9-2.14 run _grouped_mm on MPS through a composite kernel that
// copies offs to the CPU and launches one mm per group; 2.15 has a Metal
// kernel of its own. Neither has an MPS _scaled_grouped_mm: mps_ext
// registers one.)
#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <limits>

#include "backend/launch.h"
#include "grouped_mm_params.h"
#include "dispatch/kernel_choice.h"
#include "ops/moe.h"
#include "ops/ops.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

// Rows of the jagged operand up to which the decode kernels run: 8 tokens
// routed to their top-8 experts. A group has at most 8 rows there (a token
// picks an expert once), so each chosen expert's weights stream once.
constexpr int64_t kDecodeMaxRows = 64;
// The fused MoE ops (a decode step's token slots, as moe_route makes them)
// always run the decode kernel; a group of more than 8 rows streams its
// weights once per 8 rows.
constexpr int64_t kFusedMaxRows = 1024;

bool is_float_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

const char* type_name(c10::ScalarType t) {
  const char* name = kernel_type_name(t);
  TORCH_CHECK(name && t != at::kFloat8_e5m2, "mps_ext grouped_mm: no kernel for ", t);
  return name;
}

// torch's own check of a data pointer (GroupedMMUtils.h), for its error;
// whether 16-byte loads are safe is kernel_choice.h's aligned16.
bool data_ptr_aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// ------------------------------------------------------------- checks --
// The checks of the torch this is built against (and runs with), which
// changed across releases: from 2.14 the batch stride of a 3-D operand (off
// the CPU) and offs's stride are checked too.
#define MPS_EXT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// torch's check_valid_strides_and_return_transposed (GroupedMMUtils.h):
// the last two dimensions are row- or column-major with the leading stride
// a multiple of 16 bytes, and (off the CPU) the data 16-byte aligned.
void check_strides(const at::Tensor& mat) {
  const auto strides = mat.strides();
  const auto sizes = mat.sizes();
  const int64_t end = mat.dim() - 1;
  const int64_t alignment = 16 / mat.element_size();
  TORCH_CHECK(mat.device().is_cpu() || data_ptr_aligned16(mat), "expected data_ptr to be aligned to 16 bytes");
#if MPS_EXT_TORCH_AT_LEAST(2, 14)
  if (!mat.device().is_cpu() && mat.dim() == 3)
    TORCH_CHECK(strides[0] % alignment == 0,
                "batch stride must yield 16-byte-aligned per-batch pointers, got stride(0)=", strides[0],
                " with element size ", mat.element_size(), " (sizes=", sizes, ", strides=", strides, ")");
#endif
  if (strides[end - 1] == 1 && strides[end] >= std::max<int64_t>(1, sizes[end - 1])) {
    TORCH_CHECK(strides[end] % alignment == 0, "strides should be multiple of 16 bytes");
  } else if (strides[end] == 1 && strides[end - 1] >= std::max<int64_t>(1, sizes[end])) {
    TORCH_CHECK(strides[end - 1] % alignment == 0, "strides should be multiple of 16 bytes");
  } else {
    TORCH_CHECK(false, "Invalid strides/sizes, got ", mat.strides(), " for strides and ", mat.sizes(), " for sizes");
  }
}

// torch's _grouped_mm_validate_inputs and _resolve_grouped_mm_out_dtype.
void check_grouped_mm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs,
                      const c10::optional<at::Tensor>& bias, c10::optional<c10::ScalarType> out_dtype) {
  TORCH_CHECK(is_float_dtype(a.scalar_type()), "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got ",
              a.scalar_type());
  TORCH_CHECK(is_float_dtype(b.scalar_type()), "Expected mat_b to be Float32, BFloat16 or Float16 matrix, got ",
              b.scalar_type());
  TORCH_CHECK(a.dim() == 2 || a.dim() == 3, "mat_a has to be 2 or 3d");
  TORCH_CHECK(b.dim() == 2 || b.dim() == 3, "mat_b has to be 2 or 3d");
  if (a.dim() == 3 || b.dim() == 3)
    TORCH_CHECK(a.size(-1) == b.size(-2), "contraction dimension of mat_a and mat_b must match");
  check_strides(a);
  check_strides(b);
  TORCH_CHECK(offs.has_value() == (a.dim() == 2 || b.dim() == 2),
              "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d");
  if (offs.has_value()) {
    TORCH_CHECK(offs->dim() == 1, "offs has to be 1D");
    TORCH_CHECK(offs->scalar_type() == at::kInt, "Offsets have to be int32");
#if MPS_EXT_TORCH_AT_LEAST(2, 14)
    TORCH_CHECK(offs->stride(0) == 1, "Offsets must have stride (1,)");
#endif
  }
  TORCH_CHECK(!bias.has_value(), "Bias not supported yet");
  TORCH_CHECK(out_dtype.value_or(a.scalar_type()) == a.scalar_type(),
              "Grouped gemm output dtype must match `mat_a` dtype");
}

// torch's create_grouped_gemm_output_tensor: the last dimension's stride is
// padded to 16 bytes.
at::Tensor grouped_output(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs,
                          c10::ScalarType dtype) {
  std::vector<int64_t> size;
  if (a.dim() == 2 && b.dim() == 2) {
    size = {offs->size(0), a.size(0), b.size(1)};
  } else if (a.dim() == 2) {
    TORCH_CHECK(offs->size(0) == b.size(0), "matrix batch sizes have to match");
    size = {a.size(0), b.size(-1)};
  } else if (b.dim() == 2) {
    TORCH_CHECK(offs->size(0) == a.size(0), "matrix batch sizes have to match");
    size = {a.size(1), b.size(1)};
  } else {
    TORCH_CHECK(a.size(0) == b.size(0), "batched dimension has to match");
    size = {a.size(0), a.size(1), b.size(-1)};
  }
  const int64_t alignment = 16 / c10::elementSize(dtype);
  const int64_t padded = (size.back() + alignment - 1) / alignment * alignment;
  std::vector<int64_t> stride =
      size.size() == 2 ? std::vector<int64_t>{padded, 1} : std::vector<int64_t>{size[1] * padded, padded, 1};
  return at::empty_strided(size, stride, a.options().dtype(dtype));
}

// ------------------------------------------------------------ problem --
// Every layout as one GroupedMMParams problem over strided operands (see
// grouped_mm_params.h). 3D x 2D is the rows mode transposed:
// out[:, s:e] = A[g] @ B[:, s:e]  <=>  out^T[s:e, :] = B^T[s:e, :] @ A[g]^T.
struct Problem {
  GroupedMMParams p{};
  at::Tensor a, b, out;             // bound as they are, with the strides in p
  at::Tensor row_scale, col_scale;  // undefined without scales
  at::Tensor rows_of;               // p.gather: the slot of each row (fused MoE ops)
  bool dense = false;               // one batched group: gmm_tiled_dense (dense_tiled)
};

Problem make_problem(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t groups,
                     const at::Tensor* scale_a, const at::Tensor* scale_b) {
  Problem pr;
  GroupedMMParams& p = pr.p;
  pr.a = a;
  pr.b = b;
  pr.out = out;
  p.groups = static_cast<uint32_t>(groups);
  p.mul = 1.0f;
  const bool a2 = a.dim() == 2, b2 = b.dim() == 2;
  auto scales = [&](const at::Tensor* rows, int64_t rows_batch, const at::Tensor* cols, int64_t cols_batch) {
    if (!scale_a) return;
    p.scales = GMM_ROW_SCALE | GMM_COL_SCALE;
    // Each fp8 operand was decoded as x / 256.
    p.mul = 65536.0f;
    pr.row_scale = *rows;
    pr.col_scale = *cols;
    p.row_scale_batch = rows_batch;
    p.col_scale_batch = cols_batch;
  };
  if (a2 && !b2) {  // rows of a split by offs
    p.mode = GMM_MODE_ROWS;
    p.m = a.size(0), p.n = b.size(2), p.k = a.size(1);
    p.a_m = a.stride(0), p.a_k = a.stride(1);
    p.b_batch = b.stride(0), p.b_k = b.stride(1), p.b_n = b.stride(2);
    p.out_m = out.stride(0), p.out_n = out.stride(1);
    if (scale_a) scales(scale_a, 0, scale_b, scale_b->stride(0));
  } else if (!a2 && b2) {  // columns of b split by offs: transposed
    p.mode = GMM_MODE_ROWS;
    pr.a = b;
    pr.b = a;
    p.m = b.size(1), p.n = a.size(1), p.k = b.size(0);
    p.a_m = b.stride(1), p.a_k = b.stride(0);
    p.b_batch = a.stride(0), p.b_k = a.stride(2), p.b_n = a.stride(1);
    p.out_m = out.stride(1), p.out_n = out.stride(0);
    if (scale_a) scales(scale_b, 0, scale_a, scale_a->stride(0));
  } else if (a2 && b2) {  // K split by offs, one output per group
    p.mode = GMM_MODE_K;
    p.m = a.size(0), p.n = b.size(1), p.k = std::min(a.size(1), b.size(0));
    p.a_m = a.stride(0), p.a_k = a.stride(1);
    p.b_k = b.stride(0), p.b_n = b.stride(1);
    p.out_batch = out.stride(0), p.out_m = out.stride(1), p.out_n = out.stride(2);
    if (scale_a) scales(scale_a, a.size(0), scale_b, b.size(1));
  } else {  // batched
    p.mode = GMM_MODE_BATCHED;
    p.m = a.size(1), p.n = b.size(2), p.k = a.size(2);
    p.a_batch = a.stride(0), p.a_m = a.stride(1), p.a_k = a.stride(2);
    p.b_batch = b.stride(0), p.b_k = b.stride(1), p.b_n = b.stride(2);
    p.out_batch = out.stride(0), p.out_m = out.stride(1), p.out_n = out.stride(2);
    if (scale_a) scales(scale_a, scale_a->stride(0), scale_b, scale_b->stride(0));
  }
  return pr;
}

// The kernels index within one group's matrices in 32 bits.
bool fits_32_bits(int64_t rows, int64_t row_stride, int64_t cols, int64_t col_stride) {
  if (rows == 0 || cols == 0) return true;
  const uint64_t last = uint64_t(rows - 1) * uint64_t(row_stride) + uint64_t(cols - 1) * uint64_t(col_stride);
  return last <= std::numeric_limits<uint32_t>::max();
}

Reason problem_unsupported(const at::Tensor& a, const at::Tensor& b) {
  for (const at::Tensor* t : {&a, &b})
    if (t->layout() != at::kStrided) return because::not_strided;
  // Rows and columns of a and of one group of b, in whichever orientation.
  auto last2 = [](const at::Tensor& t) { return fits_32_bits(t.size(-2), t.stride(-2), t.size(-1), t.stride(-1)); };
  if (!last2(a) || !last2(b)) return because::group_past_2_32;
  for (const at::Tensor* t : {&a, &b})
    if (t->size(-1) > std::numeric_limits<int32_t>::max() || t->size(-2) > std::numeric_limits<int32_t>::max() ||
        (t->dim() == 3 && t->size(0) > std::numeric_limits<int32_t>::max()))
      return because::dimension_past_2_31;
  return {};
}

// ---------------------------------------------------------- the launch --
// The variant policy (shapes and alignment only; never offs):
// - rows mode with at most kDecodeMaxRows rows: decode kernels, a grid slot
//   per row. gmm_decode_rows when b's K is contiguous (the MoE layout
//   W[E, N, K].transpose(-2, -1)) or neither dimension is; gmm_decode_cols
//   when b's N is contiguous (W[E, K, N]). _vec (16-byte loads) where the
//   host checked every address such a load can touch is 16-byte aligned.
//   gmm_decode_rows threadgroups: decode_geometry (dispatch/kernel_choice.h).
// - everything else: gmm_tiled, a 64 x 64 tile per threadgroup; the rows
//   mode launches ceil(m / 64) row tiles (a tile may span groups), the
//   K-split and batched modes one tile grid per group.
// `types`: the kernels' type suffix ("bf16", "e4m3", "bf16_e4m3w": bfloat
// activations with fp8 weights).
// `fused`: mps_ext's MoE ops, which always take the decode kernel.
// `routed`: moe_gate_up_routed's buffers 7-12 (the routing's parameters,
// bias and outputs): the decode kernel that routes the rows itself from the
// router's logits, bound where offs is (moe_experts_routed).
void run(const Problem& pr, const at::Tensor& offs, const std::string& types, bool fused = false,
         const std::vector<KernelArg>* routed = nullptr) {
  GroupedMMParams p = pr.p;
  const int64_t item = pr.b.element_size();
  Launch l;
  l.library = "grouped_mm";
  const bool decode = p.mode == GMM_MODE_ROWS && (p.m <= kDecodeMaxRows || fused);
  const bool fp8 = pr.b.scalar_type() == at::kFloat8_e4m3fn;
  const bool cols = p.b_n == 1 && p.b_k != 1 && p.n > 1 && !fp8 && !p.swiglu && !p.gather;
  TORCH_CHECK(decode || !(p.swiglu || p.gather), "mps_ext grouped_mm: the fused MoE ops run the decode kernel only");
  std::string name;
  if (decode && !cols) {
    const bool vec =
        p.a_k == 1 && p.b_k == 1 && aligned16(pr.a, p.a_m) && aligned16(pr.b, p.b_n) && aligned16(pr.b, p.b_batch);
    // Chunks of rows that work at once: at most a group each (the host
    // never reads offs), so their rows and the activation reuse are
    // estimated from m spread over the groups.
    const int64_t outputs = p.swiglu ? p.n / 2 : p.n;
    const int64_t chunks = std::max<int64_t>(std::min<int64_t>(p.m, p.groups), 1);
    const int64_t rows = std::min<int64_t>(ceil_div(p.m, chunks), GMM_DECODE_MAX_ROWS);
    TORCH_INTERNAL_ASSERT(!routed || vec, "moe_gate_up_routed has only a _vec variant");
    name = (routed ? "moe_gate_up_routed_" : "gmm_decode_rows_") + types + (vec ? "_vec" : "_scalar");
    const DecodeGeometry g = fit_threads(
        decode_geometry(device_profile(pr.b.device()), outputs, chunks,
                        p.swiglu ? GMM_ROWS_OUTPUTS / 2 : GMM_ROWS_OUTPUTS, true, rows * pr.a.element_size() / item),
        outputs, thread_budget(pr.b.device(), l.library, name, DECODE_MAX_THREADS));
    l.threadgroups = {static_cast<uint32_t>(g.threadgroups), p.m, 1};
    l.threads_per_threadgroup = {static_cast<uint32_t>(32 * g.simdgroups), 1, 1};
  } else if (decode) {
    const bool vec = aligned16(pr.b, p.b_k) && aligned16(pr.b, p.b_batch);
    name = "gmm_decode_cols_" + types + (vec ? "_vec" : "_scalar");
    l.threadgroups = {static_cast<uint32_t>(ceil_div(p.n, decode_cols_columns(vec, item))), p.m, 1};
    l.threads_per_threadgroup = {DECODE_COLS_THREADS, 1, 1};
  } else {
    name = (pr.dense ? "gmm_tiled_dense_" : "gmm_tiled_") + types;
    // 16-byte loads of a stage's pieces: a's K contiguous and its rows 16-byte
    // aligned; b's contiguous dimension (K or N) likewise, and its groups.
    const bool b_rows = (p.b_k == 1 && aligned16(pr.b, p.b_n)) || (p.b_k != 1 && p.b_n == 1 && aligned16(pr.b, p.b_k));
    p.tile_vec = (p.a_k == 1 && aligned16(pr.a, p.a_m) && aligned16(pr.a, p.a_batch) ? GMM_TILE_VEC_A : 0) |
                 (b_rows && aligned16(pr.b, p.b_batch) ? GMM_TILE_VEC_B : 0);
    l.threadgroups = {(p.n + GMM_TILE_N - 1) / GMM_TILE_N, (p.m + GMM_TILE_M - 1) / GMM_TILE_M,
                      p.mode == GMM_MODE_ROWS ? 1u : p.groups};
    l.threads_per_threadgroup = {GMM_TILE_THREADS, 1, 1};
  }
  l.kernel = name;
  // Without scales the output stands in for buffers 5 and 6; never read.
  l.args = {KernelArg::of(pr.out), KernelArg::of(pr.a), KernelArg::of(pr.b), KernelArg::of(offs), KernelArg::value(p)};
  if (name.rfind("gmm_decode_cols", 0) != 0) {
    l.args.push_back(KernelArg::of(pr.row_scale.defined() ? pr.row_scale : pr.out));
    l.args.push_back(KernelArg::of(pr.col_scale.defined() ? pr.col_scale : pr.out));
  }
  if (name.rfind("gmm_decode_rows", 0) == 0) l.args.push_back(KernelArg::of(pr.rows_of.defined() ? pr.rows_of : offs));
  if (routed) l.args.insert(l.args.end(), routed->begin(), routed->end());
  launch(l);
}

// offs as the kernels read it: contiguous int32 (a device copy if it was a
// strided view; its values are never looked at here). 3D x 3D has none:
// the output stands in (the batched mode never reads it).
at::Tensor offs_for_kernel(const c10::optional<at::Tensor>& offs, const at::Tensor& out) {
  if (!offs.has_value()) return out;
  return offs->is_contiguous() ? *offs : offs->contiguous();
}

int64_t group_count(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs) {
  return offs.has_value() ? offs->size(0) : a.size(0);
}

}  // namespace

// ------------------------------------------------------------ _grouped_mm --
Reason grouped_mm_unsupported(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() && is_float_dtype(a.scalar_type()) && is_float_dtype(b.scalar_type()))
    return because::mixed_dtypes;             // torch's own error follows
  if (a.dim() < 2 || b.dim() < 2) return {};  // our checks raise torch's error
  return problem_unsupported(a, b);
}

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs,
                      const c10::optional<at::Tensor>& bias, c10::optional<c10::ScalarType> out_dtype) {
  check_grouped_mm(a, b, offs, bias, out_dtype);
  at::Tensor out = grouped_output(a, b, offs, a.scalar_type());
  const int64_t groups = group_count(a, b, offs);
  if (out.numel() == 0 || groups == 0) return out;
  run(make_problem(a, b, out, groups, nullptr, nullptr), offs_for_kernel(offs, out), type_name(a.scalar_type()));
  return out;
}

// ---------------------------------------------------- dense products --
// A dense product is a grouped one with one group: the batched mode over the
// operands seen with a batch dimension of 1, run by gmm_tiled's dense
// instantiation (the mode fixed at compile time). It reads no offs (the
// output stands in for the buffer) and no batch strides (group 0 only).
Reason dense_tiled_unsupported(const at::Tensor& a, const at::Tensor& b) { return problem_unsupported(a, b); }

namespace {
// The batched problem of one group over out [M, N] = a [M, K] @ b [K, N].
Problem dense_problem(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  Problem pr = make_problem(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), 1, nullptr, nullptr);
  // (Zero, not the views' sizes: they would only decide the 16-byte loads'
  // alignment of a batch that does not exist.)
  pr.p.a_batch = pr.p.b_batch = pr.p.out_batch = 0;
  pr.dense = true;
  return pr;
}

bool dense_shapes(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  return a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) && out.size(0) == a.size(0) &&
         out.size(1) == b.size(1) && out.scalar_type() == a.scalar_type();
}
}  // namespace

void dense_tiled(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  TORCH_CHECK(dense_shapes(a, b, out) && a.scalar_type() == b.scalar_type(),
              "mps_ext dense_tiled: out [M, N] = a [M, K] @ b [K, N] in one dtype, got ", a.sizes(), " @ ", b.sizes(),
              " into ", out.sizes());
  if (out.numel() == 0) return;
  run(dense_problem(a, b, out), out, type_name(a.scalar_type()));
}

void dense_tiled_fp8(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale, const at::Tensor& out) {
  const auto t = a.scalar_type();
  TORCH_CHECK(dense_shapes(a, b, out) && (t == at::kHalf || t == at::kBFloat16) &&
                  b.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat &&
                  (scale.numel() == 1 || (scale.dim() == 1 && scale.size(0) == b.size(1) && scale.stride(0) == 1)),
              "mps_ext dense_tiled_fp8: out [M, N] = a [M, K] (float16/bfloat16) @ b [K, N] (float8_e4m3fn) * scale "
              "(float32, one element or N contiguous) in a's dtype, got ",
              a.sizes(), " ", t, " @ ", b.sizes(), " ", b.scalar_type(), ", scale ", scale.sizes(), " into ",
              out.sizes());
  if (out.numel() == 0) return;
  Problem pr = dense_problem(a, b, out);
  // The weights are decoded as value / 256 (gmm_tiled's e4m3 staging).
  pr.p.mul = 256.0f;
  pr.p.scales = GMM_COL_SCALE | (scale.numel() == 1 ? GMM_COL_SCALE_ONE : 0);
  pr.col_scale = scale;
  run(pr, out, std::string(type_name(t)) + "_e4m3w");
}

// ---------------------------------------------------- _scaled_grouped_mm --
namespace {

bool row_major(const at::Tensor& t) { return t.stride(-2) > 1 && t.stride(-1) == 1; }
bool col_major(const at::Tensor& t) { return t.stride(-2) == 1 && t.stride(-1) > 1; }

// torch's checks for _scaled_grouped_mm (the ones of its meta function,
// torch/_meta_registrations.py, which mirror the CUDA kernel's).
void check_scale(const char* name, const at::Tensor& scale, const at::Tensor& mat, int64_t scaled_dim,
                 int64_t multiplier) {
  if (mat.dim() == 2) {
    TORCH_CHECK(scale.is_contiguous(), "Expected ", name, " to be contiguous.");
    TORCH_CHECK(scale.dim() == 1, "Expected ", name, " to be 1D tensor, but got ", scale.dim(), "D tensor.");
    TORCH_CHECK(scale.size(0) == mat.size(scaled_dim) * multiplier, "Expected ", name, " to have ",
                mat.size(scaled_dim) * multiplier, " elements, got ", scale.size(0), " elements.");
  } else {
    TORCH_CHECK(scale.dim() >= 1 && scale.stride(-1) == 1, "Expected ", name,
                " to be contiguous in the last dimension.");
    TORCH_CHECK(scale.size(0) == mat.size(0), "Expected ", name, " batch dimension to be ", mat.size(0), ", got ",
                scale.size(0), ".");
    TORCH_CHECK(scale.dim() == 2, "Expected ", name, " to be 2D tensor, but got ", scale.dim(), "D tensor.");
    TORCH_CHECK(scale.size(1) == mat.size(1 + scaled_dim), "Expected ", name, " non-batch dimension to be ",
                mat.size(1 + scaled_dim), ", got ", scale.size(1), ".");
  }
}

void check_fp8_strides(const char* name, const at::Tensor& mat) {
  const int64_t end = mat.dim() - 1;
  const int64_t alignment = 16 / mat.element_size();
  const auto st = mat.strides();
  TORCH_CHECK(mat.device().is_cpu() || data_ptr_aligned16(mat), "expected data_ptr to be aligned to 16 bytes");
  if (st[end - 1] == 1 && st[end] >= std::max<int64_t>(1, mat.size(end - 1))) {
    TORCH_CHECK(st[end] % alignment == 0, "Expected ", name, " stride along ", end,
                " dim to be multiple of 16 bytes, got ", st[end], ".");
  } else if (st[end] == 1 && st[end - 1] >= std::max<int64_t>(1, mat.size(end))) {
    TORCH_CHECK(st[end - 1] % alignment == 0, "Expected ", name, " stride along ", end - 1,
                " dim to be multiple of 16 bytes, got ", st[end - 1], ".");
  } else {
    TORCH_CHECK(false, "Invalid strides/sizes, got ", mat.strides(), " for strides and ", mat.sizes(), " for sizes.");
  }
}

void check_scaled_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const c10::optional<at::Tensor>& offs,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale_result,
                             c10::optional<c10::ScalarType> out_dtype) {
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
              "Expected inputs of E4M3 FP8 type but got mat_a.dtype=", a.scalar_type(),
              " and mat_b.dtype=", b.scalar_type(), ".");
  TORCH_CHECK((a.dim() == 2 || a.dim() == 3) && (b.dim() == 2 || b.dim() == 3),
              "Multiplicands must be 2D or 3D but got mat_a.dim()=", a.dim(), " and mat_b.dim()=", b.dim());
  const bool a2 = a.dim() == 2, b2 = b.dim() == 2;
  if (!a2 || !b2) TORCH_CHECK(a.size(-1) == b.size(-2), "contraction dimension of mat_a and mat_b must match");
  TORCH_CHECK(row_major(a), "Expected mat_a tensor to be row major in the last two dimensions, got strides ",
              a.strides().slice(a.dim() - 2));
  TORCH_CHECK(col_major(b), "Expected mat_b tensor to be column major in the last two dimensions, got strides ",
              b.strides().slice(b.dim() - 2));
  check_fp8_strides("mat_a", a);
  check_fp8_strides("mat_b", b);
  TORCH_CHECK(scale_a.scalar_type() != at::kFloat8_e8m0fnu || scale_b.scalar_type() != at::kFloat8_e8m0fnu,
              "mps_ext _scaled_grouped_mm: MXFP8 (float8_e8m0fnu block scales) is not implemented; it takes "
              "float32 row-wise scales");
  TORCH_CHECK(scale_a.scalar_type() == at::kFloat && scale_b.scalar_type() == at::kFloat,
              "For FP8 scales must both be float32, or for MXFP8 both scales must be float8_e8m0fnu. Got "
              "scale_a.dtype=",
              scale_a.scalar_type(), " and scale_b.dtype=", scale_b.scalar_type(), ".");
  const int64_t multiplier = offs.has_value() && a2 && b2 ? offs->size(0) : 1;
  check_scale("scale_a", scale_a, a, 0, multiplier);
  check_scale("scale_b", scale_b, b, 1, multiplier);
  TORCH_CHECK(!scale_result.has_value(), "Scale result tensor provided, but it is not supported yet.");
  if (a2 || b2) {
    TORCH_CHECK(offs.has_value(), "Offsets tensor not provided, but is needed for ", a.dim(), "D/", b.dim(),
                "D multiplicand layouts.");
    TORCH_CHECK(offs->dim() == 1, "Offsets tensor must be 1D, but got offs.dim()=", offs->dim(), ".");
    TORCH_CHECK(offs->scalar_type() == at::kInt, "Offsets tensor must be integer (int32) tensor, but got ",
                offs->scalar_type(), ".");
  } else {
    TORCH_CHECK(!offs.has_value(), "Offsets tensor provided, but is not needed for 3D/3D multiplicand layouts.");
  }
  TORCH_CHECK(!bias.has_value(), "Bias tensor provided, but it is not supported yet.");
  TORCH_CHECK(!out_dtype.has_value() || *out_dtype == at::kBFloat16,
              "If output dtype provided, it must be torch.bfloat16.");
}

}  // namespace

Reason scaled_grouped_mm_unsupported(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() < 2 || b.dim() < 2) return {};  // our checks raise torch's error
  return problem_unsupported(a, b);
}

at::Tensor scaled_grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const c10::optional<at::Tensor>& offs,
                             const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale_result,
                             c10::optional<c10::ScalarType> out_dtype) {
  check_scaled_grouped_mm(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype);
  at::Tensor out = grouped_output(a, b, offs, at::kBFloat16);
  const int64_t groups = group_count(a, b, offs);
  if (out.numel() == 0 || groups == 0) return out;
  run(make_problem(a, b, out, groups, &scale_a, &scale_b), offs_for_kernel(offs, out), type_name(a.scalar_type()));
  return out;
}

// ----------------------------------------------------------- moe_experts --
namespace {

// What moe_experts and moe_down_combine take: x [rows or tokens, K] against
// weight [experts, N, K] in x's dtype, or float8_e4m3fn with weight_scale
// [experts, N] (float32) and bfloat16 x; offs int32 [experts].
void check_moe_operands(const char* op, const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& weight_scale, const at::Tensor* offs) {
  const bool fp8 = weight.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2), op,
              ": x [tokens or rows, K] and weight [experts, N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(is_float_dtype(x.scalar_type()), op, ": x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(fp8 ? x.scalar_type() == at::kBFloat16 : weight.scalar_type() == x.scalar_type(), op,
              ": weight must have x's dtype, or be float8_e4m3fn with bfloat16 x; got ", weight.scalar_type(), " and ",
              x.scalar_type());
  TORCH_CHECK(fp8 == weight_scale.has_value(), op,
              ": fp8 weights need weight_scale [experts, N] (float32), other "
              "weights none");
  if (fp8)
    TORCH_CHECK(weight_scale->scalar_type() == at::kFloat && weight_scale->dim() == 2 &&
                    weight_scale->size(0) == weight.size(0) && weight_scale->size(1) == weight.size(1) &&
                    weight_scale->stride(1) == 1,
                op, ": weight_scale must be float32 [experts, N] contiguous in N, got ", weight_scale->sizes());
  if (offs)
    TORCH_CHECK(offs->dim() == 1 && offs->scalar_type() == at::kInt && offs->size(0) == weight.size(0), op,
                ": offs must be int32 [experts]");
  const Reason why = problem_unsupported(x, weight);
  TORCH_CHECK(!why, op, ": ", why.text());
}

// Their product: `rows` rows of x (sorted by expert as offs says) against
// each expert's weight rows into out, fp8 weights' scales per column.
Problem moe_problem(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& weight_scale,
                    int64_t rows, const at::Tensor& out) {
  Problem pr;
  GroupedMMParams& p = pr.p;
  pr.a = x, pr.b = weight, pr.out = out;
  p.mode = GMM_MODE_ROWS;
  p.groups = static_cast<uint32_t>(weight.size(0));
  p.m = static_cast<uint32_t>(rows), p.n = weight.size(1), p.k = x.size(1);
  p.a_m = x.stride(0), p.a_k = x.stride(1);
  p.b_batch = weight.stride(0), p.b_k = weight.stride(2), p.b_n = weight.stride(1);
  p.out_m = out.stride(0), p.out_n = out.stride(1);
  p.mul = 1.0f;
  if (weight_scale) {
    p.scales = GMM_COL_SCALE;
    p.mul = 256.0f;  // the weights are decoded as w / 256
    pr.col_scale = *weight_scale;
    p.col_scale_batch = weight_scale->stride(0);
  }
  return pr;
}

}  // namespace

// mps_ext's fused decode product of a MoE layer (see moe.cpp).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& weight_scale,
                       const at::Tensor& offs, const c10::optional<at::Tensor>& slot_of_row, int64_t slots_per_token,
                       bool swiglu) {
  check_moe_operands("moe_experts", x, weight, weight_scale, &offs);
  const int64_t rows = slot_of_row ? slot_of_row->numel() : x.size(0);
  if (slot_of_row)
    TORCH_CHECK(slot_of_row->scalar_type() == at::kInt && slot_of_row->dim() == 1 && slot_of_row->is_contiguous() &&
                    slots_per_token >= 1 && rows <= x.size(0) * slots_per_token,
                "moe_experts: slot_of_row must be contiguous int32 [rows] with rows <= tokens * slots_per_token");
  TORCH_CHECK(rows <= kFusedMaxRows, "moe_experts is the decode path: at most ", kFusedMaxRows, " routed rows, got ",
              rows, "; use F.grouped_mm");
  TORCH_CHECK(!swiglu || weight.size(1) % 2 == 0, "moe_experts: swiglu needs weight rows [gate | up], got ",
              weight.size(1));
  at::Tensor out = at::empty({rows, swiglu ? weight.size(1) / 2 : weight.size(1)}, x.options());
  if (out.numel() == 0 || weight.size(0) == 0) return out;
  Problem pr = moe_problem(x, weight, weight_scale, rows, out);
  pr.p.swiglu = swiglu ? 1 : 0;
  if (slot_of_row) {
    pr.p.gather = static_cast<uint32_t>(slots_per_token);
    pr.rows_of = *slot_of_row;
  }
  run(pr, offs.contiguous(), weight_scale ? "bf16_e4m3w" : type_name(x.scalar_type()), true);
  return out;
}

// moe_experts(x, weight, weight_scale, offs, slot_of_row, slots, swiglu)
// with the routing that makes offs and slot_of_row folded in
// (moe_gate_up_routed, kernels_metal/grouped_mm.metal; moe.cpp's
// experts_of): `rows` = tokens * slots routed rows, from the router's
// `logits` and `route` (the kernel's buffers 7-12, moe.cpp's). nullopt,
// with nothing launched, where the kernel does not take the operands: it
// has only the 16-byte-load variant.
c10::optional<at::Tensor> moe_experts_routed(const at::Tensor& x, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& weight_scale, const at::Tensor& logits,
                                             int64_t slots, int64_t rows, const std::vector<KernelArg>& route) {
  check_moe_operands("moe_experts", x, weight, weight_scale, nullptr);
  TORCH_CHECK(rows <= kFusedMaxRows && weight.size(1) % 2 == 0 && rows <= x.size(0) * slots,
              "moe_experts_routed: at most ", kFusedMaxRows, " rows of swiglu [gate | up] weights");
  if (weight.size(0) == 0 || weight.size(1) == 0 || rows == 0 ||
      !(x.stride(1) == 1 && weight.stride(2) == 1 && aligned16(x, x.stride(0)) && aligned16(weight, weight.stride(1)) &&
        aligned16(weight, weight.stride(0))))
    return c10::nullopt;
  at::Tensor out = at::empty({rows, weight.size(1) / 2}, x.options());
  Problem pr = moe_problem(x, weight, weight_scale, rows, out);
  pr.p.swiglu = 1;
  pr.p.gather = static_cast<uint32_t>(slots);
  run(pr, logits, weight_scale ? "bf16_e4m3w" : type_name(x.scalar_type()), true, &route);
  return out;
}

// ------------------------------------------------------ moe_down_combine --
// moe_experts(h, down, down_scale, offs) then moe_combine(y, weights,
// row_of_slot) as one dispatch, with the same bits (moe_layer's decode;
// kernels_metal/grouped_mm.metal). h: moe_experts' gated rows [rows, I],
// sorted by expert as offs says; weights [tokens, slots] and row_of_slot
// [tokens * slots] from moe_route, rows = tokens * slots. residual: the
// output's shape and type (moe_layer checks it against x), added to each
// rounded sum.
at::Tensor moe_down_combine(const at::Tensor& h, const at::Tensor& down, const c10::optional<at::Tensor>& down_scale,
                            const at::Tensor& offs, const at::Tensor& weights, const at::Tensor& row_of_slot,
                            const c10::optional<at::Tensor>& residual) {
  static_assert(MOE_DOWN_Y_ELEMENTS >= GMM_ROWS_OUTPUTS * kFusedMaxRows,
                "a threadgroup of one simdgroup keeps every routed row's outputs");
  check_moe_operands("moe_down_combine", h, down, down_scale, &offs);
  TORCH_CHECK(h.stride(1) == 1 && offs.is_contiguous(), "moe_down_combine: h's rows and offs must be contiguous");
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                  row_of_slot.scalar_type() == at::kInt && row_of_slot.is_contiguous() &&
                  row_of_slot.numel() == weights.numel() && h.size(0) == weights.numel() && h.size(0) <= kFusedMaxRows,
              "moe_down_combine: weights contiguous float32 [tokens, slots], row_of_slot contiguous int32 [tokens * "
              "slots] and h one row per slot, at most ",
              kFusedMaxRows, " rows; got ", weights.sizes(), ", ", row_of_slot.sizes(), " and ", h.sizes());
  const int64_t rows = h.size(0), hidden = down.size(1);
  at::Tensor out = at::empty({weights.size(0), hidden}, h.options());
  // The kernel reads it at out's offsets.
  TORCH_INTERNAL_ASSERT(!residual ||
                        (residual->sizes() == out.sizes() && residual->is_contiguous() &&
                         residual->scalar_type() == out.scalar_type() && residual->device() == out.device()));
  if (out.numel() == 0 || down.size(0) == 0) return out;
  const bool fp8 = down_scale.has_value();
  GroupedMMParams p = moe_problem(h, down, down_scale, rows, out).p;
  p.tokens = static_cast<uint32_t>(weights.size(0));
  p.slots = static_cast<uint32_t>(weights.size(1));
  p.residual = residual ? 1 : 0;
  // moe_experts' geometry for the block of columns a threadgroup owns, but
  // each threadgroup takes every chunk of rows (no grid slot per row): a
  // power of two of simdgroups (the kernel maps threads to columns with
  // shifts), whose columns of every row fit MOE_DOWN_Y_ELEMENTS.
  const int64_t item = down.element_size();
  const int64_t chunks = std::max<int64_t>(std::min<int64_t>(rows, p.groups), 1);
  const int64_t chunk_rows = std::min<int64_t>(ceil_div(rows, chunks), GMM_DECODE_MAX_ROWS);
  const bool vec = aligned16(h, p.a_m) && aligned16(down, p.b_n) && aligned16(down, p.b_batch);
  Launch l;
  l.library = "grouped_mm";
  l.kernel =
      std::string("moe_down_combine_") + (fp8 ? "bf16_e4m3w" : type_name(h.scalar_type())) + (vec ? "_vec" : "_scalar");
  const DecodeGeometry g = fit_threads(decode_geometry(device_profile(down.device()), hidden, 1, GMM_ROWS_OUTPUTS, true,
                                                       chunk_rows * h.element_size() / item),
                                       hidden, thread_budget(down.device(), l.library, l.kernel, DECODE_MAX_THREADS));
  int64_t simdgroups = 1;
  while (2 * simdgroups <= g.simdgroups && 2 * simdgroups * GMM_ROWS_OUTPUTS * rows <= MOE_DOWN_Y_ELEMENTS)
    simdgroups *= 2;
  const int64_t cols = simdgroups * GMM_ROWS_OUTPUTS;
  p.outputs_log2 = 0;
  while ((int64_t(1) << p.outputs_log2) < cols) ++p.outputs_log2;
  // Without scales or a residual the output stands in for them; never read.
  l.args = {KernelArg::of(out),     KernelArg::of(h),           KernelArg::of(down),
            KernelArg::of(offs),    KernelArg::value(p),        KernelArg::of(fp8 ? *down_scale : out),
            KernelArg::of(weights), KernelArg::of(row_of_slot), KernelArg::of(residual ? *residual : out)};
  l.threadgroups = {static_cast<uint32_t>(ceil_div(hidden, cols)), 1, 1};
  l.threads_per_threadgroup = {static_cast<uint32_t>(32 * simdgroups), 1, 1};
  launch(l);
  return out;
}

// -------------------------------------------------------- registration --
namespace {

using c10::DispatchKey;

const RoutedOp kGroupedMm(FamilyId::grouped_mm, "aten::_grouped_mm"),
    kScaledGroupedMm(FamilyId::grouped_mm, "aten::_scaled_grouped_mm"),
    kScaledGroupedMmV2(FamilyId::grouped_mm, "aten::_scaled_grouped_mm_v2");

// The policy, for a rule that leaves to torch the calls picked here
// (mps_ext/_policy.py; on MPS from torch 2.15): torch's _grouped_mm_mps
// (operations/GroupedMM.mm, grouped_mm_out_mps) takes a jagged-row product
// (2D x 3D; 3D x 2D through its transpose) of at most min(32, groups) rows
// with K contiguous in both operands to its few-rows kernel, which streams
// each chosen expert's weights once, as mps_ext's decode kernel does. What
// mps_ext takes back is only what docs/dev/policy.md counted better: bfloat16
// jagged-row products of more than kDecodeMaxRows rows (where mps_ext runs
// gmm_tiled; fewer run its decode kernel, not counted against torch's tile)
// with K contiguous in both operands, which torch runs on its simdgroup tile.
// Everything else (2D x 2D on torch's K-split tile, 3D x 3D on its bmm, other
// dtypes and layouts) is the torch_grouped_mm condition's: the rule's reason,
// or none. Shapes and strides only; offs is never read.
Reason policy(c10::DispatchKey key, const at::Tensor& a, const at::Tensor& b) {
  const Reason rule = kGroupedMm.picked(key, Condition::torch_grouped_mm);
  if (!rule) return {};
  const bool jagged_rows = a.dim() == 2 && b.dim() == 3, jagged_cols = a.dim() == 3 && b.dim() == 2;
  if (!(jagged_rows || jagged_cols) || a.scalar_type() != at::kBFloat16) return rule;
  // The jagged dimension: a's rows, or (transposed) b's columns.
  const int64_t rows = jagged_rows ? a.size(0) : b.size(1);
  const bool k_contiguous = a.stride(-1) == 1 && b.stride(-2) == 1;
  return rows > kDecodeMaxRows && k_contiguous ? Reason() : rule;
}

template <DispatchKey K>
at::Tensor grouped_mm_impl(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& offs,
                           const c10::optional<at::Tensor>& bias, c10::optional<c10::ScalarType> out_dtype) {
  Reason why = grouped_mm_unsupported(a, b);
  if (!why && a.dim() >= 2 && b.dim() >= 2) why = policy(K, a, b);
  return route<decltype(grouped_mm_impl<K>)>(
      kGroupedMm, K, why, [&] { return mps_ext::grouped_mm(a, b, offs, bias, out_dtype); }, a, b, offs, bias,
      out_dtype);
}

template <DispatchKey K>
at::Tensor scaled_grouped_mm_impl(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                  const at::Tensor& scale_b, const c10::optional<at::Tensor>& offs,
                                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale_result,
                                  c10::optional<c10::ScalarType> out_dtype, bool use_fast_accum) {
  return route<decltype(scaled_grouped_mm_impl<K>)>(
      kScaledGroupedMm, K, scaled_grouped_mm_unsupported(a, b),
      [&] { return mps_ext::scaled_grouped_mm(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype); }, a, b,
      scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum);
}

// _scaled_grouped_mm_v2 (F.scaled_grouped_mm, torch 2.10 on): the recipe
// _scaled_grouped_mm takes, as v2 spells it (one RowWise float32 scale per
// operand, unswizzled, K the last dimension of a and the second-to-last of
// b); then _scaled_grouped_mm's checks. torch has no kernel for it off CUDA,
// so what else it is given gets an error saying what is supported.
Reason scaled_grouped_mm_v2_unsupported(const at::Tensor& a, const at::Tensor& b, at::TensorList scale_a,
                                        at::IntArrayRef recipe_a, at::IntArrayRef swizzle_a, at::TensorList scale_b,
                                        at::IntArrayRef recipe_b, at::IntArrayRef swizzle_b,
                                        at::IntArrayRef contraction_dim) {
  auto one = [](at::TensorList scales, at::IntArrayRef recipe) {
    return scales.size() == 1 && recipe.size() == 1 && recipe[0] == kRowWise;
  };
  auto no_swizzle = [](at::IntArrayRef s) { return s.empty() || (s.size() == 1 && s[0] == 0); };
  if (!one(scale_a, recipe_a) || !one(scale_b, recipe_b) || !no_swizzle(swizzle_a) || !no_swizzle(swizzle_b))
    return because::grouped_scale_recipes(
        c10::str("scale recipes a=", recipe_a, " b=", recipe_b, ", swizzles a=", swizzle_a, " b=", swizzle_b));
  if (!contraction_dim.empty() &&
      !(contraction_dim.size() == 2 && contraction_dim[0] == -1 && contraction_dim[1] == -2))
    return because::grouped_contraction_dim(c10::str(contraction_dim));
  return scaled_grouped_mm_unsupported(a, b);
}

template <DispatchKey K>
at::Tensor scaled_grouped_mm_v2_impl(const at::Tensor& a, const at::Tensor& b, at::TensorList scale_a,
                                     at::IntArrayRef recipe_a, at::IntArrayRef swizzle_a, at::TensorList scale_b,
                                     at::IntArrayRef recipe_b, at::IntArrayRef swizzle_b,
                                     const c10::optional<at::Tensor>& offs, const c10::optional<at::Tensor>& bias,
                                     c10::optional<c10::ScalarType> out_dtype, at::IntArrayRef contraction_dim,
                                     bool use_fast_accum) {
  return route<decltype(scaled_grouped_mm_v2_impl<K>)>(
      kScaledGroupedMmV2, K,
      scaled_grouped_mm_v2_unsupported(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b,
                                       contraction_dim),
      [&] { return mps_ext::scaled_grouped_mm(a, b, scale_a[0], scale_b[0], offs, bias, c10::nullopt, out_dtype); }, a,
      b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, offs, bias, out_dtype, contraction_dim,
      use_fast_accum);
}

template <DispatchKey K>
void register_grouped_mm(FamilyOps& ops) {
  ops.aten("_grouped_mm", TORCH_FN(grouped_mm_impl<K>));
  ops.aten("_scaled_grouped_mm", TORCH_FN(scaled_grouped_mm_impl<K>));
  ops.aten("_scaled_grouped_mm_v2", TORCH_FN(scaled_grouped_mm_v2_impl<K>));
}

}  // namespace
}  // namespace mps_ext

// Meta kernels: mps_ext/_meta.py (torch's own take bfloat16 only before torch
// 2.14, pad the output's stride only for CUDA before 2.15, and do not exist
// for _scaled_grouped_mm_v2 before 2.14).
MPS_EXT_FAMILY_OWN_META(grouped_mm, mps_ext::register_grouped_mm)
