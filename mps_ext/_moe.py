"""Fake (Meta) kernels of mps_ext's own mixture-of-experts decode ops
(torch.ops.mps_ext.moe_route, moe_experts, moe_combine; csrc/ops/
grouped_mm_moe.cpp), so that torch.compile and FakeTensor can trace them.

The aten ops mps_ext implements get the aten op's own Meta kernel in C++
(csrc/ops/registration.h); these ops have no aten twin. Written in Python
because tracing with dynamic shapes hands them symbolic sizes. The output
sizes depend on shapes alone, never on values (the routing is decided on the
GPU), so a fake kernel can give them exactly; the checks stay in the real
kernels.
"""

from __future__ import annotations

import torch


def _register() -> None:
    @torch.library.register_fake("mps_ext::moe_route")
    def _moe_route(logits, top_k, renormalize=True, shared_expert=False):
        tokens, columns = logits.shape
        slots = top_k + (1 if shared_expert else 0)
        i32 = dict(dtype=torch.int32, device=logits.device)
        return (logits.new_empty((tokens, slots), dtype=torch.float32), logits.new_empty((columns,), **i32),
                logits.new_empty((tokens * slots,), **i32), logits.new_empty((tokens * slots,), **i32))

    @torch.library.register_fake("mps_ext::moe_experts")
    def _moe_experts(x, weight, weight_scale, offs, slot_of_row=None, slots_per_token=1, swiglu=False):
        rows = slot_of_row.numel() if slot_of_row is not None else x.shape[0]
        n = weight.shape[1] // 2 if swiglu else weight.shape[1]
        return x.new_empty((rows, n))

    @torch.library.register_fake("mps_ext::moe_combine")
    def _moe_combine(y, weights, row_of_slot):
        return y.new_empty((weights.shape[0], y.shape[1]))


_register()
