"""Projections that read the same input as one linear layer, for
`mps_ext.optimize(model)`.

At decode each projection is a GEMV of its own: a host call and a dispatch
on a Mac, and a decoder layer has several that read the same tensor:
attention's q_proj, k_proj and v_proj (Qwen3.5/3.6's q_proj carries the
output gate too), Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b and
in_proj_a (Qwen3-Next's in_proj_qkvz and in_proj_ba), an MLP's gate_proj and
up_proj (LFM2's w1 and w3). `fuse_projections` concatenates each such
group's weights once, by rows, into one nn.Linear (or FP8Linear) on the
group's parent, named after the group (qkv_proj, in_proj_qkvzba,
gate_up_proj, w13), and puts a ProjectionRows in each member's place: the
first member called runs the fused layer (one GEMV: the input read once, one
host call, one dispatch) and returns its rows as a view of the output; the
others, called with the same tensor, return theirs from that output without
a call. Views of one output are not contiguous (a row's stride is the fused
width): the models' own code reshapes them with view(), which keeps the last
dimension, and mps_ext's decode ops take row strides.

The groups are known by their members' names, as transformers names them;
the model's forward decides what each reads. So every call checks that a
member's input is the very tensor (`is`) the group's output was computed
from: when it is not, the fused layer runs again for that input (the
result is still each member's own product). A group whose members are
twice found reading different tensors before all took their rows (a
cross-attention's k_proj and v_proj read the encoder's states; a cached
cross-attention calls q_proj alone) stops sharing: each member then runs
its own rows of the fused weight (the same kernels on a view).

Concatenated: members of one kind only. Floating nn.Linear layers of one
dtype, with biases or all without. FP8Linear (mps_ext.quantize_fp8) with a
scale per row or one per tensor: the fused layer has a scale per row (a
tensor scale is repeated over its rows: the same products). FP8Linear with
128x128 block scales: members whose rows are a multiple of 128 (and one
other, last), so that no block straddles two members. Members of other
kinds in a group (a projection quantize_fp8's filter left in bf16) are
fused among themselves if two or more, or stay as they were; the summary
says which.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from ..fp8 import BLOCK, FP8Linear, fp8_linear
from ._protocol import Pass, _exact, mismatch
from ._runtime import kernels_for

__all__ = ["GROUPS", "ProjectionRows", "ProjectionsPass", "norm_into_projection"]

# Members of a group, in the order their rows are stacked (the order the
# models call them).
GROUPS = (("q_proj", "k_proj", "v_proj"),
          ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
          ("in_proj_qkvz", "in_proj_ba"),
          ("gate_proj", "up_proj"),
          ("w1", "w3"))
# After this many times a group's output was computed anew before its
# members all took their rows, the members are taken not to share their
# input. Two, not one: a forward interrupted between two members (an
# exception, a KeyboardInterrupt in generate) leaves one such output.
_MISSES_BEFORE_APART = 2


class _Memo:
    """A group's last fused output, shared by its ProjectionRows: `last`,
    (the input it was computed from, the outputs as views); which members
    have taken theirs; and whether the members share their input at all."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes
        self.last = None
        self.taken = (True,) * len(sizes)
        self.misses = 0
        self.shared = True
        self.handed = False  # `last` is norm_into_projection's, not a member's


