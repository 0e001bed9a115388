// Matrix-vector products for decode: 1 to 8 activation rows against a weight
// whose bytes must stream from memory exactly once. Every weight element is
// loaded once and applied to all activation rows; the accumulation is in
// float.
//
// gemv_rows  the weight's K dimension is contiguous (F.linear's [N, K] W):
//            decode.h's decode_rows (a simdgroup owns Q = 1 or 2 weight
//            rows, its lanes stride K with 16-byte loads, the threadgroup's
//            simdgroups share the staged activations).
// gemv_cols  the weight's N dimension is contiguous (x @ W with W [K, N]):
//            decode.h's decode_cols (a threadgroup owns 128 bytes of
//            columns and a range of K); when the columns alone give too few
//            threadgroups, K is split over several (gemv_cols_finish adds
//            their sums).
// VEC: 16-byte loads of the weight (and, in gemv_rows, the activations),
// used when the host found the addresses 16-byte aligned; otherwise element
// loads. Registers: decode.h.
#include <metal_stdlib>
#include "decode.h"
#include "linear_params.h"
#include "attention_gate_params.h"
#include "pieces.h"
#include "activations.h"
using namespace metal;
#include "rms_norm.h"

MPS_EXT_INLINE float finish(float acc, constant GemvParams& p, float bias) {
  return p.has_bias ? p.alpha * acc + p.beta * bias : p.alpha * acc;
}

template <typename T>
MPS_EXT_INLINE void write_output(
    device T* y, const device T* bias, constant GemvParams& p, long r, long n, float total) {
  const float b = p.has_bias ? float(bias[r * p.bias_row_stride + n * p.bias_n_stride]) : 0.0f;
  y[r * p.y_row_stride + n * p.y_n_stride] = T(finish(total, p, b));
}

// ------------------------------------------------------ the jobs (decode.h) --
// What both of this family's jobs read beyond their operands: dense rows of
// x; alpha, beta and the bias on the way out. A member of each job (Metal
// has no derived classes), with the job's operands filled by init.
template <typename T>
struct GemvInOut {
  typedef DecodeOperands<DecodeFloat<T>, DecodeFloat<T>> Operands;
  device T* y;
  const device T* x;
  const device T* bias;
  constant GemvParams* p;
  int x_row_stride;
  MPS_EXT_INLINE void init(thread Operands& op,
                           device T* y_,
                           const device T* x_,
                           const device T* w_,
                           constant GemvParams& p_,
                           const device T* bias_) {
    y = y_;
    x = x_;
    op.w = w_;
    bias = bias_;
    p = &p_;
    op.rows = int(p_.rows);
    op.k = int(p_.k);  // K and x's offsets fit in 31 bits (the host checks)
    x_row_stride = int(p_.x_row_stride);
    op.x_k = p_.x_k_stride;
    op.w_k = p_.w_k_stride;
  }
  MPS_EXT_INLINE const device T* x_row(int r) const { return x + r * x_row_stride; }
};

// gemv_rows: weight row n of output n, Q of them from the simdgroup's first.
// NORMED (rms_norm_gemv_rows, sigmoid_gate_gemv_rows): the activation rows
// are `normed`, rows of K the kernel staged in threadgroup memory
// (DecodeRowLoads below), not x.
template <typename T, int Q, bool NORMED = false>
struct GemvJob {
  enum { BLOCK_SCALED = 0, BUDGET = 24, TILE_BYTES = NORMED ? RMS_GEMV_TILE_BYTES : DECODE_TILE_BYTES };
  typename GemvInOut<T>::Operands op;
  GemvInOut<T> io;
  const threadgroup T* normed;
  long first;
  MPS_EXT_INLINE const device T* x_row(int r) const { return io.x_row(r); }
  MPS_EXT_INLINE bool live(int q) const { return first + q < io.p->n_out; }
  MPS_EXT_INLINE const device T* w_row(int q) const { return op.w + (live(q) ? (first + q) * io.p->w_n_stride : 0); }
  // Lane i writes output i: stores spread over the simdgroup.
  MPS_EXT_INLINE void store(int r, thread const float* total, uint lane) const {
    MPS_EXT_UNROLL
    for (int q = 0; q < Q; ++q)
      if (lane == uint(r * Q + q) % 32 && live(q)) write_output(io.y, io.bias, *io.p, r, first + q, total[q]);
  }
};

template <typename T, int Q>
struct DecodeRowLoads<GemvJob<T, Q, true>> {
  typedef GemvJob<T, Q, true> Job;
  static MPS_EXT_INLINE uint4 piece(thread const Job& job, int r, int k) {
    return rms_normed_piece(job.normed, job.op.k, r, k);
  }
  template <typename I>
  static MPS_EXT_INLINE float one(thread const Job& job, int r, I k) {
    return rms_normed_one(job.normed, job.op.k, r, int(k));
  }
};

