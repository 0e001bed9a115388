"""Meta kernels (shapes and dtypes) of the torch.ops.mps_ext ops that do not
take the aten op's own: the families' own ops (no aten op; _C.family_own_ops
lists them: linear's rms_norm_linear and sigmoid_gate_linear, scaled_mm's fp8_linear and rms_norm_fp8_linear,
moe's moe_route, moe_experts,
moe_combine, moe_layer and add_rms_norm_moe_layer, norm's rms_norm, add_rms_norm, qk_norm_rope and qk_norm_rope_append,
attention_gate's sigmoid_gate, kv_cache's kv_append and kv_decode_attention, linear_attention's
linear_attention_decode and linear_attention_chunk, short_conv's short_conv_decode), fp8_grouped_linear
and commit; the scaled_mm family, whose aten meta
functions check CUDA's layout rules (mat2 column-major, dimensions multiples
of 16) that mps_ext does not need, so a traced model would fail where the
eager one runs; and the grouped_mm family, whose aten meta functions take
_grouped_mm in bfloat16 only before torch 2.14 (float16 too from 2.14, never
float32), give the output's leading stride unpadded off CUDA before 2.15
(every eager kernel pads it to 16 bytes), and do not exist for
_scaled_grouped_mm_v2 before 2.14. In Python so that symbolic shapes
(torch.compile(dynamic=True)) pass through. The real kernels check the
arguments when the compiled code runs."""

from __future__ import annotations

import torch


def _product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, op: str) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"{op}: self and mat2 must be matrices")
    torch._check(a.shape[1] == b.shape[0], lambda: f"{op}: self and mat2 shapes cannot be multiplied "
                 f"({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    return _product(self, mat2, out_dtype or self.dtype, "_scaled_mm")


def _scaled_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype,
                  contraction_dim=(), use_fast_accum=False):
    return _product(self, mat2, out_dtype or torch.bfloat16, "_scaled_mm_v2")  # bf16: torch's default for v2


def _fp8_linear(input, weight, weight_scale, granularity, bias=None):
    torch._check(weight.dim() == 2, lambda: "mps_ext fp8_linear: weight must be a 2-D float8 tensor")
    torch._check(input.dim() >= 1 and input.shape[-1] == weight.shape[1],
                 lambda: "mps_ext fp8_linear: input's last dimension must equal the weight's K")
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _grouped_output(a: torch.Tensor, b: torch.Tensor, offs, out_dtype: torch.dtype, op: str) -> torch.Tensor:
    """The output of a grouped product as the eager kernels make it (torch's
    create_grouped_gemm_output_tensor): the last dimension's stride padded
    to 16 bytes."""
    torch._check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: f"{op}: mat_a and mat_b have to be 2 or 3d")
    torch._check(offs is not None or (a.dim() == 3 and b.dim() == 3),
                 lambda: f"{op}: offsets are needed unless both matrices are 3d")
    if a.dim() == 2 and b.dim() == 2:
        size = [offs.shape[0], a.shape[0], b.shape[1]]
    elif a.dim() == 2:
        size = [a.shape[0], b.shape[-1]]
    elif b.dim() == 2:
        size = [a.shape[1], b.shape[1]]
    else:
        size = [a.shape[0], a.shape[1], b.shape[-1]]
    align = 16 // torch.empty((), dtype=out_dtype).element_size()
    padded = (size[-1] + align - 1) // align * align
    stride = [padded, 1] if len(size) == 2 else [size[1] * padded, padded, 1]
    return a.new_empty_strided(size, stride, dtype=out_dtype)


def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    return _grouped_output(self, mat2, offs, out_dtype or self.dtype, "_grouped_mm")


def _scaled_grouped_mm(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                       use_fast_accum=False):
    return _grouped_output(self, mat2, offs, out_dtype or torch.bfloat16, "_scaled_grouped_mm")


def _scaled_grouped_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, offs=None,
                          bias=None, out_dtype=None, contraction_dim=(), use_fast_accum=False):
    return _grouped_output(self, mat2, offs, out_dtype or torch.bfloat16, "_scaled_grouped_mm_v2")


