// softmax, log_softmax and their backward passes over one dimension of a
// tensor of any rank and strides, accumulating in float.
//
// Four shapes of work, chosen on the host (csrc/ops/softmax.cpp):
//  segment  rows of up to 128 elements (256 in the 16-bit vector variants):
//           2^lanes_shift lanes of a simdgroup share a row, so one
//           threadgroup packs many rows;
//  block    rows of up to 8192 elements: one threadgroup per row;
//  strided  a softmax dimension that is not contiguous while the last
//           dimension is (dim 1 of [32, 1024, 16]): lanes walk the
//           contiguous dimension, so one load instruction reads consecutive
//           addresses, and a threadgroup owns several rows;
//  split    longer rows: a row is cut into chunks, one threadgroup each.
//           partial_* writes each chunk's partial reduction, finish_*
//           combines a row's partials and writes the chunk: two dispatches,
//           and a long decode-time row spreads over the whole GPU.
// Each thread keeps its elements in registers between the reductions and the
// write, so segment, block and strided read the input once; split reads it
// twice (the second time a chunk another threadgroup read just before, so
// likely from the system-level cache). Reading once would need every chunk
// of a row to wait for the row's total: a grid-wide barrier, which Metal does
// not offer (threadgroups of one dispatch are not guaranteed to run at the
// same time, so one spinning on another may never finish).
//
// Forward: the row's max first, then one exp per element (exp(x - max),
// kept for the write), then the sum; split rows take one more exp per
// element in finish_*. Special values come out as torch's: a NaN anywhere or
// a +inf makes the row NaN; a row of -inf gives 0 / 0 = NaN; -inf elements of
// a finite row give 0.
//
// Variants: I is the index type, uint when every offset fits in 31 bits
// (the host checks), ulong beyond: 64-bit integer division is a software
// loop on Apple GPUs, and every thread divides to find its row. VEC: a
// thread's elements in pieces of 16 bytes of the wider of the input and
// output types (8 bytes of the narrower: fp16 in, fp32 out and back), so
// that each load and store instruction of a simdgroup covers consecutive
// memory; when the row is contiguous and every row start is 16-byte aligned
// (the host checks the pointers and strides); 32-bit only.
#include <metal_stdlib>
#include "pieces.h"
#include "softmax_params.h"
using namespace metal;

// ------------------------------------------------------------- indexing --
template <typename I>
struct RowOffsets {
  I x, y, out;
};

// Where row `row` starts in each tensor, from the first `dims` row
// dimensions. The outermost coordinate is what remains: no division.
template <typename I>
MPS_EXT_INLINE RowOffsets<I> row_offsets(constant SoftmaxParams& p, I row, int dims) {
  RowOffsets<I> o = {0, 0, 0};
  for (int d = dims - 1; d >= 0; --d) {
    I c = row;
    if (d > 0) {
      const I size = I(p.row_sizes[d]);
      c = row % size;
      row /= size;
    }
    o.x += c * I(p.x_strides[d]);
    o.y += c * I(p.y_strides[d]);
    o.out += c * I(p.out_strides[d]);
  }
  return o;
}

// The elements a thread holds: J pieces of C consecutive elements (C > 1 in
// the vector variants), piece j starting at element (first + j * step) * C.
template <typename I, int J, int C>
struct Slots {
  I first, step;
  MPS_EXT_INLINE I at(int j) const { return (first + I(j) * step) * I(C); }
};

// N elements of T at p (16 or 8 bytes, aligned to their size) as floats.
template <int N, typename T>
MPS_EXT_INLINE void load_n(const device T* p, thread float* v) {
  constexpr int WORDS = N * int(sizeof(T)) / 4, PER_WORD = 4 / int(sizeof(T));
  if (WORDS == 4) {
    unpack16(*(const device uint4*)p, v, T(0));
  } else {
    const uint2 bits = *(const device uint2*)p;
    MPS_EXT_UNROLL
    for (int i = 0; i < 2; ++i) word_floats(bits[i], v + i * PER_WORD, T(0));
  }
}

