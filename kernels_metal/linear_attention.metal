// Gated DeltaNet decode (Qwen3-Next, Qwen3.5/3.6-MoE linear-attention layers):
// one new token per sequence, everything between the layer's input
// projections and its output projection in one dispatch.
//   linear_attention_decode  a threadgroup per (key head, sequence):
//     1. the depthwise causal convolution of its channels (its key head's
//        query and key channels, its value heads' value channels) over the
//        cached window and the new input, SiLU; the window shifted in place;
//     2. the gates of its value heads: decay = exp(-exp(A_log) *
//        softplus(a + dt_bias)), beta = sigmoid(b);
//     3. L2 norms of the query and key (the query then divided by sqrt(dk));
//     4. the delta rule on each value head's [dk, dv] float32 state, read
//        and written in place once: S *= decay; S += k (beta (v - S^T k))^T;
//        o = S^T q;
//     5. the gated RMSNorm over each value head's dv outputs, times SiLU(z).
// Owning a key head's channels whole is what lets one dispatch shift the
// convolution window in place: every threadgroup that reads a channel's
// window is the one that writes it.
//
// Rounding follows transformers' torch code, which keeps activations in the
// model's dtype T between its ops: the convolution's and SiLU's outputs, beta
// and the recurrence's output are rounded to T; the recurrence itself, the
// gates, the norms and their sums are float32.
#include <metal_stdlib>
#include "linear_attention_params.h"
#include "activations.h"
using namespace metal;

template <typename T>
MPS_EXT_INLINE float round_to(float v) {
  return float(T(v));
}

// The sum of `v` over the threadgroup's columns' row parts: each thread
// leaves its part in partial[part][col]; every thread of a column reads the
// column's parts in the same order, so they agree to the bit. Two barriers:
// the parts are written, then free again.
MPS_EXT_INLINE float column_sum(float v, uint part, uint col, uint parts, uint cols, threadgroup float* partial) {
  partial[part * cols + col] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (uint p = 0; p < parts; ++p) s += partial[p * cols + col];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return s;
}

