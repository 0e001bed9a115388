// constant_pad_nd: one dispatch; shapes, strides and pads arrive in
// PadParams, so nothing depends on the shape but the launch size.
//
// Each simdgroup fills one segment of an output row: PAD_SEGMENT_BYTES,
// starting 16-byte aligned in memory (so a row's first and last segments may
// stick out of it). Lane l reads the segment's elements l, l + 32, l + 64, ...
// (consecutive lanes, consecutive input addresses when the input row is
// contiguous), stages them in threadgroup memory, and then writes its own 16
// consecutive bytes with one vector store. Without the staging, either the
// loads would stride 16 bytes between lanes or 1- and 2-byte elements would
// be stored one at a time per lane.
#include <metal_stdlib>
#include "pad_params.h"
using namespace metal;

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
  // element in the first segment, so that segments are 16-byte aligned.
  const I row_start = I(row) * width;
  const I head = row_start & I(V - 1);
  const I seg_first = I(segment) * (32 * V) - head;  // row coordinate of element 0
  const E fill = E(p.fill_bits);
  const I pad_inner = I(p.pad_before[last]);
  const I in_inner = I(p.in_sizes[last]);
  const I in_stride = I(p.in_strides[last]);
  threadgroup E* staged = (threadgroup E*)stage[sg];
  for (int e = 0; e < V; ++e) {
    const int q = e * 32 + int(lane);
    const I w = seg_first + q;
    if (w < 0 || w >= width) continue;
    const I ci = w - pad_inner;
    staged[q] = row_inside && ci >= 0 && ci < in_inner ? in[in_row + ci * in_stride] : fill;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const I w0 = seg_first + I(lane) * V;
  if (w0 >= 0 && w0 + V <= width) {
    *(device uint4*)(out + row_start + w0) = stage[sg][lane];
  } else {  // the segment sticks out of the row here
    for (int e = 0; e < V; ++e) {
      const I w = w0 + e;
      if (w >= 0 && w < width) out[row_start + w] = staged[int(lane) * V + e];
    }
  }
}

#define INSTANTIATE_PAD(name, E)                                                             \
  template [[host_name("constant_pad_" #name "_i32")]] kernel decltype(constant_pad<E, int>) \
      constant_pad<E, int>;                                                                  \
  template [[host_name("constant_pad_" #name "_i64")]] kernel decltype(constant_pad<E, long>) \
      constant_pad<E, long>;

INSTANTIATE_PAD(1, uchar)
INSTANTIATE_PAD(2, ushort)
INSTANTIATE_PAD(4, uint)
INSTANTIATE_PAD(8, ulong)