// N (4 or 8) values as O at p, aligned to their size: 16 or 32 bytes of
// float (one or two pieces), 8 or 16 bytes of half / bfloat.
template <int N>
MPS_EXT_INLINE void store_n(device float* p, thread const float* v) {
  MPS_EXT_UNROLL
  for (int i = 0; i < N; i += 4) *(device uint4*)(p + i) = pack16<4>(v + i, 0.0f);
}
template <int N, typename H>
MPS_EXT_INLINE void store_n_pairs(device H* p, thread const float* v) {
  const uint4 bits = pack16<N>(v, H(0));
  if (N == 8) *(device uint4*)p = bits;
  else *(device uint2*)p = bits.xy;
}
template <int N>
MPS_EXT_INLINE void store_n(device half* p, thread const float* v) {
  store_n_pairs<N>(p, v);
}
template <int N>
MPS_EXT_INLINE void store_n(device bfloat* p, thread const float* v) {
  store_n_pairs<N>(p, v);
}

// Piece k of the row starting at `base` (length n, elements `stride` apart;
// in the vector variants the host checked it is 1) as C floats, `fill`
// where the row has none (or the thread has no row).
template <typename T, typename I, int C>
MPS_EXT_INLINE void load_piece(thread float* v, const device T* base, I stride, I k, I n, bool valid, float fill) {
  if (C > 1 && valid && k + C <= n) {
    load_n<C>(base + k, v);
  } else {
    MPS_EXT_UNROLL
    for (int e = 0; e < C; ++e) v[e] = valid && k + e < n ? float(base[C > 1 ? k + e : k * stride]) : fill;
  }
}

// A thread's elements of a row.
template <typename T, typename I, int J, int C>
MPS_EXT_INLINE void load_row(
    thread float* v, const device T* base, I stride, I n, Slots<I, J, C> s, bool valid, float fill) {
  MPS_EXT_UNROLL
  for (int j = 0; j < J; ++j) load_piece<T, I, C>(v + j * C, base, stride, s.at(j), n, valid, fill);
}

// ... of the same row of two tensors (backward: the gradient and the
// forward's output), a piece of each in turn: a piece's offset and checks
// serve both loads and end there (loading one row after the other keeps J
// of them live in between).
template <typename T, typename I, int J, int C>
MPS_EXT_INLINE void load_rows(thread float* a,
                              const device T* a_base,
                              I a_stride,
                              thread float* b,
                              const device T* b_base,
                              I b_stride,
                              I n,
                              Slots<I, J, C> s,
                              bool valid,
                              float fill) {
  MPS_EXT_UNROLL
  for (int j = 0; j < J; ++j) {
    const I k = s.at(j);
    load_piece<T, I, C>(a + j * C, a_base, a_stride, k, n, valid, fill);
    load_piece<T, I, C>(b + j * C, b_base, b_stride, k, n, valid, fill);
  }
}

// ... and back. Which of the thread's pieces exist is counted here, once,
// rather than checked per piece as the loads do: nothing of the loads'
// per-piece offsets and checks is reused, so a compiler need not keep J of
// each live from the loads, across the reductions, to the stores. Piece j
// (element (first + j * step) * C) is whole for j < full; the row's last
// C - 1 elements or fewer, if any, are piece `part`.
template <typename O, typename I, int J, int C>
MPS_EXT_INLINE void store_row(device O* base, I stride, I n, thread const float* v, Slots<I, J, C> s, bool valid) {
  if (!valid) return;
  const I whole = n / I(C), rest = n % I(C);  // whole pieces of the row, elements after them
  I full = 0, part = I(J);
  if (s.first <= whole) {
    const I d = whole - s.first, q = d / s.step, r = d - q * s.step;
    full = r != 0 ? q + 1 : q;
    if (rest != 0 && r == 0) part = q;
  }
  device O* at = base + s.first * I(C) * stride;
  const I jump = s.step * I(C) * stride;
  MPS_EXT_UNROLL
  for (int j = 0; j < J; ++j, at += jump) {
    if (I(j) < full) {
      if (C > 1) store_n<C>(at, v + j * C);
      else *at = O(v[j]);
    } else if (I(j) == part) {
      MPS_EXT_UNROLL
      for (int e = 0; e < C; ++e)
        if (I(e) < rest) at[e] = O(v[j * C + e]);
    }
  }
}