template <typename T>
[[max_total_threads_per_threadgroup(LA_MAX_THREADS)]]
kernel void linear_attention_decode(device T* out [[buffer(0)]],
                                    device T* conv_state [[buffer(1)]],
                                    device float* state [[buffer(2)]],
                                    const device T* qkv [[buffer(3)]],
                                    const device T* z [[buffer(4)]],
                                    const device T* b_proj [[buffer(5)]],
                                    const device T* a_proj [[buffer(6)]],
                                    const device T* conv_weight [[buffer(7)]],
                                    const device T* a_log [[buffer(8)]],
                                    const device T* dt_bias [[buffer(9)]],
                                    const device T* norm_weight [[buffer(10)]],
                                    constant LinearAttentionParams& p [[buffer(11)]],
                                    uint2 tg [[threadgroup_position_in_grid]],
                                    uint t [[thread_index_in_threadgroup]],
                                    uint2 group_size [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float qs[LA_MAX_DK], ks[LA_MAX_DK], vs[LA_MAX_COLS], os[LA_MAX_COLS], partial[LA_MAX_THREADS];
  threadgroup float decay[LA_MAX_RATIO], beta[LA_MAX_RATIO], inv_rms[LA_MAX_RATIO], inv_l2[2];
  const uint kh = tg.x, seq = tg.y, threads = group_size.x;
  const uint dk = p.dk, dv = p.dv, ratio = p.ratio, cols_total = ratio * dv, key_dim = p.k_heads * dk;
  const uint first_v = kh * ratio;  // this key head's first value head

  // 1. Convolution and SiLU of the threadgroup's channels: local channel l
  // is query l, key l - dk, or value l - 2 dk of its value heads. A lane
  // per tap of a channel's window (conv_k lanes a channel, conv_k a power
  // of two up to 32), so that consecutive lanes read and write consecutive
  // elements of the cached windows. The window moves one step on: tap i
  // takes tap i + 1's value (the next lane's), the last tap the new input;
  // the output is the moved window times the weights, summed over the
  // channel's lanes. Every lane takes every step (shuffles need them all).
  const device T* x = qkv + seq * p.qkv_stride;
  const uint k = p.conv_k, channels = 2 * dk + cols_total;
  for (uint base = 0; base < channels * k; base += threads) {
    const uint e = base + t, l = e / k, tap = e % k;
    const bool active = l < channels;
    const uint c = !active      ? 0u
                   : l < dk     ? kh * dk + l
                   : l < 2 * dk ? key_dim + kh * dk + (l - dk)
                                : 2 * key_dim + first_v * dv + (l - 2 * dk);
    device T* window = conv_state + (seq * p.conv_dim + c) * k;
    // Shuffled as float (exact for T): Metal's shuffles take no bfloat.
    const float old = active ? float(window[tap]) : 0.0f;
    const float next = simd_shuffle_down(old, ushort(1));
    const T moved = tap + 1 == k ? (active ? x[c] : T(0)) : T(next);
    float acc = active ? float(conv_weight[c * k + tap]) * float(moved) : 0.0f;
    for (uint off = k / 2; off > 0; off /= 2) acc += simd_shuffle_xor(acc, ushort(off));
    if (active) {
      window[tap] = moved;
      if (tap == 0) {
        const float y = round_to<T>(silu(round_to<T>(acc)));
        if (l < dk) qs[l] = y;
        else if (l < 2 * dk) ks[l - dk] = y;
        else vs[l - 2 * dk] = y;
      }
    }
  }
  // 2. Gates of the value heads.
  for (uint r = t; r < ratio; r += threads) {
    const uint h = first_v + r;
    const float sp_in = float(a_proj[seq * p.a_stride + h]) + float(dt_bias[h]);
    decay[r] = exp(-exp(float(a_log[h])) * softplus(sp_in, LA_SOFTPLUS_THRESHOLD));
    beta[r] = round_to<T>(sigmoid(float(b_proj[seq * p.b_stride + h])));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. L2 norms of the query and key: simdgroup 0 sums the query's squares,
  // the last simdgroup the key's (the same one when there is one).
  if (sg == 0 || sg == simdgroups - 1) {
    for (uint which = sg == 0 ? 0u : 1u; which < 2; which += (simdgroups == 1 ? 1u : 2u)) {
      threadgroup const float* v = which == 0 ? qs : ks;
      float s = 0.0f;
      for (uint i = lane; i < dk; i += 32) s += v[i] * v[i];
      s = simd_sum(s);
      if (lane == 0) inv_l2[which] = rsqrt(s + LA_L2_EPS);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = t; i < dk; i += threads) {
    qs[i] = qs[i] * inv_l2[0] / p.q_scale;
    ks[i] = ks[i] * inv_l2[1];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 4. The delta rule, a column of a value head's state at a time: thread
  // (part, col) keeps rows part * LA_ROWS to part * LA_ROWS + LA_ROWS - 1 of
  // column c0 + col in registers, read once and written once; a simdgroup's
  // lanes are consecutive columns, so each row's access is contiguous.
  const uint cols = p.cols, parts = p.row_parts, col = t % cols, part = t / cols;
  for (uint c0 = 0; c0 < cols_total; c0 += cols) {
    const uint j = c0 + col;
    const bool active = j < cols_total && part < parts;
    const uint r = active ? j / dv : 0;
    device float* column = state + ((seq * p.v_heads + first_v + r) * dk) * dv + (active ? j % dv : 0);
    const float d = active ? decay[r] : 0.0f;
    float s[LA_ROWS];
    float kv = 0.0f;
    MPS_EXT_UNROLL
    for (uint m = 0; m < LA_ROWS; ++m) {
      const uint i = part * LA_ROWS + m;
      s[m] = active && i < dk ? column[i * dv] * d : 0.0f;
      kv += s[m] * (i < dk ? ks[i] : 0.0f);
    }
    kv = column_sum(kv, part, col, parts, cols, partial);
    const float delta = active ? (vs[j] - kv) * beta[r] : 0.0f;
    float o = 0.0f;
    MPS_EXT_UNROLL
    for (uint m = 0; m < LA_ROWS; ++m) {
      const uint i = part * LA_ROWS + m;
      if (active && i < dk) {
        s[m] += ks[i] * delta;
        column[i * dv] = s[m];
        o += s[m] * qs[i];
      }
    }
    o = column_sum(o, part, col, parts, cols, partial);
    if (active && part == 0) os[j] = round_to<T>(o);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 5. Gated RMSNorm of each value head's outputs, times SiLU(z).
  for (uint r = sg; r < ratio; r += simdgroups) {
    float s = 0.0f;
    for (uint i = lane; i < dv; i += 32) s += os[r * dv + i] * os[r * dv + i];
    s = simd_sum(s);
    if (lane == 0) inv_rms[r] = rsqrt(s / float(dv) + p.norm_eps);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const device T* zr = z + seq * p.z_stride + first_v * dv;
  device T* o_row = out + seq * p.out_stride + first_v * dv;
  for (uint l = t; l < cols_total; l += threads) {
    const float normed = round_to<T>(os[l] * inv_rms[l / dv]);
    const float weighted = round_to<T>(float(norm_weight[l % dv]) * normed);
    o_row[l] = T(weighted * silu(float(zr[l])));
  }
}

// clang-format off
template [[host_name("linear_attention_decode_f32")]] kernel decltype(linear_attention_decode<float>)
    linear_attention_decode<float>;
template [[host_name("linear_attention_decode_f16")]] kernel decltype(linear_attention_decode<half>)
    linear_attention_decode<half>;
template [[host_name("linear_attention_decode_bf16")]] kernel decltype(linear_attention_decode<bfloat>)
    linear_attention_decode<bfloat>;
// clang-format on

// ---------------------------------------------------------------------------
// Gated DeltaNet prefill: the chunked delta rule (transformers'
// torch_chunk_gated_delta_rule, the algorithm of FLA's
// chunk_gated_delta_rule), two dispatches:
//   linear_attention_chunk_prep   a threadgroup per (chunk, value head,
//     sequence), all in parallel: the chunk's cumulative log decay gc, q
//     and k L2-normalised (q times dk^-0.5), the WY representation of its
//     LA_CHUNK delta-rule steps: with A = strict_lower(beta_i k_i.k_j
//     exp(gc_i - gc_j)), u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta
//     k exp(gc)) by forward substitution; the intra-chunk attention
//     lower(q_i.k_j exp(gc_i - gc_j)); q exp(gc), k exp(gc_last - gc) and
//     the chunk's decay exp(gc_last). All float32, into scratch buffers.
//   linear_attention_chunk_state  a threadgroup per (tile of value
//     channels, value head, sequence): the sequential pass over the chunks
//     on a [dk, tile] slice of the float32 state held in threadgroup memory
//     (the value channels of the state are independent: k, g and beta are
//     shared, so a slice needs no other): per chunk
//       v_new = u - w S;  o = (q exp(gc)) S + attn v_new;
//       S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new.
// Rounding: as transformers, everything is float32 from the inputs on, the
// output rounded to the model's dtype once at the end. The sums run in
// another order than torch's matmuls and triangular solve (the bound is in
// mps_ext/passes/linear_attention.py, CHUNK_TOLERANCE).

// The prep kernel's threadgroup arena: the two staged slices, which A
// (64 x 65 floats) fits in too.
#define LA_PREP_ARENA (2 * LA_CHUNK * (LA_GRAM_SLICE + 1))
static_assert(LA_PREP_ARENA >= LA_CHUNK * (LA_CHUNK + 1), "A fits in the prep kernel's arena");

template <typename T>
MPS_EXT_INLINE float at4(const device T* x, constant uint32_t* s, uint b, uint t, uint h, uint d) {
  return float(x[b * s[0] + t * s[1] + h * s[2] + d * s[3]]);
}

template <typename T>
[[max_total_threads_per_threadgroup(LA_CHUNK_THREADS)]]
kernel void linear_attention_chunk_prep(device float* qd [[buffer(0)]],
                                        device float* kd [[buffer(1)]],
                                        device float* w [[buffer(2)]],
                                        device float* u [[buffer(3)]],
                                        device float* attn [[buffer(4)]],
                                        device float* chunk_decay [[buffer(5)]],
                                        const device T* q [[buffer(6)]],
                                        const device T* k [[buffer(7)]],
                                        const device T* v [[buffer(8)]],
                                        const device float* g [[buffer(9)]],
                                        const device T* beta [[buffer(10)]],
                                        constant LinearAttentionChunkParams& p [[buffer(11)]],
                                        uint3 tg [[threadgroup_position_in_grid]],
                                        uint t [[thread_index_in_threadgroup]],
                                        uint lane [[thread_index_in_simdgroup]],
                                        uint sg [[simdgroup_index_in_threadgroup]],
                                        uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float gc[LA_CHUNK], bt[LA_CHUNK], inv_q[LA_CHUNK], inv_k[LA_CHUNK];
  // The staged q and k slices during the Gram products, then A: never
  // needed at once. Row pitches of 33 and 65 floats: a simdgroup's lanes
  // reading consecutive rows of a column hit 32 different banks.
  threadgroup float arena[LA_PREP_ARENA];
  threadgroup float* qs = arena;
  threadgroup float* ks = arena + LA_CHUNK * (LA_GRAM_SLICE + 1);
  threadgroup float* a = arena;
  const uint c = tg.x, h = tg.y, b = tg.z, kh = h / p.ratio, t0 = c * LA_CHUNK;
  const uint valid = min(uint(LA_CHUNK), p.tokens - t0);
  const uint dk = p.dk, dv = p.dv;
  const uint head = b * p.v_heads + h, row0 = head * p.chunks * LA_CHUNK + t0;

  // 1. Gates: g and beta of the chunk's tokens (0 past the end, as
  // transformers pads them); the cumulative sum in token order.
  if (t < LA_CHUNK) {
    const bool in = t < valid;
    gc[t] = in ? g[b * p.g_stride[0] + (t0 + t) * p.g_stride[1] + h * p.g_stride[2]] : 0.0f;
    bt[t] = in ? float(beta[b * p.beta_stride[0] + (t0 + t) * p.beta_stride[1] + h * p.beta_stride[2]]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) {
    float s = 0.0f;
    for (uint i = 0; i < LA_CHUNK; ++i) {
      s += gc[i];
      gc[i] = s;
    }
  }
  // 2. L2 norms of q and k: a simdgroup per row, its lanes along dk
  // (coalesced where dk is the contiguous dimension).
  for (uint r = sg; r < 2 * LA_CHUNK; r += simdgroups) {
    const uint i = r % LA_CHUNK;
    const bool is_k = r >= LA_CHUNK;
    float s = 0.0f;
    if (i < valid) {
      for (uint d = lane; d < dk; d += 32) {
        const float x = is_k ? at4(k, p.k_stride, b, t0 + i, kh, d) : at4(q, p.q_stride, b, t0 + i, kh, d);
        s += x * x;
      }
    }
    s = simd_sum(s);
    if (lane == 0) {
      const float inv = p.l2norm ? rsqrt(s + LA_L2_EPS) : 1.0f;
      if (is_k) inv_k[i] = inv;
      else inv_q[i] = inv;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. The chunk's k k^T and q k^T, LA_GRAM_SLICE columns at a time: thread
  // t holds entries (t / LA_CHUNK + m * (LA_CHUNK_THREADS / LA_CHUNK),
  // t % LA_CHUNK): a simdgroup's lanes share a row i (a broadcast) and read
  // consecutive rows j. A slice is staged a row per simdgroup pass, its
  // lanes along dk (coalesced).
  constexpr uint per = LA_CHUNK * LA_CHUNK / LA_CHUNK_THREADS, step = LA_CHUNK_THREADS / LA_CHUNK;
  constexpr uint pitch = LA_GRAM_SLICE + 1;
  const uint j = t % LA_CHUNK, i0 = t / LA_CHUNK;
  float kk[per], qk[per];
  MPS_EXT_UNROLL
  for (uint m = 0; m < per; ++m) kk[m] = qk[m] = 0.0f;
  for (uint d0 = 0; d0 < dk; d0 += LA_GRAM_SLICE) {
    const uint d = d0 + lane;
    for (uint i = sg; i < LA_CHUNK; i += simdgroups) {
      const bool in = i < valid && d < dk;
      qs[i * pitch + lane] = in ? at4(q, p.q_stride, b, t0 + i, kh, d) * inv_q[i] * p.q_scale : 0.0f;
      ks[i * pitch + lane] = in ? at4(k, p.k_stride, b, t0 + i, kh, d) * inv_k[i] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint dd = 0; dd < LA_GRAM_SLICE; ++dd) {
      const float kj = ks[j * pitch + dd];
      MPS_EXT_UNROLL
      for (uint m = 0; m < per; ++m) {
        const uint i = i0 + m * step;
        kk[m] += ks[i * pitch + dd] * kj;
        qk[m] += qs[i * pitch + dd] * kj;
      }
    }
    // The next slice (or A) overwrites what was just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // 4. A (strictly lower, beta and decay applied) into threadgroup memory;
  // the intra-chunk attention (lower, diagonal included) to the device.
  MPS_EXT_UNROLL
  for (uint m = 0; m < per; ++m) {
    const uint i = i0 + m * step;
    // As transformers: the exponent masked to -inf above the diagonal (no
    // overflow there), so the products need no branch.
    const float decay = exp(j <= i ? gc[i] - gc[j] : -INFINITY);
    a[i * (LA_CHUNK + 1) + j] = float(j < i) * (bt[i] * kk[m] * decay);
    attn[(row0 + i) * LA_CHUNK + j] = qk[m] * decay;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 5. Forward substitution, a thread per right-hand column (dv columns of
  // beta v, then dk of beta k exp(gc)): x_i = rhs_i - sum_{j<i} A_ij x_j.
  // A column's x_j are read back from where the thread wrote them (its own
  // writes: no barrier), a row of A is a broadcast.
  for (uint col = t; col < dv + dk; col += LA_CHUNK_THREADS) {
    const bool is_v = col < dv;
    device float* x = is_v ? u + row0 * dv + col : w + row0 * dk + (col - dv);
    const uint stride = is_v ? dv : dk;
    for (uint i = 0; i < LA_CHUNK; ++i) {
      float rhs = 0.0f;
      if (i < valid) {
        // beta v, and (k beta) exp(gc) in transformers' order
        rhs = is_v ? at4(v, p.v_stride, b, t0 + i, h, col) * bt[i]
                   : at4(k, p.k_stride, b, t0 + i, kh, col - dv) * inv_k[i] * bt[i] * exp(gc[i]);
      }
      float sum = 0.0f;
      for (uint jj = 0; jj < i; ++jj) sum += a[i * (LA_CHUNK + 1) + jj] * x[jj * stride];
      x[i * stride] = rhs - sum;
    }
  }
  // 6. The decayed q and k the state pass reads, and the chunk's decay.
  const float last = gc[LA_CHUNK - 1];
  for (uint i = sg; i < LA_CHUNK; i += simdgroups) {
    const bool in = i < valid;
    for (uint d = lane; d < dk; d += 32) {
      const float qn = in ? at4(q, p.q_stride, b, t0 + i, kh, d) * inv_q[i] * p.q_scale : 0.0f;
      const float kn = in ? at4(k, p.k_stride, b, t0 + i, kh, d) * inv_k[i] : 0.0f;
      qd[(row0 + i) * dk + d] = qn * exp(gc[i]);
      kd[(row0 + i) * dk + d] = kn * exp(last - gc[i]);
    }
  }
  if (t == 0) chunk_decay[head * p.chunks + c] = exp(last);
}

template <typename T>
[[max_total_threads_per_threadgroup(LA_CHUNK_THREADS)]]
kernel void linear_attention_chunk_state(device T* out [[buffer(0)]],
                                         device float* final_state [[buffer(1)]],
                                         const device float* initial_state [[buffer(2)]],
                                         const device float* qd [[buffer(3)]],
                                         const device float* kd [[buffer(4)]],
                                         const device float* w [[buffer(5)]],
                                         const device float* u [[buffer(6)]],
                                         const device float* attn [[buffer(7)]],
                                         const device float* chunk_decay [[buffer(8)]],
                                         constant LinearAttentionChunkParams& p [[buffer(9)]],
                                         uint3 tg [[threadgroup_position_in_grid]],
                                         uint t [[thread_index_in_threadgroup]]) {
  threadgroup float s[LA_STATE_ELEMS];           // [dk, tile] of the head's state
  threadgroup float vn[LA_CHUNK * LA_MAX_TILE];  // [LA_CHUNK, tile]: the chunk's v_new
  const uint h = tg.y, b = tg.z, dk = p.dk, dv = p.dv, tile = p.tile;
  const uint c0 = tg.x * tile, cols = min(tile, dv - c0);
  const uint head = b * p.v_heads + h;
  // A thread keeps one column of the tile (the host's tile is a power of two
  // dividing the threadgroup) and every rows-th row of a [rows, tile] array:
  // a simdgroup's lanes are consecutive columns of a row (tile 32: one row),
  // so the device rows they read are contiguous or one broadcast address.
  const uint col = t % tile, r0 = t / tile, rows = LA_CHUNK_THREADS / tile;
  const bool live = col < cols;
  device float* fin = final_state + head * dk * dv + c0 + col;
  const device float* init = initial_state + head * dk * dv + c0 + col;
  for (uint d = r0; d < dk; d += rows) s[d * tile + col] = p.has_initial && live ? init[d * dv] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint ch = 0; ch < p.chunks; ++ch) {
    const uint row0 = head * p.chunks * LA_CHUNK + ch * LA_CHUNK;
    // Read before the iteration's barriers, so that it is not waited for behind one.
    const float decay = chunk_decay[head * p.chunks + ch];
    // v_new = u - w S
    for (uint i = r0; i < LA_CHUNK; i += rows) {
      // The product summed on its own, then subtracted, as transformers
      // (u - (w @ S)): the rounding of a float32 sum of small terms.
      const device float* wi = w + (row0 + i) * dk;
      float ws = 0.0f;
      for (uint d = 0; d < dk; ++d) ws += wi[d] * s[d * tile + col];
      vn[i * tile + col] = (live ? u[(row0 + i) * dv + c0 + col] : 0.0f) - ws;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // o = (q exp(gc)) S + attn v_new, the chunk's tokens only
    for (uint i = r0; i < LA_CHUNK; i += rows) {
      const uint token = ch * LA_CHUNK + i;
      if (!live || token >= p.tokens) continue;
      const device float* qi = qd + (row0 + i) * dk;
      const device float* ai = attn + (row0 + i) * LA_CHUNK;
      float inter = 0.0f, intra = 0.0f;  // added at the end, as transformers
      for (uint d = 0; d < dk; ++d) inter += qi[d] * s[d * tile + col];
      for (uint jj = 0; jj <= i; ++jj) intra += ai[jj] * vn[jj * tile + col];
      out[((b * p.tokens + token) * p.v_heads + h) * dv + c0 + col] = T(inter + intra);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new
    for (uint d = r0; d < dk; d += rows) {
      float acc = 0.0f;  // S decay + (k^T @ v_new): the product summed on its own, as transformers
      // Rolled: unrolled, its 64 key loads would all be live at once (a
      // GPU compiler's registers, not loads in flight, would then limit it).
      _Pragma("clang loop unroll(disable)") for (uint i = 0; i < LA_CHUNK; ++i) acc +=
          kd[(row0 + i) * dk + d] * vn[i * tile + col];
      s[d * tile + col] = s[d * tile + col] * decay + acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (live)
    for (uint d = r0; d < dk; d += rows) fin[d * dv] = s[d * tile + col];
}

// clang-format off
template [[host_name("linear_attention_chunk_prep_f32")]] kernel decltype(linear_attention_chunk_prep<float>)
    linear_attention_chunk_prep<float>;
template [[host_name("linear_attention_chunk_prep_f16")]] kernel decltype(linear_attention_chunk_prep<half>)
    linear_attention_chunk_prep<half>;
template [[host_name("linear_attention_chunk_prep_bf16")]] kernel decltype(linear_attention_chunk_prep<bfloat>)
    linear_attention_chunk_prep<bfloat>;
template [[host_name("linear_attention_chunk_state_f32")]] kernel decltype(linear_attention_chunk_state<float>)
    linear_attention_chunk_state<float>;
template [[host_name("linear_attention_chunk_state_f16")]] kernel decltype(linear_attention_chunk_state<half>)
    linear_attention_chunk_state<half>;
template [[host_name("linear_attention_chunk_state_bf16")]] kernel decltype(linear_attention_chunk_state<bfloat>)
    linear_attention_chunk_state<bfloat>;
// clang-format on