// gemv_cols: the weight's columns; with K split, partial sums.
template <typename T>
struct GemvColsJob {
  typename GemvInOut<T>::Operands op;
  GemvInOut<T> io;
  device float* partials;
  int splits;
  long n, w_n;
  MPS_EXT_INLINE const device T* x_row(int r) const { return io.x_row(r); }
  MPS_EXT_INLINE void store(int r, long n_, float total, uint split) const {
    if (splits == 1) write_output(io.y, io.bias, *io.p, r, n_, total);
    else partials[(long(split) * op.rows + r) * n + n_] = total;
  }
};

// ------------------------------------------------------------ gemv_rows --
template <typename T, int R, int Q, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void gemv_rows(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      uint group [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint threads [[threads_per_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int TILE_WORDS = decode_tile_words<T, T, VEC, false>(R);
  threadgroup uint tile[TILE_WORDS];
  GemvJob<T, Q> job;
  job.io.init(job.op, y, x, w, p, bias);
  job.first = (long(group) * simdgroups + sg) * Q;
  decode_rows<GemvJob<T, Q>, R, Q, VEC>(job, tile, tid, threads, lane);
}

// ---------------------------------------------------- rms_norm_gemv_rows --
// gemv_rows of rms_norm(x): an RMSNorm and the projection that reads it
// (a decoder layer's input norm and its fused q/k/v or in_proj GEMV) in one
// dispatch: the rows normed into threadgroup memory as rms_norm would
// (rms_norm.h, rms_norm_rows_into), then its outputs as gemv_rows from
// those rows; threadgroup 0 also writes them to normed_out. The host takes
// rows * K * sizeof(T) <= RMS_GEMV_NORMED_BYTES and x's rows contiguous.
// ADD (add_rms_norm_gemv_rows): the rows normed are x + residual, rounded
// as add_rms_norm rounds them, which threadgroup 0 writes to sum_out too
// (rms_norm_sums_out): a decoder layer's residual add, its post-attention
// norm and the MoE router's GEMV that reads it (mps_ext::add_rms_norm_moe_layer).
// Without ADD, residual and sum_out are not touched (the host binds x and
// normed_out there).
template <typename T, int R, int Q, bool VEC, bool ADD>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void rms_norm_gemv_rows(device T* y [[buffer(0)]],
                               const device T* x [[buffer(1)]],
                               const device T* w [[buffer(2)]],
                               constant GemvParams& p [[buffer(3)]],
                               const device T* bias [[buffer(4)]],
                               device T* normed_out [[buffer(5)]],
                               const device T* norm_w [[buffer(6)]],
                               constant RmsNormParams& np [[buffer(7)]],
                               const device T* residual [[buffer(8)]],
                               device T* sum_out [[buffer(9)]],
                               uint group [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint threads [[threads_per_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint simdgroups [[simdgroups_per_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint4 normed_mem[RMS_GEMV_NORMED_BYTES / 16];  // uint4: 16-byte aligned for the VEC loads
  threadgroup float sums[RMS_NORM_MAX_THREADS / 32];
  threadgroup T* normed = (threadgroup T*)normed_mem;
  rms_norm_rows_into<T, ADD>(normed, x, residual, norm_w, np, sums, tid, threads, sg, simdgroups, lane);
  rms_norm_rows_out(normed_out, normed, np, group, tid, threads);
  if (ADD) rms_norm_sums_out(sum_out, x, residual, np, group, tid, threads);
  constexpr int TILE_WORDS = decode_tile_words<T, T, VEC, false>(R, RMS_GEMV_TILE_BYTES);
  threadgroup uint tile[TILE_WORDS];
  GemvJob<T, Q, true> job;
  job.io.init(job.op, y, x, w, p, bias);  // (p's x strides are the normed rows': 1 along K)
  job.normed = normed;
  job.first = (long(group) * simdgroups + sg) * Q;
  decode_rows<GemvJob<T, Q, true>, R, Q, VEC>(job, tile, tid, threads, lane);
}

// ------------------------------------------------ sigmoid_gate_gemv_rows --
// gemv_rows of sigmoid_gate(x, gate): an attention layer's output gate and
// its o_proj (Qwen3.5/3.6, Qwen3-Next) in one dispatch. Every threadgroup
// stages the gated rows x * sigmoid(gate) in threadgroup memory, rounded as
// sigmoid_gate rounds them (activations.h, sigmoid_gated: o_proj reads
// them rounded to T), then computes its outputs as gemv_rows from those
// rows: bit for bit sigmoid_gate, then gemv_rows of its output with the
// same variant and geometry. At decode a row is a token's heads * head_dim
// (4096 bytes in bfloat for Qwen3.6), read from the caches after the first
// threadgroup. The host takes rows * K * sizeof(T) <= RMS_GEMV_NORMED_BYTES.
template <typename T>
MPS_EXT_INLINE void sigmoid_gate_rows_into(threadgroup T* gated,
                                           const device T* x,
                                           const device T* gate,
                                           constant GateRowsParams& gp,
                                           uint tid,
                                           uint threads) {
  // The parameters in locals: a constant-buffer member is read again at
  // every use inside the loop (memory to the executor, a load to the GPU).
  const uint n = gp.n, d = gp.head_dim, rows = gp.rows, x_stride = gp.x_row_stride;
  const uint gate_stride = gp.gate_row_stride, head_stride = gp.gate_head_stride;
  // Element i = h * d + j of a row: (h, j) of the first a thread takes and
  // of its step, one division each, then carried (no division an element).
  const uint h0 = tid / d, j0 = tid - h0 * d, step_h = threads / d, step_j = threads - step_h * d;
  for (uint r = 0; r < rows; ++r) {
    const device T* xr = x + r * x_stride;
    const device T* gr = gate + r * gate_stride;
    uint h = h0, j = j0;
    for (uint i = tid; i < n; i += threads) {
      gated[r * n + i] = sigmoid_gated<T>(xr[i], gr[h * head_stride + j]);
      h += step_h, j += step_j;
      if (j >= d) h += 1, j -= d;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the rows complete before any simdgroup reads them
}

template <typename T, int R, int Q, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void sigmoid_gate_gemv_rows(device T* y [[buffer(0)]],
                                   const device T* x [[buffer(1)]],
                                   const device T* w [[buffer(2)]],
                                   constant GemvParams& p [[buffer(3)]],
                                   const device T* bias [[buffer(4)]],
                                   const device T* gate [[buffer(5)]],
                                   constant GateRowsParams& gp [[buffer(6)]],
                                   uint group [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint threads [[threads_per_threadgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint simdgroups [[simdgroups_per_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint4 gated_mem[RMS_GEMV_NORMED_BYTES / 16];  // uint4: 16-byte aligned for the VEC loads
  threadgroup T* gated = (threadgroup T*)gated_mem;
  sigmoid_gate_rows_into(gated, x, gate, gp, tid, threads);
  constexpr int TILE_WORDS = decode_tile_words<T, T, VEC, false>(R, RMS_GEMV_TILE_BYTES);
  threadgroup uint tile[TILE_WORDS];
  GemvJob<T, Q, true> job;
  job.io.init(job.op, y, x, w, p, bias);  // (p's x strides are the gated rows': 1 along K)
  job.normed = gated;
  job.first = (long(group) * simdgroups + sg) * Q;
  decode_rows<GemvJob<T, Q, true>, R, Q, VEC>(job, tile, tid, threads, lane);
}

// ------------------------------------------------------------ gemv_cols --
// Grid: (column blocks, splits of K). partials: [splits, rows, N] floats
// when splits > 1 (then y is written by gemv_cols_finish).
template <typename T, int R, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_COLS_THREADS)]]
kernel void gemv_cols(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      device float* partials [[buffer(5)]],
                      uint2 group [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PARTIAL_WORDS = decode_cols_partial_words();
  threadgroup float4 partial_mem[PARTIAL_WORDS / 4];
  constexpr int B = VEC ? 16 : 0;  // 16-byte pieces: a quarter of the load instructions of 4-byte words
  constexpr int RING_WORDS = decode_cols_ring_words<T, B>(R);
  threadgroup float x_tile[RING_WORDS];
  GemvColsJob<T> job;
  job.io.init(job.op, y, x, w, p, bias);
  job.partials = partials;
  job.splits = int(p.splits);
  job.n = p.n_out;
  job.w_n = p.w_n_stride;
  decode_cols<GemvColsJob<T>, R, B>(job, (threadgroup float*)partial_mem, x_tile, group.x, group.y, tid, sg, lane);
}

// Split K: y from the splits' partial sums, added in split order (the same
// result every run). Grid: (N / DECODE_COLS_THREADS, rows). Bound like
// gemv_cols; x and w are not read.
template <typename T>
[[max_total_threads_per_threadgroup(DECODE_COLS_THREADS)]]
kernel void gemv_cols_finish(device T* y [[buffer(0)]],
                             const device T* x [[buffer(1)]],
                             const device T* w [[buffer(2)]],
                             constant GemvParams& p [[buffer(3)]],
                             const device T* bias [[buffer(4)]],
                             const device float* partials [[buffer(5)]],
                             uint2 group [[threadgroup_position_in_grid]],
                             uint2 tid [[thread_position_in_threadgroup]]) {
  const long n = long(group.x) * DECODE_COLS_THREADS + tid.x, r = group.y;
  if (n >= p.n_out) return;
  float total = 0.0f;
  const long split_stride = p.rows * p.n_out;  // the same for every thread: no 64-bit multiply a split
  const device float* part = partials + r * p.n_out + n;
  for (uint s = 0; s < p.splits; ++s, part += split_stride) total += *part;
  write_output(y, bias, p, r, n, total);
}

// clang-format off
#define INSTANTIATE_GEMV_ROWS(tname, T, R, Q)                                                                   \
  template [[host_name("gemv_rows_" #tname "_r" #R "_q" #Q "_vec")]] kernel                                      \
      decltype(gemv_rows<T, R, Q, true>) gemv_rows<T, R, Q, true>;                                               \
  template [[host_name("gemv_rows_" #tname "_r" #R "_q" #Q "_scalar")]] kernel                                   \
      decltype(gemv_rows<T, R, Q, false>) gemv_rows<T, R, Q, false>;
#define INSTANTIATE_GEMV_COLS(tname, T, R)                                                                      \
  template [[host_name("gemv_cols_" #tname "_r" #R "_vec")]] kernel decltype(gemv_cols<T, R, true>)             \
      gemv_cols<T, R, true>;                                                                                     \
  template [[host_name("gemv_cols_" #tname "_r" #R "_scalar")]] kernel decltype(gemv_cols<T, R, false>)         \
      gemv_cols<T, R, false>;
#define INSTANTIATE_RMS_GEMV_VARIANT(prefix, tname, T, R, Q, VEC, vname, ADD)                                    \
  template [[host_name(prefix "rms_norm_gemv_rows_" #tname "_r" #R "_q" #Q "_" vname)]] kernel                    \
      decltype(rms_norm_gemv_rows<T, R, Q, VEC, ADD>) rms_norm_gemv_rows<T, R, Q, VEC, ADD>;
#define INSTANTIATE_RMS_GEMV_ROWS(tname, T, R, Q)                                                               \
  INSTANTIATE_RMS_GEMV_VARIANT("", tname, T, R, Q, true, "vec", false)                                          \
  INSTANTIATE_RMS_GEMV_VARIANT("", tname, T, R, Q, false, "scalar", false)                                      \
  INSTANTIATE_RMS_GEMV_VARIANT("add_", tname, T, R, Q, true, "vec", true)                                       \
  INSTANTIATE_RMS_GEMV_VARIANT("add_", tname, T, R, Q, false, "scalar", true)                                     \
  template [[host_name("sigmoid_gate_gemv_rows_" #tname "_r" #R "_q" #Q "_vec")]] kernel                         \
      decltype(sigmoid_gate_gemv_rows<T, R, Q, true>) sigmoid_gate_gemv_rows<T, R, Q, true>;                     \
  template [[host_name("sigmoid_gate_gemv_rows_" #tname "_r" #R "_q" #Q "_scalar")]] kernel                      \
      decltype(sigmoid_gate_gemv_rows<T, R, Q, false>) sigmoid_gate_gemv_rows<T, R, Q, false>;
// One output per simdgroup up to 2 rows: decode_geometry gives a
// threadgroup at least `rows` outputs, taken up to a power of two, so 3 to
// 8 rows always have 2 a simdgroup.
#define INSTANTIATE_GEMV(tname, T)                                                                               \
  INSTANTIATE_GEMV_ROWS(tname, T, 1, 1) INSTANTIATE_GEMV_ROWS(tname, T, 2, 1)                                   \
  INSTANTIATE_GEMV_ROWS(tname, T, 1, 2) INSTANTIATE_GEMV_ROWS(tname, T, 2, 2)                                   \
  INSTANTIATE_GEMV_ROWS(tname, T, 4, 2) INSTANTIATE_GEMV_ROWS(tname, T, 8, 2)                                   \
  INSTANTIATE_RMS_GEMV_ROWS(tname, T, 1, 1) INSTANTIATE_RMS_GEMV_ROWS(tname, T, 2, 1)                           \
  INSTANTIATE_RMS_GEMV_ROWS(tname, T, 1, 2) INSTANTIATE_RMS_GEMV_ROWS(tname, T, 2, 2)                           \
  INSTANTIATE_RMS_GEMV_ROWS(tname, T, 4, 2) INSTANTIATE_RMS_GEMV_ROWS(tname, T, 8, 2)                           \
  INSTANTIATE_GEMV_COLS(tname, T, 1) INSTANTIATE_GEMV_COLS(tname, T, 2)                                         \
  INSTANTIATE_GEMV_COLS(tname, T, 4) INSTANTIATE_GEMV_COLS(tname, T, 8)                                         \
  template [[host_name("gemv_cols_finish_" #tname)]] kernel decltype(gemv_cols_finish<T>) gemv_cols_finish<T>;
// clang-format on

INSTANTIATE_GEMV(f32, float)
INSTANTIATE_GEMV(f16, half)
INSTANTIATE_GEMV(bf16, bfloat)
