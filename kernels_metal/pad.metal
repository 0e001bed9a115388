// constant_pad_nd: one dispatch, one thread per PAD_ELEMENTS_PER_THREAD
// consecutive output elements in memory order. No shape-dependent state:
// shapes, strides and pads arrive in PadParams.
#include <metal_stdlib>
#include "pad_params.h"
using namespace metal;

// E is an unsigned integer of the element's size (a pad only moves bits);
// I is the index type: int when every offset fits in 31 bits, long beyond.
template <typename E, typename I>
kernel void constant_pad(device E* out [[buffer(0)]],
                         const device E* in [[buffer(1)]],
                         constant PadParams& p [[buffer(2)]],
                         uint gid [[thread_position_in_grid]]) {
  const I first = I(gid) * PAD_ELEMENTS_PER_THREAD;
  if (first >= I(p.numel)) return;
  const uint rank = p.rank;
  const E fill = E(p.fill_bits);

  // Coordinates of the first element, then stepped like an odometer.
  I coord[MPS_EXT_MAX_DIMS];
  I rest = first;
  for (int d = int(rank) - 1; d >= 0; --d) {
    coord[d] = rest % I(p.out_sizes[d]);
    rest /= I(p.out_sizes[d]);
  }
  const I last = min(first + PAD_ELEMENTS_PER_THREAD, I(p.numel));
  for (I index = first; index < last; ++index) {
    bool inside = true;
    I offset = 0;
    for (uint d = 0; d < rank; ++d) {
      I c = coord[d] - I(p.pad_before[d]);
      if (c < 0 || c >= I(p.in_sizes[d])) {
        inside = false;
        break;
      }
      offset += c * I(p.in_strides[d]);
    }
    out[index] = inside ? in[offset] : fill;
    for (int d = int(rank) - 1; d >= 0; --d) {
      if (++coord[d] < I(p.out_sizes[d])) break;
      coord[d] = 0;
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