# mps_ext's own MoE decode ops (csrc/ops/moe.cpp): output sizes
# depend on shapes alone (the routing is decided on the GPU), so these give
# them exactly.
def _moe_route(logits, top_k, renormalize=True, shared_expert=False, expert_bias=None, sigmoid=False, scale=1.0,
               renorm_eps=0.0):
    tokens, columns = logits.shape
    slots = top_k + (1 if shared_expert else 0)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((tokens, slots), dtype=torch.float32), logits.new_empty((columns,), **i32),
            logits.new_empty((tokens * slots,), **i32), logits.new_empty((tokens * slots,), **i32))


def _moe_experts(x, weight, weight_scale, offs, slot_of_row=None, slots_per_token=1, swiglu=False):
    rows = slot_of_row.shape[0] if slot_of_row is not None else x.shape[0]
    return x.new_empty((rows, weight.shape[1] // 2 if swiglu else weight.shape[1]))


def _moe_combine(y, weights, row_of_slot):
    return y.new_empty((weights.shape[0], y.shape[1]))


# The whole layer (csrc/ops/moe.cpp): [tokens, hidden] in x's dtype.
def _moe_layer(x, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize=True, shared_expert=False,
               expert_bias=None, sigmoid=False, scale=1.0, renorm_eps=0.0, residual=None):
    # Checked here too: a residual on another device (the meta one) makes the dispatcher choose this kernel.
    if residual is not None:
        torch._check(residual.device == x.device and residual.dtype == x.dtype and residual.shape == x.shape
                     and residual.is_contiguous(),
                     lambda: f"moe_layer: residual must be a contiguous tensor of x's shape, dtype and device "
                             f"({list(x.shape)} {x.dtype} on {x.device}), got {list(residual.shape)} "
                             f"{residual.dtype} on {residual.device}"
                             f"{'' if residual.is_contiguous() else ', not contiguous'}")
    return x.new_empty((x.shape[0], down.shape[1]))


# The residual add and post-attention norm with the whole layer
# (csrc/ops/moe.cpp): (h, normed), each x's shape and dtype, contiguous, and
# the layer's output [tokens, hidden] in x's dtype.
def _add_rms_norm_moe_layer(x, residual, norm_weight, eps, variant, router, gate_up, gate_up_scale, down, down_scale,
                            top_k, renormalize=True, shared_expert=False, expert_bias=None, sigmoid=False, scale=1.0,
                            renorm_eps=0.0):
    return (*_add_rms_norm(x, residual, norm_weight, eps, variant), x.new_empty((x.shape[0], down.shape[1])))


# RMSNorm (csrc/ops/norm.cpp): x's shape and dtype, contiguous.
def _rms_norm(x, weight, eps, variant="weight"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# Residual add and RMSNorm (csrc/ops/norm.cpp): (sum, normed), each x's
# shape and dtype, contiguous.
def _add_rms_norm(x, residual, weight, eps, variant="weight"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


# RMSNorm and the linear layer that reads it (csrc/ops/linear.cpp):
# (normed, x's shape and dtype, contiguous; the product [..., N]).
def _rms_norm_linear(x, norm_weight, eps, variant, weight, bias=None):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((*x.shape[:-1], weight.shape[0])))


# ... with an FP8Linear's weight (csrc/ops/scaled_mm.cpp).
def _rms_norm_fp8_linear(x, norm_weight, eps, variant, weight, weight_scale, granularity, bias=None):
    return _rms_norm_linear(x, norm_weight, eps, variant, weight)


# An attention layer's output gate and its o_proj (csrc/ops/linear.cpp):
# the product [..., N] of x [..., K], in x's dtype.
def _sigmoid_gate_linear(x, gate, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# q and k norms and rotary embedding (csrc/ops/norm.cpp): q [B, T, Hq, D]
# and k [B, T, Hk, D] give [B, Hq, T, D] and [B, Hk, T, D] in their dtype,
# contiguous.
def _qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, variant="weight"):
    b, t, hq, d = q.shape
    return q.new_empty((b, hq, t, d)), k.new_empty((b, k.shape[2], t, d))


# qk_norm_rope with the KV cache append (csrc/ops/norm.cpp): q_out as
# _qk_norm_rope's; k's and v's rows written into the caches in place (the
# schema's (a!), (b!)).
def _qk_norm_rope_append(q, k, v, cos, sin, q_weight, k_weight, eps, variant, k_cache, v_cache, start):
    b, t, hq, d = q.shape
    return q.new_empty((b, hq, t, d))


# The attention layer's output gate (csrc/ops/attention_gate.cpp): x's shape and dtype, contiguous.
def _sigmoid_gate(x, gate):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# The KV cache append (csrc/ops/kv_cache.cpp): in place (the schema's (a!), (b!)), nothing returned.
def _kv_append(k_cache, v_cache, k, v, start):
    return None


# A decoded token's attention over the cache (csrc/ops/kv_cache.cpp): [batch, q_heads, 1, head_dim], contiguous.
def _kv_decode_attention(q, k, v, scale):
    return q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3]))


