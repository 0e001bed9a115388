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
#include <metal_simdgroup_matrix>
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
// chunk_gated_delta_rule), two dispatches whose matrix products run on
// simdgroup_matrix<float, 8, 8> (float32 operands and accumulators, as
// transformers' float32 matmuls):
//   linear_attention_chunk_prep   a threadgroup per (chunk, value head,
//     sequence), all in parallel: the chunk's cumulative log decay gc, q
//     and k L2-normalised (q times dk^-0.5); the Gram products K K^T and
//     Q K^T (MMAs on staged slices of q and k); A = strict_lower(beta_i
//     k_i.k_j exp(gc_i - gc_j)) and the intra-chunk attention lower(q_i.k_j
//     exp(gc_i - gc_j)); T = (I + A)^-1 by forward substitution (scalar,
//     64 columns in parallel: C^3 / 6 FMAs, a tenth of the chunk's
//     products); then, as transformers, u = T (beta v) and w = T (beta k
//     exp(gc)) as MMAs; q exp(gc), k exp(gc_last - gc) and the chunk's decay
//     exp(gc_last). All float32, into scratch buffers whose rows are padded
//     with zeros to whole 8-wide fragments (LA_FRAG_PAD).
//   linear_attention_chunk_state  a threadgroup per (tile of value
//     channels, value head, sequence): the sequential pass over the chunks
//     on a [dk, tile] slice of the float32 state held in threadgroup memory
//     (the value channels of the state are independent: k, g and beta are
//     shared, so a slice needs no other): per chunk, as MMAs,
//       v_new = u - w S;  o = (q exp(gc)) S + attn v_new;
//       S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new.
//     w, q exp(gc), k exp(..) and attn are read as fragments straight from
//     the scratch (each fragment by one simdgroup of the threadgroup: no
//     reuse that staging would buy); S and v_new, which every simdgroup
//     reads, are in threadgroup memory.
// Rounding: as transformers, everything is float32 from the inputs on, the
// output rounded to the model's dtype once at the end; each product is
// summed on its own and then added or subtracted, as transformers' code
// writes it. The sums run in another order than torch's matmuls and
// triangular solve (the bound is in mps_ext/passes/linear_attention.py,
// CHUNK_TOLERANCE).
//
// Elementwise work on a fragment (u - w S, the decayed state plus the
// update, inter + intra) goes through thread_elements() of fragments loaded
// the same way, so it does not depend on the lanes' layout.

// Staged tiles' rows are 4 floats (16 bytes) longer than the tile: a row
// starts 4 banks after the one above it, so a fragment's 8 rows spread over
// the banks.
#define LA_TG_PAD 4
#define LA_T_PITCH (LA_CHUNK + LA_TG_PAD)          // T (and A, the Gram products) [LA_CHUNK][LA_T_PITCH]
#define LA_GRAM_PITCH (LA_GRAM_SLICE + LA_TG_PAD)  // a staged slice of q or k
#define LA_RHS_SLICE 32                            // columns of beta v / beta k exp(gc) per product with T
#define LA_RHS_PITCH (LA_RHS_SLICE + LA_TG_PAD)
#define LA_PREP_STAGE (2 * LA_CHUNK * LA_GRAM_PITCH)
#define LA_BLOCKS (LA_CHUNK / 8)  // 8-row blocks of a chunk
// Lower blocks of a Gram product a simdgroup takes, at most: rows r and 7 - r
// hold 9 lower blocks, split by column parity into 4 and 5.
#define LA_GRAM_BLOCKS ((LA_BLOCKS + 2) / 2)
static_assert(LA_CHUNK * LA_RHS_PITCH <= LA_PREP_STAGE,
              "a slice of the right-hand sides fits where q and k were staged");
static_assert(LA_CHUNK_THREADS / 32 == LA_BLOCKS, "a simdgroup per 8-row block of a chunk");
static_assert(LA_GRAM_SLICE % 8 == 0 && LA_RHS_SLICE == 32,
              "whole fragments; a simdgroup takes half a slice's columns");

