// Every simd shuffle, and the votes with active-lane semantics.
#include <metal_stdlib>
using namespace metal;

struct ShuffleArgs {
  ushort index;
  ushort delta;
  ushort mask;
  ushort modulo;
};

kernel void shuffles(device int* out [[buffer(0)]],
                     const device int* in [[buffer(1)]],
                     constant ShuffleArgs& a [[buffer(2)]],
                     uint tid [[thread_position_in_grid]]) {
  int v = in[tid];
  int fill = -in[tid];
  device int* o = out + 12 * tid;
  o[0] = simd_shuffle(v, (tid * 7 + a.index) % 32);
  o[1] = simd_broadcast(v, a.index);
  o[2] = simd_shuffle_up(v, a.delta);
  o[3] = simd_shuffle_down(v, a.delta);
  o[4] = simd_shuffle_xor(v, a.mask);
  o[5] = simd_shuffle_rotate_up(v, a.delta);
  o[6] = simd_shuffle_rotate_down(v, a.delta);
  o[7] = simd_shuffle_and_fill_up(v, fill, a.delta);
  o[8] = simd_shuffle_and_fill_down(v, fill, a.delta);
  o[9] = simd_shuffle_and_fill_up(v, fill, a.delta, a.modulo);
  o[10] = simd_shuffle_and_fill_down(v, fill, a.delta, a.modulo);
  o[11] = simd_broadcast_first(v);
}

// Votes inside a branch that only some lanes take: only they are active.
kernel void votes(device uint* out [[buffer(0)]],
                  const device int* in [[buffer(1)]],
                  uint tid [[thread_position_in_grid]],
                  uint lane [[thread_index_in_simdgroup]]) {
  int v = in[tid];
  device uint* o = out + 8 * tid;
  o[0] = uint(ulong(simd_ballot(v > 0)));
  o[1] = simd_all(v > -100);
  o[2] = simd_any(v > 50);
  if (lane % 3 == 0) {
    o[3] = uint(ulong(simd_active_threads_mask()));
    o[4] = uint(ulong(simd_ballot(v > 0)));
    o[5] = simd_all(v > 0);
    o[6] = simd_sum(uint(1));
    o[7] = simd_broadcast_first(uint(lane));
  } else {
    o[3] = o[4] = o[5] = o[6] = o[7] = 0xdeadu;
  }
}

// A reduction where lanes leave a loop at different iterations: each
// iteration's simd_sum sees only the lanes still inside.
kernel void divergent_loop(device int* out [[buffer(0)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  int total = 0;
  for (uint k = 0; k <= lane / 8; ++k)
    total += simd_sum(1);
  out[lane] = total + 100 * simd_sum(1);
}