// ------------------------------------------------------------ reductions --
// max that keeps a NaN (Metal's max and simd_max return the other operand).
MPS_EXT_INLINE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// exp(a - m), where an -inf element contributes 0 even if the max is -inf (a
// chunk of -inf in a split row must add 0, not NaN, to the row's sum).
MPS_EXT_INLINE float exp_from(float a, float m) { return a == -INFINITY ? 0.0f : precise::exp(a - m); }

MPS_EXT_INLINE float lanes_max(float v, uint from_offset) {
  for (ushort offset = ushort(from_offset); offset < 32; offset *= 2) v = nan_max(v, simd_shuffle_xor(v, offset));
  return v;
}
MPS_EXT_INLINE float lanes_sum(float v, uint from_offset) {
  for (ushort offset = ushort(from_offset); offset < 32; offset *= 2) v += simd_shuffle_xor(v, offset);
  return v;
}

// Rows shared by 2^k consecutive lanes of a simdgroup (segment): shuffles
// over those lanes, every lane gets the result.
struct LanesReduce {
  uint lanes;
  MPS_EXT_INLINE float reduce_max(float v) const {
    for (ushort offset = ushort(lanes / 2); offset > 0; offset /= 2) v = nan_max(v, simd_shuffle_xor(v, offset));
    return v;
  }
  MPS_EXT_INLINE float reduce_sum(float v) const {
    for (ushort offset = ushort(lanes / 2); offset > 0; offset /= 2) v += simd_shuffle_xor(v, offset);
    return v;
  }
};

// Rows owned by threads whose index differs in the bits from `spread` up
// (every thread of a block; the threads of one inner row in strided): shuffles
// across the simdgroup's lanes from offset `spread`, then one value per
// simdgroup and row through threadgroup memory, which every thread reads back.
// `scratch` holds simdgroups x spread floats per reduction; a reduction has
// its own scratch, so no barrier is needed before the next one.
struct GroupReduce {
  threadgroup float* scratch_max;
  threadgroup float* scratch_sum;
  uint spread;  // 1 (block) or the strided rows per threadgroup, <= 32
  uint lane, sg, simdgroups;
  MPS_EXT_INLINE float publish_then_fold(float v, threadgroup float* scratch, bool is_max) const {
    // Lanes [0, spread) of each simdgroup hold its values, one per row:
    // consecutive words, read back by lanes of one row from one address.
    const uint row = lane & (spread - 1);
    if (lane < spread) scratch[sg * spread + row] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = is_max ? -INFINITY : 0.0f;
    for (uint s = 0; s < simdgroups; ++s) {
      const float w = scratch[s * spread + row];
      total = is_max ? nan_max(total, w) : total + w;
    }
    return total;
  }
  MPS_EXT_INLINE float reduce_max(float v) const { return publish_then_fold(lanes_max(v, spread), scratch_max, true); }
  MPS_EXT_INLINE float reduce_sum(float v) const { return publish_then_fold(lanes_sum(v, spread), scratch_sum, false); }
};

// ------------------------------------------------------------ row bodies --
// The forward pass over the elements a thread holds: max, one exp per
// element, sum, write.
template <typename T, typename O, typename I, int J, int C, typename Reduce>
MPS_EXT_INLINE void forward_row(device O* out,
                                const device T* x,
                                constant SoftmaxParams& p,
                                RowOffsets<I> o,
                                Slots<I, J, C> s,
                                bool valid,
                                Reduce r) {
  const I n = I(p.row_length);
  float v[J * C];
  load_row(v, x + o.x, I(p.x_dim_stride), n, s, valid, -INFINITY);
  float m = -INFINITY;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) m = nan_max(m, v[i]);
  m = r.reduce_max(m);
  float sum = 0.0f;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) {
    const float e = exp_from(v[i], m);
    sum += e;
    if (!p.log) v[i] = e;
  }
  sum = r.reduce_sum(sum);
  const float log_sum = precise::log(sum);
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) v[i] = p.log ? v[i] - m - log_sum : v[i] / sum;
  store_row(out + o.out, I(p.out_dim_stride), n, v, s, valid);
}

