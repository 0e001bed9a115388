// constant_pad_nd: one dispatch; shapes, strides and pads arrive in
// PadParams, so nothing depends on the shape but the launch size.
//
// Each simdgroup fills one segment of an output row: PAD_SEGMENT_BYTES,
// starting at a 128-byte line in memory (so a row's first and last segments
// may stick out of it). The lanes stage the segment in threadgroup memory, then
// each writes its own 16 consecutive bytes with one vector store. Staging:
// the segment's input elements with loads of 32 consecutive elements a
// lane apiece, each load instruction aligned to its 32 elements' size in
// memory when the input row is contiguous (so it never straddles a cache
// line), then the fill value where the segment has no input. Without the
// staging, either the loads would stride 16 bytes between lanes or 1- and
// 2-byte elements would be stored one at a time per lane.
#include <metal_stdlib>
#include "pad_params.h"
using namespace metal;

// Element e of the V elements of E in 16 bytes.
template <typename E>
MPS_EXT_INLINE E element_of(uint4 bits, int e) {
  if (sizeof(E) == 8) return E(ulong(bits[2 * e]) | (ulong(bits[2 * e + 1]) << 32));
  constexpr int PER_WORD = sizeof(E) < 4 ? 4 / sizeof(E) : 1;  // elements of a 32-bit word
  return E(bits[e / PER_WORD] >> (e % PER_WORD * 8 * sizeof(E)));
}

// E is an unsigned integer of the element's size (a pad only moves bits);
// I the signed index type: int when every offset fits in 31 bits, long
// beyond. Row and segment numbers are 32-bit either way (the host checks),
// so no thread divides 64-bit integers.
template <typename E, typename I>
[[max_total_threads_per_threadgroup(PAD_THREADS)]]
kernel void constant_pad(device E* out [[buffer(0)]],
                         const device E* in [[buffer(1)]],
                         constant PadParams& p [[buffer(2)]],
                         uint group [[threadgroup_position_in_grid]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  constexpr int V = 16 / sizeof(E);  // elements a lane stores
  threadgroup uint4 stage[PAD_THREADS / 32][32];
  const uint task = group * (PAD_THREADS / 32) + sg;
  if (task >= p.tasks) return;  // whole simdgroups leave together
  const uint row = task / p.segments_per_row;
  const uint segment = task - row * p.segments_per_row;
  const int last = int(p.rank) - 1;
  const I width = I(p.out_sizes[last]);

  // Where the row starts in the input, and whether it is inside it at all:
  // the row's coordinates, innermost first (the outermost needs no division).
  bool row_inside = true;
  I in_row = 0;
  uint rest = row;
  for (int d = last - 1; d >= 0; --d) {
    uint size = uint(p.out_sizes[d]);
    uint c = d == 0 ? rest : rest % size;
    rest /= size;
    I ci = I(c) - I(p.pad_before[d]);
    row_inside = row_inside && ci >= 0 && ci < I(p.in_sizes[d]);
    if (row_inside) in_row += ci * I(p.in_strides[d]);
  }

  // Element 0 of the segment is `head` elements before the row's first
  // element in the first segment, so that segments start at a cache line
  // (128 bytes: each vector store instruction of the row's interior covers
  // whole lines).
  const I row_start = I(row) * width;
  const I head = row_start & I(128 / sizeof(E) - 1);
  const I seg_first = I(segment) * (32 * V) - head;  // row coordinate of element 0
  const I pad_inner = I(p.pad_before[last]);
  const I in_inner = I(p.in_sizes[last]);
  const I in_stride = I(p.in_strides[last]);
  threadgroup E* staged = (threadgroup E*)stage[sg];
  // The segment's input elements: row coordinates [lo, hi) of the row, input
  // coordinates [lo - pad_inner, hi - pad_inner).
  const I lo = max(seg_first, max(pad_inner, I(0)));
  const I hi = min(seg_first + 32 * V, min(pad_inner + in_inner, width));
  if (row_inside && lo < hi) {
    // Windows of 32 elements from c0, aligned in memory where the row is
    // contiguous: V + 1 of them cover the segment's 32 V elements. A window
    // inside [lo, hi) needs no check per lane; the first and the last
    // partial one do.
    I c0 = lo - pad_inner;
    if (in_stride == 1) c0 -= (in_row + c0) & 31;
    for (int e = 0; e <= V; ++e) {
      const I w_first = c0 + e * 32 + pad_inner;  // the window's first element, in row coordinates
      if (w_first >= hi) break;
      const I ci = c0 + e * 32 + I(lane), w = ci + pad_inner;
      if (w_first >= lo && w_first + 32 <= hi) {
        staged[w - seg_first] = in[in_row + ci * in_stride];
      } else if (e == 0) {
        if (w >= lo && w < hi) staged[w - seg_first] = in[in_row + ci * in_stride];
      } else if (w < hi) {
        staged[w - seg_first] = in[in_row + ci * in_stride];
      }
    }
  }
  const E fill = E(p.fill_bits);
  for (int e = 0; e < V; ++e) {
    const I w = seg_first + e * 32 + I(lane);
    if (w >= 0 && w < width && (w < lo || w >= hi || !row_inside)) staged[e * 32 + int(lane)] = fill;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  // Every lane reads its own 16 bytes (consecutive: no bank conflicts).
  const uint4 mine = stage[sg][lane];
  const I w0 = seg_first + I(lane) * V;
  device E* to = out + row_start + w0;
  if (w0 >= 0 && w0 + V <= width) {
    *(device uint4*)to = mine;
  } else if (w0 + V > 0 && w0 < width) {
    // The row's first elements, or its last: apart, so that each store
    // instruction touches one cache line (a row narrower than 16 bytes
    // can be both).
    if (w0 < 0) {
      for (int e = 0; e < V; ++e)
        if (w0 + e >= 0 && w0 + e < width) to[e] = element_of<E>(mine, e);
    } else {
      for (int e = 0; e < V; ++e)
        if (w0 + e < width) to[e] = element_of<E>(mine, e);
    }
  }
}

// clang-format off
#define INSTANTIATE_PAD(name, E)                                                             \
  template [[host_name("constant_pad_" #name "_i32")]] kernel decltype(constant_pad<E, int>) \
      constant_pad<E, int>;                                                                  \
  template [[host_name("constant_pad_" #name "_i64")]] kernel decltype(constant_pad<E, long>) \
      constant_pad<E, long>;
// clang-format on

INSTANTIATE_PAD(1, uchar)
INSTANTIATE_PAD(2, ushort)
INSTANTIATE_PAD(4, uint)
INSTANTIATE_PAD(8, ulong)