# A Gated DeltaNet decode step (csrc/ops/linear_attention.cpp): the gated
# RMSNorm's output [batch, v_heads * dv] in qkv's dtype; the two states are
# updated in place (the schema's (a!), (b!)).
def _linear_attention_decode(qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias, norm_weight,
                             k_heads, eps):
    return qkv.new_empty((qkv.shape[0], recurrent_state.shape[1] * recurrent_state.shape[3]))


# The Gated DeltaNet prefill core (csrc/ops/linear_attention.cpp): the
# output [batch, tokens, v_heads, dv] in q's dtype and the final float32
# state [batch, v_heads, dk, dv], both new and contiguous.
def _linear_attention_chunk(q, k, v, g, beta, initial_state, use_qk_l2norm):
    batch, tokens, _, dk = q.shape
    v_heads, dv = v.shape[2], v.shape[3]
    return (q.new_empty((batch, tokens, v_heads, dv)),
            q.new_empty((batch, v_heads, dk, dv), dtype=torch.float32))


# An LFM2 conv layer's decode step (csrc/ops/short_conv.cpp): C * conv
# [batch, 1, hidden] in BCx's dtype, contiguous; the window is updated in
# place (the schema's (a!)).
def _short_conv_decode(BCx, conv_state, weight, bias):
    return BCx.new_empty((BCx.shape[0], 1, BCx.shape[2] // 3))


# FP8Experts' prefill product (mps_ext/fp8.py, a Python custom op): rows
# [R, K] @ bank[e]^T of [E, N, K] -> [R, N] bf16, contiguous.
def _fp8_grouped_linear(rows, bank, bank_scale, offs):
    return rows.new_empty((rows.shape[0], bank.shape[1]), dtype=torch.bfloat16)


# mps_ext/stream.py's commit point: no output. Registered as an ordered
# effect too, so that torch.compile neither drops it (an op with no output
# and no mutation is dead code to its graph passes) nor moves it across the
# other effects; the tensor it takes orders it after the work that made it.
def _commit(x):
    return None


def _register_commit_effect() -> None:
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
    except ImportError:  # a torch without effect tokens: compiled graphs may drop the commits, eager keeps them
        return
    _register_effectful_op(torch.ops.mps_ext.commit.default, _EffectType.ORDERED)


def register() -> None:
    for name, fn in [("_scaled_mm", _scaled_mm), ("_scaled_mm_v2", _scaled_mm_v2), ("fp8_linear", _fp8_linear),
                     ("_grouped_mm", _grouped_mm), ("_scaled_grouped_mm", _scaled_grouped_mm),
                     ("_scaled_grouped_mm_v2", _scaled_grouped_mm_v2), ("moe_route", _moe_route),
                     ("moe_experts", _moe_experts), ("moe_combine", _moe_combine), ("moe_layer", _moe_layer),
                     ("add_rms_norm_moe_layer", _add_rms_norm_moe_layer),
                     ("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm), ("rms_norm_linear", _rms_norm_linear),
                     ("rms_norm_fp8_linear", _rms_norm_fp8_linear), ("sigmoid_gate_linear", _sigmoid_gate_linear),
                     ("qk_norm_rope", _qk_norm_rope), ("qk_norm_rope_append", _qk_norm_rope_append),
                     ("sigmoid_gate", _sigmoid_gate),
                     ("kv_append", _kv_append), ("kv_decode_attention", _kv_decode_attention),
                     ("fp8_grouped_linear", _fp8_grouped_linear),
                     ("linear_attention_decode", _linear_attention_decode),
                     ("linear_attention_chunk", _linear_attention_chunk),
                     ("short_conv_decode", _short_conv_decode), ("commit", _commit)]:
        torch.library.register_fake(f"mps_ext::{name}", fn)
    _register_commit_effect()