// grad_input of softmax: y * (g - sum(g * y)); of log_softmax: g - exp(y) * sum(g).
MPS_EXT_INLINE float backward_term(float g, float y, bool log) { return log ? g : g * y; }
MPS_EXT_INLINE float backward_value(float g, float y, float sum, bool log) {
  return log ? g - precise::exp(y) * sum : y * (g - sum);
}

template <typename G, typename O, typename I, int J, int C, typename Reduce>
MPS_EXT_INLINE void backward_row(device O* out,
                                 const device G* g,
                                 const device G* y,
                                 constant SoftmaxParams& p,
                                 RowOffsets<I> o,
                                 Slots<I, J, C> s,
                                 bool valid,
                                 Reduce r) {
  const I n = I(p.row_length);
  float gv[J * C], yv[J * C];
  load_rows(gv, g + o.x, I(p.x_dim_stride), yv, y + o.y, I(p.y_dim_stride), n, s, valid, 0.0f);
  float sum = 0.0f;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) sum += backward_term(gv[i], yv[i], p.log);
  sum = r.reduce_sum(sum);
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) gv[i] = backward_value(gv[i], yv[i], sum, p.log);
  store_row(out + o.out, I(p.out_dim_stride), n, gv, s, valid);
}

// Pieces of C elements: in the vector variants 16 bytes of the wider of the
// input type T and the output type O.
#define PIECE(T, O, VEC) ((VEC) ? int(16 / (sizeof(T) > sizeof(O) ? sizeof(T) : sizeof(O))) : 1)
// Pieces a thread holds to have `elements` elements (at least one).
#define PIECES(elements, T, O, VEC) ((elements) / PIECE(T, O, VEC) > 0 ? (elements) / PIECE(T, O, VEC) : 1)

// ---------------------------------------------------------------- shapes --
// Where the rows of a segment threadgroup are, and the thread's lane in its row.
template <typename I>
struct SegmentRow {
  I row;
  uint lane, lanes;
  bool valid;
  RowOffsets<I> o;
};
template <typename I>
MPS_EXT_INLINE SegmentRow<I> segment_row(constant SoftmaxParams& p, uint tid, uint group) {
  SegmentRow<I> r;
  r.lanes = 1u << p.lanes_shift;
  r.row = I(group) * I(SOFTMAX_SEGMENT_THREADS >> p.lanes_shift) + I(tid >> p.lanes_shift);
  r.lane = tid & (r.lanes - 1);
  r.valid = r.row < I(p.rows);  // idle lanes still join the shuffles
  r.o = r.valid ? row_offsets<I>(p, r.row, int(p.rank)) : RowOffsets<I>{0, 0, 0};
  return r;
}

// Where a strided threadgroup's rows are: its inner row, its outer row, and
// the thread's place in the row. Every thread of a row reaches the barriers.
template <typename I>
struct StridedRow {
  bool valid;
  RowOffsets<I> o;
  I first, step;
};
template <typename I>
MPS_EXT_INLINE StridedRow<I> strided_row(constant SoftmaxParams& p, uint tid, uint threads, uint2 group) {
  const int last = int(p.rank) - 1;
  const uint rows_here = 1u << p.lanes_shift;
  const I inner = I(group.x) * I(rows_here) + I(tid & (rows_here - 1));
  StridedRow<I> r;
  r.valid = inner < I(p.row_sizes[last]);
  r.o = row_offsets<I>(p, I(group.y), last);  // the last row dimension has stride 1 everywhere
  r.o.x += inner;
  r.o.y += inner;
  r.o.out += inner;
  r.first = I(tid >> p.lanes_shift);
  r.step = I(threads >> p.lanes_shift);
  return r;
}