class ProjectionRows(nn.Module):
    """Rows [start, stop) of the fused projection `parent.<fused_name>`,
    in the place of the projection they were: forward(x) -> x @
    weight[start:stop]^T (+ bias rows), a view of the fused layer's output
    when the group's members read the same tensor (module docstring).
    `weight` and `bias` are views of the fused layer's; it holds no
    parameters of its own (the state dict holds the fused layer's)."""

    def __init__(self, parent: nn.Module, fused_name: str, index: int, start: int, stop: int, in_features: int,
                 memo: _Memo):
        super().__init__()
        # The parent holds the fused layer; it is looked up by name at each call, so that a later
        # quantize_fp8 (which replaces the fused nn.Linear by an FP8Linear) is followed. Not a child:
        # the module tree would loop.
        object.__setattr__(self, "_parent", parent)
        self.fused_name, self.index, self.start, self.stop = fused_name, index, start, stop
        self.in_features, self.out_features = in_features, stop - start
        self._memo = memo

    @property
    def fused(self) -> nn.Module:
        return getattr(self._parent, self.fused_name)

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.weight[self.start:self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self.fused.bias
        return None if b is None else b[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._memo
        if not m.shared:
            return self._own_rows(x)
        # One read of (input, outputs): the rows returned are always from an output of this very input,
        # also when threads share the model (the bookkeeping below may then only cost a recomputation).
        last = m.last
        if last is None or last[0] is not x or m.taken[self.index]:
            # (A product norm_into_projection handed over that the mixer did not read is no sign that
            # the members read different tensors.)
            if not all(m.taken) and not m.handed:
                m.misses += 1
                if m.misses >= _MISSES_BEFORE_APART:
                    m.shared, m.last = False, None
                    return self._own_rows(x)
            last = (x, self.fused(x).split(m.sizes, -1))
            m.last, m.taken, m.handed = last, (False,) * len(m.sizes), False
        taken = tuple(t or i == self.index for i, t in enumerate(m.taken))
        m.taken = taken
        if all(taken):  # the group's output is not held past its last member
            m.last = None
            m.misses = 0
        return last[1][self.index]

    def _own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This member's product alone, from the fused layer's rows."""
        f, start, stop = self.fused, self.start, self.stop
        if not isinstance(f, FP8Linear):
            return F.linear(x, f.weight[start:stop], self.bias)
        scale = f.weight_scale
        if f.granularity == "row":
            scale = scale[start:stop]
        elif f.granularity == "block":
            if start % BLOCK:  # quantize_fp8(granularity="block") after optimize: a block across members
                return f(x)[..., start:stop]
            scale = scale[start // BLOCK:-(-stop // BLOCK)]
        return fp8_linear(x, f.weight[start:stop], scale, f.granularity, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}: rows {self.start}:{self.stop} "
                f"of {self.fused_name}")


# ------------------------------------------------------------------ planning --
# The groups that read a decoder layer's input norm (its mixer's
# projections), by their first member: norm_into_projection's.
_MIXER_GROUPS = ("q_proj", "in_proj_qkv", "in_proj_qkvz")
# rms_norm_linear's and rms_norm_fp8_linear's bounds (csrc/ops/norm.cpp,
# gemv_norms_rows): kMaxDecodeRows rows, and the normed rows' bytes a
# threadgroup keeps (linear_params.h: RMS_GEMV_NORMED_BYTES).
_NORMED_ROWS, _NORMED_BYTES = 8, 8192


def norm_into_projection(x: torch.Tensor, norm: nn.Module, mixer: nn.Module) -> torch.Tensor:
    """norm(x), a decoder layer's input norm, for `mixer`, its attention,
    linear attention or short convolution: where the projection that reads
    it first -- the mixer's fused q/k/v (or in_proj) group, or the short
    convolution's in_proj (a mixer with _mps_ext_takes_product, whose
    caller has asked it that this call runs its decode step) -- is a
    floating nn.Linear (or an FP8Linear of mps_ext.quantize_fp8) that
    mps_ext's GEMV runs at these rows (decode), the norm and that GEMV are
    one torch.ops.mps_ext.rms_norm_linear (rms_norm_fp8_linear) dispatch.
    Its product is handed over as the projection of the normed tensor
    returned: to the group's _Memo, as its first member would leave it (the
    mixer's projections of that tensor then take their rows of it with no
    call), or to the short convolution's step. Each op is bit for bit the
    norm, then the layer's F.linear (fp8_linear) (csrc/ops/linear.cpp,
    scaled_mm.cpp). Elsewhere norm(x); so too with autograd recording (the
    ops have no backward)."""
    first = next((m for m in (getattr(mixer, n, None) for n in _MIXER_GROUPS) if isinstance(m, ProjectionRows)), None)
    if first is not None and first._memo.shared:
        done = _norm_and_product(x, norm, first.fused)
        if done is None:
            return norm(x)
        normed, y = done
        m = first._memo
        m.last, m.taken, m.handed = (normed, y.split(m.sizes, -1)), (False,) * len(m.sizes), True
        return normed
    if first is None and hasattr(mixer, "_mps_ext_takes_product"):
        done = _norm_and_product(x, norm, mixer.in_proj)
        if done is None:
            return norm(x)
        mixer.__dict__["_mps_ext_in_proj_product"] = done  # (normed, y): the step takes y for normed
        return done[0]
    return norm(x)


def _norm_and_product(x: torch.Tensor, norm: nn.Module, layer: nn.Module) -> tuple | None:
    """(norm(x), layer(norm(x))) in one rms_norm_linear (rms_norm_fp8_linear)
    dispatch, or None where those ops do not take the call."""
    if not hasattr(norm, "op_takes") or not norm.op_takes(x, compiled=True):
        return None
    w, b = getattr(layer, "weight", None), getattr(layer, "bias", None)
    rows = x.numel() // max(x.shape[-1], 1)
    fp8 = type(layer) is FP8Linear
    if fp8:
        b = b.to(x.dtype) if b is not None and b.dtype != x.dtype else b  # (fp8_linear's cast)
        takes = w.stride(-1) == 1 and kernels_for(x, "scaled_mm")
    else:
        takes = type(layer) is nn.Linear and w.dtype == x.dtype and w.stride(-1) == 1 and kernels_for(x, "linear")
    if (not takes or rows > _NORMED_ROWS or rows * x.shape[-1] * x.element_size() > _NORMED_BYTES
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                             or (b is not None and b.requires_grad)))):
        return None
    if fp8:
        return torch.ops.mps_ext.rms_norm_fp8_linear(x, norm.weight, norm.eps, norm.variant, w, layer.weight_scale,
                                                     layer.granularity, b)
    return torch.ops.mps_ext.rms_norm_linear(x, norm.weight, norm.eps, norm.variant, w, b)


def _kind(m: nn.Module) -> tuple | str:
    """What a member is stored as: members of equal kinds concatenate; a
    str says why a member cannot be fused."""
    if type(m) is nn.Linear:
        return ("linear", m.weight.dtype, m.weight.device, m.in_features,
                None if m.bias is None else m.bias.dtype)
    if type(m) is FP8Linear:
        return ("fp8", "block" if m.granularity == "block" else "row", m.weight.device, m.in_features,
                None if m.bias is None else m.bias.dtype)
    return f"a {type(m).__name__}, not nn.Linear or FP8Linear"


def _block_members(members: list[tuple[str, nn.Module]]) -> tuple[list, list]:
    """(fused, left) of block-scaled members: those whose rows are a
    multiple of BLOCK, then one other last (no block straddles two)."""
    aligned = [(n, m) for n, m in members if m.out_features % BLOCK == 0]
    other = [(n, m) for n, m in members if m.out_features % BLOCK]
    return aligned + other[:1], other[1:]


def _fused_name(parent: nn.Module, names: list[str]) -> str:
    """qkv_proj for q_proj, k_proj, v_proj; in_proj_qkvzba; gate_up_proj;
    w13: the members' names without their common prefix and suffix, joined
    between them ("_" when a part is longer than 3 characters)."""
    pre = 0
    while all(len(n) > pre for n in names) and len({n[pre] for n in names}) == 1:
        pre += 1
    suf = 0
    while all(len(n) - pre > suf for n in names) and len({n[len(n) - suf - 1] for n in names}) == 1:
        suf += 1
    parts = [n[pre:len(n) - suf] for n in names]
    name = names[0][:pre] + ("_" if any(len(p) > 3 for p in parts) else "").join(parts) + names[0][len(names[0]) - suf:]
    while hasattr(parent, name):
        name += "_fused"
    return name


def _concatenate(members: list[nn.Module]) -> nn.Module:
    """One nn.Linear or FP8Linear holding the members' rows in order."""
    first = members[0]
    k, n = first.in_features, sum(m.out_features for m in members)
    bias = None
    if first.bias is not None:
        bias = nn.Parameter(torch.cat([m.bias.detach() for m in members]),
                            requires_grad=any(m.bias.requires_grad for m in members))
    if isinstance(first, FP8Linear):
        granularity = "block" if first.granularity == "block" else "row"
        # On the meta device first: the buffers are the concatenated ones, not a second allocation.
        fused = FP8Linear(k, n, False, granularity, device="meta")
        fused.weight = torch.cat([m.weight for m in members])
        if granularity == "block":
            fused.weight_scale = torch.cat([m.weight_scale for m in members])
        else:  # a tensor scale repeated over its rows: the same de-quantised weight
            fused.weight_scale = torch.cat([m.weight_scale.reshape(-1, 1).expand(m.out_features, 1)
                                            for m in members]).contiguous()
    else:
        fused = nn.Linear(k, n, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]),
                                    requires_grad=any(m.weight.requires_grad for m in members))
    fused.bias = bias
    fused.train(first.training)
    return fused