template <typename T>
MPS_EXT_INLINE float at4(const device T* x, constant uint32_t* s, uint b, uint t, uint h, uint d) {
  return float(x[b * s[0] + t * s[1] + h * s[2] + d * s[3]]);
}

typedef simdgroup_matrix<float, 8, 8> la_frag;

MPS_EXT_INLINE la_frag la_zero() { return make_filled_simdgroup_matrix<float, 8, 8>(0.0f); }

// The prep kernel's products are lower triangular in 8 x 8 blocks. Simdgroup
// sg takes row blocks sg / 2 and LA_BLOCKS - 1 - sg / 2 (together 9 blocks
// of the lower triangle's rows, so every simdgroup gets the same work) and
// of their column blocks those of parity sg % 2 (the Gram products), or half
// of a slice's columns (the products with T).
MPS_EXT_INLINE uint la_row_block(uint sg, uint x) { return x == 0 ? sg / 2 : LA_BLOCKS - 1 - sg / 2; }

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
  threadgroup float gc[LA_CHUNK], bt[LA_CHUNK], inv_q[LA_CHUNK], inv_k[LA_CHUNK], eq[LA_CHUNK], ek[LA_CHUNK];
  // m: the Gram products, then A below the diagonal with T^T above it, then
  // T^T (what the products with T load, transposed).
  threadgroup float m[LA_CHUNK * LA_T_PITCH];
  // The staged q and k slices, then the right-hand sides' slices.
  threadgroup float stage[LA_PREP_STAGE];
  threadgroup float* qs = stage;
  threadgroup float* ks = stage + LA_CHUNK * LA_GRAM_PITCH;
  const uint c = tg.x, h = tg.y, b = tg.z, kh = h / p.ratio, t0 = c * LA_CHUNK;
  const uint valid = min(uint(LA_CHUNK), p.tokens - t0);
  const uint dk = p.dk, dv = p.dv, dkp = LA_FRAG_PAD(dk), dvp = LA_FRAG_PAD(dv);
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
  // The decays of q and k: exp(gc) and exp(gc_last - gc).
  if (t < LA_CHUNK) {
    eq[t] = exp(gc[t]);
    ek[t] = exp(gc[LA_CHUNK - 1] - gc[t]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. K K^T and Q K^T, lower blocks only, LA_GRAM_SLICE columns of dk at a
  // time: row blocks la_row_block(sg, x), column blocks par, par + 2, ...
  // up to the row block (the diagonal block included): LA_GRAM_BLOCKS or
  // fewer blocks a simdgroup, listed in order (x, column), n0 of row block 0.
  const uint par = sg % 2;
  // (Selected by value below, never indexed at run time: that would put the
  // arrays in stack memory.)
  const uint rb[2] = {la_row_block(sg, 0), la_row_block(sg, 1)};
  const uint n0 = rb[0] >= par ? (rb[0] - par) / 2 + 1 : 0, nb = n0 + (rb[1] - par) / 2 + 1;
  la_frag kk[LA_GRAM_BLOCKS], qk[LA_GRAM_BLOCKS];
  MPS_EXT_UNROLL
  for (uint n = 0; n < LA_GRAM_BLOCKS; ++n) kk[n] = qk[n] = la_zero();
  for (uint d0 = 0; d0 < dkp; d0 += LA_GRAM_SLICE) {
    for (uint e = t; e < LA_CHUNK * LA_GRAM_SLICE; e += LA_CHUNK_THREADS) {
      // A simdgroup's two half-rows are rows 4 apart: 4 x LA_GRAM_PITCH
      // words, 16 banks on, so its 32 stores hit 32 banks.
      const uint pair = e / 32, half = (e / LA_GRAM_SLICE) % 2, col = e % LA_GRAM_SLICE, d = d0 + col;
      const uint i = 8 * (pair / 4) + pair % 4 + 4 * half;
      const bool in = i < valid && d < dk;
      qs[i * LA_GRAM_PITCH + col] = in ? at4(q, p.q_stride, b, t0 + i, kh, d) * inv_q[i] * p.q_scale : 0.0f;
      ks[i * LA_GRAM_PITCH + col] = in ? at4(k, p.k_stride, b, t0 + i, kh, d) * inv_k[i] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Rolled: unrolled, both steps' fragments were live at once (registers: 128, one threadgroup a core).
    _Pragma("clang loop unroll(disable)") for (uint dd = 0; dd < LA_GRAM_SLICE; dd += 8) {
      la_frag qa[2], ka[2];
      MPS_EXT_UNROLL
      for (uint x = 0; x < 2; ++x) {
        simdgroup_load(qa[x], qs + 8 * rb[x] * LA_GRAM_PITCH + dd, LA_GRAM_PITCH);
        simdgroup_load(ka[x], ks + 8 * rb[x] * LA_GRAM_PITCH + dd, LA_GRAM_PITCH);
      }
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_GRAM_BLOCKS; ++n) {
        if (n < nb) {
          const bool first = n < n0;
          const uint cb = par + 2 * (first ? n : n - n0);
          la_frag kb;
          simdgroup_load(kb, ks + 8 * cb * LA_GRAM_PITCH + dd, LA_GRAM_PITCH, ulong2(0), true);
          simdgroup_multiply_accumulate(kk[n], first ? ka[0] : ka[1], kb, kk[n]);
          simdgroup_multiply_accumulate(qk[n], first ? qa[0] : qa[1], kb, qk[n]);
        }
      }
    }
    // The next slice (or the right-hand sides) overwrites what was just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // 4. The intra-chunk attention (lower, diagonal included) to the device,
  // then A (strictly lower, beta and decay applied) in m. Entries of m
  // above the stored blocks are not read (selected away).
  for (uint pass = 0; pass < 2; ++pass) {
    MPS_EXT_UNROLL
    for (uint n = 0; n < LA_GRAM_BLOCKS; ++n) {
      if (n < nb) {
        const bool first = n < n0;
        const uint cb = par + 2 * (first ? n : n - n0);
        simdgroup_store(pass == 0 ? qk[n] : kk[n], m + 8 * (first ? rb[0] : rb[1]) * LA_T_PITCH + 8 * cb, LA_T_PITCH);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // A thread per entry, a simdgroup's lanes along a row (contiguous).
    for (uint e = t; e < LA_CHUNK * LA_CHUNK; e += LA_CHUNK_THREADS) {
      const uint i = e / LA_CHUNK, j = e % LA_CHUNK;
      // As transformers: the decay's exponent only on and below the diagonal (no overflow above it).
      const float prod = m[i * LA_T_PITCH + j];
      if (pass == 0) attn[(row0 + i) * LA_CHUNK + j] = j <= i ? prod * exp(gc[i] - gc[j]) : 0.0f;
      else m[i * LA_T_PITCH + j] = j < i ? bt[i] * prod * exp(gc[i] - gc[j]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 5. T = (I + A)^-1, unit lower triangular, by forward substitution, a
  // thread per column j: T_ij = -A_ij - sum_{j<l<i} A_il T_lj. Column j of T
  // goes above the diagonal in row j of m (m[j][i] = T_ij, i > j), where A
  // is not: each thread reads A below the diagonal, which nobody writes,
  // and its own row above it (no barrier).
  if (t < LA_CHUNK) {
    threadgroup float* tj = m + t * LA_T_PITCH;
    for (uint i = t + 1; i < LA_CHUNK; ++i) {
      threadgroup const float* ai = m + i * LA_T_PITCH;
      float s = 0.0f;
      for (uint l = t + 1; l < i; ++l) s += ai[l] * tj[l];
      tj[i] = -ai[t] - s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // m = T^T: ones on the diagonal, zeros below.
  for (uint e = t; e < LA_CHUNK * LA_CHUNK; e += LA_CHUNK_THREADS) {
    const uint i = e / LA_CHUNK, j = e % LA_CHUNK;
    if (j <= i) m[i * LA_T_PITCH + j] = i == j ? 1.0f : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 6. u = T (beta v) and w = T ((k beta) exp(gc)), LA_RHS_SLICE columns of
  // the right-hand sides at a time (dv's, then dk's, each padded to whole
  // fragments): row blocks la_row_block(sg, x), column blocks 2 (sg % 2)
  // and the next; T's block (i, l) is T^T's (l, i) loaded transposed.
  threadgroup float* rhs = stage;
  const uint v_slices = (dvp + LA_RHS_SLICE - 1) / LA_RHS_SLICE, k_slices = (dkp + LA_RHS_SLICE - 1) / LA_RHS_SLICE;
  for (uint sl = 0; sl < v_slices + k_slices; ++sl) {
    const bool is_v = sl < v_slices;
    const uint c0 = (is_v ? sl : sl - v_slices) * LA_RHS_SLICE, width = is_v ? dvp : dkp, real = is_v ? dv : dk;
    for (uint e = t; e < LA_CHUNK * LA_RHS_SLICE; e += LA_CHUNK_THREADS) {
      const uint i = e / LA_RHS_SLICE, col = e % LA_RHS_SLICE, d = c0 + col;
      float r = 0.0f;
      if (i < valid && d < real) {
        // beta v, and (k beta) exp(gc) in transformers' order
        r = is_v ? at4(v, p.v_stride, b, t0 + i, h, d) * bt[i]
                 : at4(k, p.k_stride, b, t0 + i, kh, d) * inv_k[i] * bt[i] * eq[i];
      }
      rhs[i * LA_RHS_PITCH + col] = r;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    device float* dst = (is_v ? u + row0 * dvp : w + row0 * dkp) + c0;
    MPS_EXT_UNROLL
    for (uint x = 0; x < 2; ++x) {
      la_frag acc[2] = {la_zero(), la_zero()};
      for (uint l = 0; l <= rb[x]; ++l) {
        la_frag tf;
        simdgroup_load(tf, m + 8 * l * LA_T_PITCH + 8 * rb[x], LA_T_PITCH, ulong2(0), true);
        MPS_EXT_UNROLL
        for (uint n = 0; n < 2; ++n) {
          la_frag rf;
          simdgroup_load(rf, rhs + 8 * l * LA_RHS_PITCH + 8 * (2 * par + n), LA_RHS_PITCH);
          simdgroup_multiply_accumulate(acc[n], tf, rf, acc[n]);
        }
      }
      MPS_EXT_UNROLL
      for (uint n = 0; n < 2; ++n) {
        const uint col = 8 * (2 * par + n);
        if (c0 + col < width) simdgroup_store(acc[n], dst + 8 * rb[x] * width + col, width);
      }
    }
    // The next slice overwrites what was just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // 7. The decayed q and k the state pass reads (zeros in the padding), and
  // the chunk's decay. (Written while the Gram products stage q and k, they
  // took the prep kernel's registers from 119 to 129, over the budget.)
  for (uint i = sg; i < LA_CHUNK; i += simdgroups) {
    const bool in = i < valid;
    for (uint d = lane; d < dkp; d += 32) {
      const bool live = in && d < dk;
      const float qn = live ? at4(q, p.q_stride, b, t0 + i, kh, d) * inv_q[i] * p.q_scale : 0.0f;
      const float kn = live ? at4(k, p.k_stride, b, t0 + i, kh, d) * inv_k[i] : 0.0f;
      qd[(row0 + i) * dkp + d] = qn * eq[i];
      kd[(row0 + i) * dkp + d] = kn * ek[i];
    }
  }
  const float last = gc[LA_CHUNK - 1];
  if (t == 0) chunk_decay[head * p.chunks + c] = exp(last);
}

// The state pass's threadgroup arrays: the [dk, tile] state slice (rows
// padded to whole fragments: tile 32 up to dk 128, 16 up to 256) and the
// chunk's v_new [LA_CHUNK, tile], then its output.
#define LA_STATE_PITCH_MAX (LA_MAX_TILE + LA_TG_PAD)
#define LA_STATE_ARRAY (LA_STATE_ELEMS + LA_TG_PAD * LA_MAX_DK)
#define LA_TILE_BLOCKS (LA_MAX_TILE / 8)
// State fragments a simdgroup updates, at most: tile x dkp is within
// LA_STATE_ELEMS, over 8 simdgroups of 64 elements a fragment.
#define LA_UPDATE_BLOCKS (LA_STATE_ELEMS / 64 / LA_BLOCKS)

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
                                         uint t [[thread_index_in_threadgroup]],
                                         uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float s[LA_STATE_ARRAY];                  // [dkp][pitch]: the head's state, `tile` columns
  threadgroup float vn[LA_CHUNK * LA_STATE_PITCH_MAX];  // [LA_CHUNK][pitch]: v_new, then the chunk's output
  const uint h = tg.y, b = tg.z, dk = p.dk, dv = p.dv, tile = p.tile, pitch = tile + LA_TG_PAD;
  // blocks = tile / 8, a power of two: fragment n's row and column block are n >> shift and n & (blocks - 1)
  // (a division by a run-time value would be one an MMA).
  const uint dkp = LA_FRAG_PAD(dk), dvp = LA_FRAG_PAD(dv), blocks = tile / 8, shift = ctz(blocks);
  const uint c0 = tg.x * tile, cols = min(tile, dv - c0);
  const uint head = b * p.v_heads + h;
  // Element passes: a thread keeps one column of the tile (a power of two
  // dividing the threadgroup) and every rows-th row: a simdgroup's lanes are
  // consecutive columns of a row (tile 32: one row), so the device rows
  // they read and write are contiguous.
  const uint col = t % tile, r0 = t / tile, rows = LA_CHUNK_THREADS / tile;
  const bool live = col < cols;
  device float* fin = final_state + head * dk * dv + c0 + col;
  const device float* init = initial_state + head * dk * dv + c0 + col;
  for (uint d = r0; d < dkp; d += rows) s[d * pitch + col] = p.has_initial && live && d < dk ? init[d * dv] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint ch = 0; ch < p.chunks; ++ch) {
    const uint row0 = head * p.chunks * LA_CHUNK + ch * LA_CHUNK;
    // Read before the iteration's barriers, so that it is not waited for behind one.
    const float decay = chunk_decay[head * p.chunks + ch];
    // v_new = u - w S: simdgroup sg has the chunk's rows 8 sg to 8 sg + 7.
    {
      la_frag acc[LA_TILE_BLOCKS];
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_TILE_BLOCKS; ++n) acc[n] = la_zero();
      const device float* wr = w + (row0 + 8 * sg) * dkp;
      for (uint d = 0; d < dkp; d += 8) {
        la_frag a;
        simdgroup_load(a, wr + d, dkp);
        MPS_EXT_UNROLL
        for (uint n = 0; n < LA_TILE_BLOCKS; ++n) {
          if (n < blocks) {
            la_frag sf;
            simdgroup_load(sf, s + d * pitch + 8 * n, pitch);
            simdgroup_multiply_accumulate(acc[n], a, sf, acc[n]);
          }
        }
      }
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_TILE_BLOCKS; ++n) {
        if (n < blocks) {
          // Past the padded row (the last tile's dead columns) u is no one's: zeros.
          la_frag un = la_zero();
          if (c0 + 8 * n < dvp) simdgroup_load(un, u + (row0 + 8 * sg) * dvp + c0 + 8 * n, dvp);
          MPS_EXT_UNROLL
          for (uint e = 0; e < 2; ++e)
            acc[n].thread_elements()[e] = un.thread_elements()[e] - acc[n].thread_elements()[e];
          simdgroup_store(acc[n], vn + 8 * sg * pitch + 8 * n, pitch);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // o = (q exp(gc)) S + attn v_new (inter and intra summed apart, added at
    // the end, as transformers), rows 8 sg to 8 sg + 7; attn is lower
    // triangular in blocks: blocks 0 to sg.
    la_frag o[LA_TILE_BLOCKS];
    {
      const device float* qr = qd + (row0 + 8 * sg) * dkp;
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_TILE_BLOCKS; ++n) o[n] = la_zero();
      for (uint d = 0; d < dkp; d += 8) {
        la_frag a;
        simdgroup_load(a, qr + d, dkp);
        MPS_EXT_UNROLL
        for (uint n = 0; n < LA_TILE_BLOCKS; ++n) {
          if (n < blocks) {
            la_frag sf;
            simdgroup_load(sf, s + d * pitch + 8 * n, pitch);
            simdgroup_multiply_accumulate(o[n], a, sf, o[n]);
          }
        }
      }
      // A column block at a time: one more accumulator live, not four.
      const device float* ar = attn + (row0 + 8 * sg) * LA_CHUNK;
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_TILE_BLOCKS; ++n) {
        if (n < blocks) {
          la_frag intra = la_zero();
          for (uint l = 0; l <= sg; ++l) {
            la_frag a, vf;
            simdgroup_load(a, ar + 8 * l, LA_CHUNK);
            simdgroup_load(vf, vn + 8 * l * pitch + 8 * n, pitch);
            simdgroup_multiply_accumulate(intra, a, vf, intra);
          }
          MPS_EXT_UNROLL
          for (uint e = 0; e < 2; ++e) o[n].thread_elements()[e] += intra.thread_elements()[e];
        }
      }
    }
    // S = exp(gc_last) S + (k exp(gc_last - gc))^T v_new: simdgroup sg has
    // the state's row blocks sg, sg + 8, ... (dkp / 64 or fewer), each with
    // the tile's column blocks: LA_UPDATE_BLOCKS or fewer fragments, listed
    // by (row, column); (k ..)^T's block (rb, l) is k's (l, rb) loaded
    // transposed.
    const uint row_blocks = (dkp / 8 + LA_BLOCKS - 1 - sg) / LA_BLOCKS;
    la_frag upd[LA_UPDATE_BLOCKS];
    MPS_EXT_UNROLL
    for (uint n = 0; n < LA_UPDATE_BLOCKS; ++n) upd[n] = la_zero();
    for (uint l = 0; l < LA_BLOCKS; ++l) {
      la_frag a;  // loaded with a row block's first column block, used by the rest
      MPS_EXT_UNROLL
      for (uint n = 0; n < LA_UPDATE_BLOCKS; ++n) {
        if (n < row_blocks * blocks) {
          const uint rb = sg + LA_BLOCKS * (n >> shift), cb = n & (blocks - 1);
          if (cb == 0) simdgroup_load(a, kd + (row0 + 8 * l) * dkp + 8 * rb, dkp, ulong2(0), true);
          la_frag vf;
          simdgroup_load(vf, vn + 8 * l * pitch + 8 * cb, pitch);
          simdgroup_multiply_accumulate(upd[n], a, vf, upd[n]);
        }
      }
    }
    MPS_EXT_UNROLL
    for (uint n = 0; n < LA_UPDATE_BLOCKS; ++n) {
      if (n < row_blocks * blocks) {
        const uint rb = sg + LA_BLOCKS * (n >> shift), cb = n & (blocks - 1);
        la_frag old;
        simdgroup_load(old, s + 8 * rb * pitch + 8 * cb, pitch);
        MPS_EXT_UNROLL
        for (uint e = 0; e < 2; ++e)
          upd[n].thread_elements()[e] = old.thread_elements()[e] * decay + upd[n].thread_elements()[e];
      }
    }
    // Every simdgroup has read S and v_new: the new state and the output replace them.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    MPS_EXT_UNROLL
    for (uint n = 0; n < LA_UPDATE_BLOCKS; ++n) {
      if (n < row_blocks * blocks) {
        const uint rb = sg + LA_BLOCKS * (n >> shift), cb = n & (blocks - 1);
        simdgroup_store(upd[n], s + 8 * rb * pitch + 8 * cb, pitch);
      }
    }
    MPS_EXT_UNROLL
    for (uint n = 0; n < LA_TILE_BLOCKS; ++n)
      if (n < blocks) simdgroup_store(o[n], vn + 8 * sg * pitch + 8 * n, pitch);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // The chunk's tokens' outputs, a row's columns on consecutive lanes.
    for (uint i = r0; i < LA_CHUNK; i += rows) {
      const uint token = ch * LA_CHUNK + i;
      if (live && token < p.tokens)
        out[((b * p.tokens + token) * p.v_heads + h) * dv + c0 + col] = T(vn[i * pitch + col]);
    }
    // The next chunk's v_new overwrites the output just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (live)
    for (uint d = r0; d < dk; d += rows) fin[d * dv] = s[d * pitch + col];
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