// --------------------------------------------------------------- forward --
template <typename T, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SEGMENT_THREADS)]]
kernel void softmax_segment(device O* out [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            constant SoftmaxParams& p [[buffer(2)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint group [[threadgroup_position_in_grid]]) {
  constexpr int C = PIECE(T, O, VEC);
  const SegmentRow<I> r = segment_row<I>(p, tid, group);
  forward_row(out, x, p, r.o, Slots<I, PIECES(SOFTMAX_SEGMENT_ELEMENTS, T, O, VEC), C>{I(r.lane), I(r.lanes)}, r.valid,
              LanesReduce{r.lanes});
}

template <typename T, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_BLOCK_MAX_THREADS)]]
kernel void softmax_block(device O* out [[buffer(0)]],
                          const device T* x [[buffer(1)]],
                          constant SoftmaxParams& p [[buffer(2)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint threads [[threads_per_threadgroup]],
                          uint row [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_BLOCK_MAX_THREADS / 32];
  constexpr int C = PIECE(T, O, VEC);
  forward_row(out, x, p, row_offsets<I>(p, I(row), int(p.rank)),
              Slots<I, PIECES(SOFTMAX_BLOCK_ELEMENTS, T, O, VEC), C>{I(tid), I(threads)}, true,
              GroupReduce{scratch[0], scratch[1], 1, lane, sg, simdgroups});
}

// Strided rows run on a 2-D grid (inner rows / 2^lanes_shift, outer rows) of
// 1-D threadgroups. Metal wants every position and size attribute of a
// kernel with the same number of components, so the threadgroup size comes
// as uint2 too.
template <typename T, typename O, typename I>
[[max_total_threads_per_threadgroup(SOFTMAX_STRIDED_MAX_THREADS)]]
kernel void softmax_strided(device O* out [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            constant SoftmaxParams& p [[buffer(2)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 group_size [[threads_per_threadgroup]],
                            uint2 group [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_STRIDED_MAX_THREADS];
  const StridedRow<I> r = strided_row<I>(p, tid, group_size.x, group);
  forward_row(out, x, p, r.o, Slots<I, SOFTMAX_STRIDED_ELEMENTS, 1>{r.first, r.step}, r.valid,
              GroupReduce{scratch[0], scratch[1], 1u << p.lanes_shift, lane, sg, simdgroups});
}

// Split rows run on a 2-D grid (chunk, row) of 1-D threadgroups, each thread
// holding SOFTMAX_SPLIT_CHUNK / SOFTMAX_SPLIT_THREADS elements of its chunk.
#define SPLIT_ELEMENTS (SOFTMAX_SPLIT_CHUNK / SOFTMAX_SPLIT_THREADS)

template <typename I, int J, int C>
MPS_EXT_INLINE Slots<I, J, C> split_slots(uint chunk, uint tid) {
  return Slots<I, J, C>{I(chunk) * I(SOFTMAX_SPLIT_CHUNK / C) + I(tid), I(SOFTMAX_SPLIT_THREADS)};
}

// Split rows, pass 1: the (max, sum of exp(x - max)) of each chunk.
template <typename T, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_partial(device float2* partials [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            constant SoftmaxParams& p [[buffer(2)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 group [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_SPLIT_THREADS / 32];
  constexpr int C = PIECE(T, T, VEC);
  constexpr int J = PIECES(SPLIT_ELEMENTS, T, T, VEC);
  const GroupReduce r{scratch[0], scratch[1], 1, lane, sg, simdgroups};
  const RowOffsets<I> o = row_offsets<I>(p, I(group.y), int(p.rank));
  float v[J * C];
  load_row(v, x + o.x, I(p.x_dim_stride), I(p.row_length), split_slots<I, J, C>(group.x, tid), true, -INFINITY);
  float m = -INFINITY;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) m = nan_max(m, v[i]);
  m = r.reduce_max(m);
  float sum = 0.0f;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) sum += exp_from(v[i], m);
  sum = r.reduce_sum(sum);
  if (tid == 0) partials[I(group.y) * I(p.partials_stride) + I(group.x)] = float2(m, sum);
}

// Split rows, pass 2: combine the row's partials (the row's max, then the
// chunks' sums rescaled to it) and write the chunk.
template <typename T, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_finish(device O* out [[buffer(0)]],
                           const device T* x [[buffer(1)]],
                           constant SoftmaxParams& p [[buffer(2)]],
                           const device float2* partials [[buffer(3)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint2 group [[threadgroup_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_SPLIT_THREADS / 32];
  constexpr int C = PIECE(T, O, VEC);
  constexpr int J = PIECES(SPLIT_ELEMENTS, T, O, VEC);
  const GroupReduce r{scratch[0], scratch[1], 1, lane, sg, simdgroups};
  // Each partial is read once: a thread merges its chunks' (max, sum), then
  // the threadgroup takes the row's max and the sums rescaled to it.
  const device float2* row_partials = partials + I(group.y) * I(p.partials_stride);
  float m_t = -INFINITY, s_t = 0.0f;
  for (uint c = tid; c < uint(p.chunks); c += SOFTMAX_SPLIT_THREADS) {
    const float2 q = row_partials[c];
    const float m_new = nan_max(m_t, q.x);
    s_t = s_t * exp_from(m_t, m_new) + q.y * exp_from(q.x, m_new);
    m_t = m_new;
  }
  const float m = r.reduce_max(m_t);
  const float sum = r.reduce_sum(s_t * exp_from(m_t, m));

  const RowOffsets<I> o = row_offsets<I>(p, I(group.y), int(p.rank));
  const Slots<I, J, C> s = split_slots<I, J, C>(group.x, tid);
  const I n = I(p.row_length);
  float v[J * C];
  load_row(v, x + o.x, I(p.x_dim_stride), n, s, true, -INFINITY);
  const float log_sum = precise::log(sum);
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) v[i] = p.log ? v[i] - m - log_sum : exp_from(v[i], m) / sum;
  store_row(out + o.out, I(p.out_dim_stride), n, v, s, true);
}

// -------------------------------------------------------------- backward --
// g: grad_output, y: the forward output (same dtype G); out: grad_input.
template <typename G, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SEGMENT_THREADS)]]
kernel void softmax_backward_segment(device O* out [[buffer(0)]],
                                     const device G* g [[buffer(1)]],
                                     constant SoftmaxParams& p [[buffer(2)]],
                                     const device G* y [[buffer(3)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint group [[threadgroup_position_in_grid]]) {
  constexpr int C = PIECE(G, O, VEC);
  const SegmentRow<I> r = segment_row<I>(p, tid, group);
  backward_row(out, g, y, p, r.o, Slots<I, PIECES(SOFTMAX_SEGMENT_ELEMENTS, G, O, VEC), C>{I(r.lane), I(r.lanes)},
               r.valid, LanesReduce{r.lanes});
}

template <typename G, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_BLOCK_MAX_THREADS)]]
kernel void softmax_backward_block(device O* out [[buffer(0)]],
                                   const device G* g [[buffer(1)]],
                                   constant SoftmaxParams& p [[buffer(2)]],
                                   const device G* y [[buffer(3)]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint threads [[threads_per_threadgroup]],
                                   uint row [[threadgroup_position_in_grid]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_BLOCK_MAX_THREADS / 32];
  constexpr int C = PIECE(G, O, VEC);
  backward_row(out, g, y, p, row_offsets<I>(p, I(row), int(p.rank)),
               Slots<I, PIECES(SOFTMAX_BLOCK_ELEMENTS, G, O, VEC), C>{I(tid), I(threads)}, true,
               GroupReduce{scratch[0], scratch[1], 1, lane, sg, simdgroups});
}

template <typename G, typename O, typename I>
[[max_total_threads_per_threadgroup(SOFTMAX_STRIDED_MAX_THREADS)]]
kernel void softmax_backward_strided(device O* out [[buffer(0)]],
                                     const device G* g [[buffer(1)]],
                                     constant SoftmaxParams& p [[buffer(2)]],
                                     const device G* y [[buffer(3)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint2 group_size [[threads_per_threadgroup]],
                                     uint2 group [[threadgroup_position_in_grid]],
                                     uint lane [[thread_index_in_simdgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_STRIDED_MAX_THREADS];
  const StridedRow<I> r = strided_row<I>(p, tid, group_size.x, group);
  backward_row(out, g, y, p, r.o, Slots<I, SOFTMAX_STRIDED_BACKWARD_ELEMENTS, 1>{r.first, r.step}, r.valid,
               GroupReduce{scratch[0], scratch[1], 1u << p.lanes_shift, lane, sg, simdgroups});
}

template <typename G, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_backward_partial(device float* partials [[buffer(0)]],
                                     const device G* g [[buffer(1)]],
                                     constant SoftmaxParams& p [[buffer(2)]],
                                     const device G* y [[buffer(3)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint2 group [[threadgroup_position_in_grid]],
                                     uint lane [[thread_index_in_simdgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_SPLIT_THREADS / 32];
  constexpr int C = PIECE(G, G, VEC);
  constexpr int J = PIECES(SPLIT_ELEMENTS, G, G, VEC);
  const GroupReduce r{scratch[0], scratch[1], 1, lane, sg, simdgroups};
  const RowOffsets<I> o = row_offsets<I>(p, I(group.y), int(p.rank));
  const Slots<I, J, C> s = split_slots<I, J, C>(group.x, tid);
  const I n = I(p.row_length);
  float gv[J * C], yv[J * C];
  load_rows(gv, g + o.x, I(p.x_dim_stride), yv, y + o.y, I(p.y_dim_stride), n, s, true, 0.0f);
  float sum = 0.0f;
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) sum += backward_term(gv[i], yv[i], p.log);
  sum = r.reduce_sum(sum);
  if (tid == 0) partials[I(group.y) * I(p.partials_stride) + I(group.x)] = sum;
}

template <typename G, typename O, typename I, bool VEC>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_backward_finish(device O* out [[buffer(0)]],
                                    const device G* g [[buffer(1)]],
                                    constant SoftmaxParams& p [[buffer(2)]],
                                    const device G* y [[buffer(3)]],
                                    const device float* partials [[buffer(4)]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint2 group [[threadgroup_position_in_grid]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[2][SOFTMAX_SPLIT_THREADS / 32];
  constexpr int C = PIECE(G, O, VEC);
  constexpr int J = PIECES(SPLIT_ELEMENTS, G, O, VEC);
  const GroupReduce r{scratch[0], scratch[1], 1, lane, sg, simdgroups};
  const device float* row_partials = partials + I(group.y) * I(p.partials_stride);
  float sum = 0.0f;
  for (uint c = tid; c < uint(p.chunks); c += SOFTMAX_SPLIT_THREADS) sum += row_partials[c];
  sum = r.reduce_sum(sum);
  const RowOffsets<I> o = row_offsets<I>(p, I(group.y), int(p.rank));
  const Slots<I, J, C> s = split_slots<I, J, C>(group.x, tid);
  const I n = I(p.row_length);
  float gv[J * C], yv[J * C];
  load_rows(gv, g + o.x, I(p.x_dim_stride), yv, y + o.y, I(p.y_dim_stride), n, s, true, 0.0f);
  MPS_EXT_UNROLL
  for (int i = 0; i < J * C; ++i) gv[i] = backward_value(gv[i], yv[i], sum, p.log);
  store_row(out + o.out, I(p.out_dim_stride), n, gv, s, true);
}

// ------------------------------------------------------- instantiations --
// Every shape in three variants: 32-bit indices with 16-byte accesses
// (_i32_vec), 32-bit with element accesses (_i32), 64-bit with element
// accesses (_i64); strided has no vector variant (its rows are not
// contiguous). Forward: input -> output dtype (same, or half -> float for
// half_to_float).
// clang-format off
#define INSTANTIATE_VARIANTS(kernel_name, prefix, ...)                                                         \
  template [[host_name(prefix "_i32_vec")]] kernel decltype(kernel_name<__VA_ARGS__, uint, true>)              \
      kernel_name<__VA_ARGS__, uint, true>;                                                                     \
  template [[host_name(prefix "_i32")]] kernel decltype(kernel_name<__VA_ARGS__, uint, false>)                 \
      kernel_name<__VA_ARGS__, uint, false>;                                                                    \
  template [[host_name(prefix "_i64")]] kernel decltype(kernel_name<__VA_ARGS__, ulong, false>)                \
      kernel_name<__VA_ARGS__, ulong, false>;
#define INSTANTIATE_STRIDED(kernel_name, prefix, ...)                                                          \
  template [[host_name(prefix "_i32")]] kernel decltype(kernel_name<__VA_ARGS__, uint>) kernel_name<__VA_ARGS__, uint>; \
  template [[host_name(prefix "_i64")]] kernel decltype(kernel_name<__VA_ARGS__, ulong>)                       \
      kernel_name<__VA_ARGS__, ulong>;
// clang-format on

#define INSTANTIATE_FORWARD(in_name, T, out_name, O)                                     \
  INSTANTIATE_VARIANTS(softmax_segment, "softmax_segment_" #in_name "_" #out_name, T, O) \
  INSTANTIATE_VARIANTS(softmax_block, "softmax_block_" #in_name "_" #out_name, T, O)     \
  INSTANTIATE_VARIANTS(softmax_finish, "softmax_finish_" #in_name "_" #out_name, T, O)   \
  INSTANTIATE_STRIDED(softmax_strided, "softmax_strided_" #in_name "_" #out_name, T, O)
INSTANTIATE_FORWARD(f32, float, f32, float)
INSTANTIATE_FORWARD(f16, half, f16, half)
INSTANTIATE_FORWARD(bf16, bfloat, bf16, bfloat)
INSTANTIATE_FORWARD(f16, half, f32, float)
INSTANTIATE_VARIANTS(softmax_partial, "softmax_partial_f32", float)
INSTANTIATE_VARIANTS(softmax_partial, "softmax_partial_f16", half)
INSTANTIATE_VARIANTS(softmax_partial, "softmax_partial_bf16", bfloat)

// Backward: grad dtype -> grad_input dtype (same, or float -> half after a
// half_to_float forward).
#define INSTANTIATE_BACKWARD(g_name, G, out_name, O)                                                      \
  INSTANTIATE_VARIANTS(softmax_backward_segment, "softmax_backward_segment_" #g_name "_" #out_name, G, O) \
  INSTANTIATE_VARIANTS(softmax_backward_block, "softmax_backward_block_" #g_name "_" #out_name, G, O)     \
  INSTANTIATE_VARIANTS(softmax_backward_finish, "softmax_backward_finish_" #g_name "_" #out_name, G, O)   \
  INSTANTIATE_STRIDED(softmax_backward_strided, "softmax_backward_strided_" #g_name "_" #out_name, G, O)
INSTANTIATE_BACKWARD(f32, float, f32, float)
INSTANTIATE_BACKWARD(f16, half, f16, half)
INSTANTIATE_BACKWARD(bf16, bfloat, bf16, bfloat)
INSTANTIATE_BACKWARD(f32, float, f16, half)
INSTANTIATE_VARIANTS(softmax_backward_partial, "softmax_backward_partial_f32", float)
INSTANTIATE_VARIANTS(softmax_backward_partial, "softmax_backward_partial_f16", half)
INSTANTIATE_VARIANTS(softmax_backward_partial, "softmax_backward_partial_bf16", bfloat)