def _describe(names: list[str], members: list[nn.Module], fused: nn.Module) -> str:
    what = (f"FP8Linear, {fused.granularity} scales" if isinstance(fused, FP8Linear) else
            f"Linear, {str(fused.weight.dtype).replace('torch.', '')}")
    tensor = [n for n, m in zip(names, members) if isinstance(m, FP8Linear) and m.granularity == "tensor"]
    return (f"{', '.join(names)} -> one {what} [{fused.out_features}, {fused.in_features}]"
            + (f" ({', '.join(tensor)}: tensor scale repeated per row)" if tensor else ""))


# ------------------------------------------------------------------ the state dict --
# The parent's state dict keeps the members' names and tensors (save_pretrained writes what from_pretrained
# reads into the unfused model): each member's rows of the fused weight (bias, scales) under its own name,
# and load_state_dict takes them back into the fused layer.
def _member_entries(fused: nn.Module, member: dict) -> dict:
    """The member's state-dict entries ({suffix: tensor}) from the fused
    layer's: its rows of the weight and bias, and of its scales in the
    shape the member had (views)."""
    start, stop = member["rows"]
    out = {"weight": fused.weight[start:stop]}
    if fused.bias is not None:
        out["bias"] = fused.bias[start:stop]
    if isinstance(fused, FP8Linear):
        scale = fused.weight_scale
        if fused.granularity == "block":
            scale = scale[start // BLOCK:-(-stop // BLOCK)]
        elif fused.granularity == "tensor":  # quantize_fp8 after optimize: one scale, each member's own copy
            scale = scale.clone()  # (safetensors refuses one tensor under several names)
        else:
            scale = scale[start:stop]
            if member["scale_shape"] not in (None, tuple(scale.shape)):  # a tensor scale, repeated when fused
                scale = scale[0].reshape(member["scale_shape"])
        out["weight_scale"] = scale
    return out


def _state_dict_hook(fused_name: str, members: dict, module, state_dict, prefix, local_metadata):
    fused = getattr(module, fused_name)
    for key in [k for k in state_dict if k.startswith(f"{prefix}{fused_name}.")]:
        del state_dict[key]
    for name, member in members.items():
        for suffix, t in _member_entries(fused, member).items():
            state_dict[f"{prefix}{name}.{suffix}"] = t.detach()


def _load_hook(fused_name: str, members: dict, module, state_dict, prefix, *args):
    names = [f"{prefix}{n}.weight" for n in members]
    if not all(k in state_dict for k in names):
        return  # the fused layer's own names, or nothing of this group: torch's own load says what is missing
    fused = getattr(module, fused_name)
    for suffix in ("weight", "bias", "weight_scale"):
        keys = [f"{prefix}{n}.{suffix}" for n in members]
        if not any(k in state_dict for k in keys):
            continue
        parts = [state_dict.pop(k) for k in keys]
        if suffix == "weight_scale" and fused.granularity != "block":
            parts = [t.reshape(-1, 1).expand(m["rows"][1] - m["rows"][0], 1) for t, m in zip(parts, members.values())]
        state_dict[f"{prefix}{fused_name}.{suffix}"] = torch.cat(parts)


def _offloaded(m: nn.Module) -> bool:
    """Weights accelerate loads at call time (a hook, the meta device): a
    concatenation of them now would hold nothing the hook ever fills."""
    return hasattr(m, "_hf_hook") or any(p.device.type == "meta" for p in m.parameters())


class _ProjPlan:
    """The groups of one parent to fuse ([member names], each one kind) and
    what is left of the parent's groups, with why ({'parent.{members}': why})."""

    def __init__(self):
        self.groups: list[list[str]] = []
        self.left: dict[str, str] = {}


class ProjectionsPass(Pass):
    """Projections that read one input (module docstring) -> one linear
    layer, its members ProjectionRows."""

    name = "projections"
    title = "groups of projections that read one input as one layer each (one GEMV at decode)"
    # The MoE pass takes a shared expert's gate_proj and up_proj as they are, and the Gated DeltaNet pass
    # recognises its layers by their four input projections.
    after = ("moe", "linear_attention")

    def candidates(self, model):
        out = []
        for pname, parent in model.named_modules():
            children = dict(parent.named_children())
            if any(sum(n in children for n in group) >= 2 for group in GROUPS):
                out.append(pname)
        return out

    def already(self, module):
        children = dict(module.named_children())
        present = [children[n] for group in GROUPS for n in group if n in children]
        return bool(present) and all(isinstance(m, ProjectionRows) for m in present)

    def plan(self, model, name, parent):
        plan = _ProjPlan()
        children = dict(parent.named_children())
        where = f"{name}.{{}}" if name else "{}"
        for group in GROUPS:
            present = [n for n in group if n in children]
            if len(present) < 2 or any(isinstance(children[n], ProjectionRows) for n in present):
                continue  # (fused apart before, under another group of these names: left as it is)
            hooked = [n for n in present if children[n]._forward_hooks or children[n]._forward_pre_hooks]
            if hooked:  # a fused member's hooks would see a call that computes nothing
                plan.left[where.format(", ".join(present))] = f"forward hooks on {', '.join(hooked)}"
                continue
            viewed = [n for n in present if "_mps_ext_view_of" in children[n].__dict__]
            if viewed:
                what = children[viewed[0]].__dict__["_mps_ext_view_of"]
                plan.left[where.format(", ".join(present))] = f"{', '.join(viewed)}: views of {what}"
                continue
            offloaded = [n for n in present if _offloaded(children[n])]
            if offloaded:
                plan.left[where.format(", ".join(present))] = \
                    f"{', '.join(offloaded)} offloaded (accelerate's hook or the meta device): nothing to concatenate"
                continue
            classes: dict = {}
            why = []
            for n in present:
                kind = _kind(children[n])
                if isinstance(kind, str):
                    why.append(f"{n} is {kind}")
                else:
                    classes.setdefault(kind, []).append(n)
            single = []
            for kind, members in classes.items():
                if kind[1] == "block":
                    members, apart = _block_members([(n, children[n]) for n in members])
                    members, apart = [n for n, _ in members], [n for n, _ in apart]
                    if apart:
                        why.append(f"{', '.join(apart)}: 128x128 block scales whose rows are not a multiple of "
                                   f"{BLOCK} (a block would straddle two projections)")
                if len(members) >= 2:
                    plan.groups.append(members)
                elif members and len(classes) > 1:
                    single.append(f"{members[0]} ({_kind_text(kind)})")
            if single:
                why.append(f"stored differently, not concatenated: {', '.join(single)}")
            if why:
                plan.left[where.format(", ".join(present))] = "; ".join(why)
        return plan

    def probe(self, model, name, parent, plan):
        """Each member's product against its rows of the concatenation, on a
        probe input (within the float rounding of another summation order:
        a CPU GEMM may sum in another order for another row count)."""
        for members in plan.groups:
            mods = [getattr(parent, n) for n in members]
            w = mods[0].weight
            dtype = w.dtype if w.is_floating_point() and w.element_size() > 1 else torch.bfloat16
            x = torch.randn(3, mods[0].in_features, generator=torch.Generator().manual_seed(0)).to(w.device, dtype)
            with torch.no_grad():
                fused = _concatenate(mods)
                rows = fused(x).split([m.out_features for m in mods], -1)
                for n, m, got in zip(members, mods, rows):
                    want = m(x)
                    err = float((_exact(got) - _exact(want)).abs().max() /
                                _exact(want).abs().max().clamp_min(1e-30))
                    if not err <= (1e-5 if dtype == torch.float32 else 2e-2):
                        return mismatch(f"{n}'s product differs from its rows of the concatenation on a probe "
                                        f"(relative error {err:.2g}): it is not a plain linear layer")
            del fused
        return None

    def apply(self, model, name, parent, plan):
        out = {}
        for names in plan.groups:
            mods = [getattr(parent, n) for n in names]
            fused = _concatenate(mods)
            fname = _fused_name(parent, names)
            parent.add_module(fname, fused)
            memo = _Memo(tuple(m.out_features for m in mods))
            start, members = 0, {}
            for i, (n, m) in enumerate(zip(names, mods)):
                rows = ProjectionRows(parent, fname, i, start, start + m.out_features, m.in_features, memo)
                rows.train(m.training)
                setattr(parent, n, rows)
                members[n] = {"rows": (start, start + m.out_features),
                              "scale_shape": tuple(m.weight_scale.shape) if isinstance(m, FP8Linear) else None}
                start += m.out_features
            parent.register_state_dict_post_hook(functools.partial(_state_dict_hook, fname, members))
            parent.register_load_state_dict_pre_hook(functools.partial(_load_hook, fname, members))
            out[f"{name}.{fname}" if name else fname] = _describe(names, mods, fused)
            del mods, fused  # the members' own weights go with them
        return out

    def witness(self, model, name):
        return model.get_submodule(name).weight  # (the fused layer's: the summary names it)


def _kind_text(kind: tuple) -> str:
    what = f"FP8Linear, {kind[1]} scales" if kind[0] == "fp8" else f"Linear, {str(kind[1]).replace('torch.', '')}"
    return f"{what}, {kind[3]} inputs" + (", with a bias" if kind[4] is not None else "") + \
        ("" if kind[2].type == "cpu" else f", on {kind[2]}")
