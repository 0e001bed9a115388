"""A text model's rotary embedding as one gather from a table of its own
outputs, for mps_ext.optimize: the rotary modules of transformers' Qwen3.5
and Qwen3.6-MoE (Qwen3_5MoeTextRotaryEmbedding, with its three mrope
sections), LFM2 and LFM2-MoE (Lfm2RotaryEmbedding, Lfm2MoeRotaryEmbedding)
and the modules of the same structure in other models.

Eager, a decode step computes cos and sin of its positions before the
layers: positions times inv_freq, the mrope sections or a cat, cos, sin,
the attention scaling, casts to the model's dtype: 9 to 13 aten calls and
as many dispatches a token. Here they are one `aten.index` of the step's
rows from a table [2, P, W] (cos, sin) made once, P the config's
max_position_embeddings, in the module's output dtype. The rows ARE the
module's output: the table is the module's own forward called on positions
arange(P) (in chunks, on the model's device), and a probe checks that its
forward on decode-shaped positions (one token and a batch of several, the
mrope sections as the text model passes them) gives the table's rows bit for
bit, or the module is left as it was, with the reason.

Bounds without a sync. A gather at a position >= P would read past the
table, and MPS's index kernel may report that late or not at all (pytorch
issue 178079); a check on the device needs a sync. So the gather runs only
where the host knows the positions: the text model (the module's parent,
class swapped too) makes them itself when its caller gives none,
`arange(T) + past_key_values.get_seq_length()` (a host integer), and its
forward, here, tells the rotary module that bound, past + T, for the one
call it makes; the gather runs when it is <= P. Given position_ids (or a
cache_position), any other call of the module, and a bound above P run the
module's own forward. transformers' generate passes position_ids it made
from the attention mask (cumsum - 1) in every call; where the prompt has no
padding and no earlier cache, those are arange(L) and then one more a step,
exactly the positions the model makes itself, so the model's
`_prepare_position_ids_for_generation` (an attribute of the model object;
its class stays) gives generate None there and the model makes them: one
host check of the mask at the start of generate (a sync; generate makes
the same check itself right after) and no position_ids bookkeeping a step.

The table is a non-persistent buffer (not in the state dict, not saved by
save_pretrained) tagged with the inv_freq, the attention scaling and the
device it was made from: a copy (deepcopy, torch.save and load) keeps it
and its tag; a cast or a move (`.to()`) or another inv_freq (a rope type
that recomputes its frequencies is left: dynamic, longrope) makes the
module drop it and run its own forward; optimize makes it again. A table
above MAX_TABLE_BYTES is not made (the module is left, with the reason).
Under torch.compile the module's forward runs (Inductor fuses it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch
from torch import nn

from ._classes import fused_subclass, original_class, register_maker, register_mixin
from ._protocol import Pass, mismatch

__all__ = ["MAX_TABLE_BYTES", "RotaryPositionsMixin", "RotaryTableMixin", "RotaryTablePass"]

# The most a table may take. Qwen3.6's (262,144 positions of 64 values, cos and sin) is 64 MiB in bfloat16,
# 128 MiB in float32; LFM2.5's (128,000 of 64) 31 MiB in bfloat16.
MAX_TABLE_BYTES = 128 << 20
_TABLE = "_mps_ext_rope_table"
_CHUNK = 8192  # positions a call while the table is made: the forward's float32 temporaries stay a few MB
# What the text model's forward must do to make its own positions (transformers 5's Qwen3.5-MoE, LFM2,
# LFM2-MoE and most decoder models): the bound past + T holds for what it gives its rotary module.
_MAKES_POSITIONS = ("past_seen_tokens = past_key_values.get_seq_length()",
                    "torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens")


@dataclasses.dataclass(frozen=True)
class _Tag:
    """What a table was made from: the objects themselves (a copy of the
    module copies them with it) and their version counters (an in-place
    change of either shows)."""

    inv_freq: torch.Tensor
    inv_version: int
    scaling: float
    table: torch.Tensor
    table_version: int
    device: torch.device

    @staticmethod
    def of(module: nn.Module, table: torch.Tensor) -> _Tag:
        inv = module.inv_freq
        return _Tag(inv, inv._version, module.attention_scaling, table, table._version, table.device)

    def holds(self, module: nn.Module) -> bool:
        inv, table = module._buffers.get("inv_freq"), module._buffers.get(_TABLE)
        return (inv is self.inv_freq and table is self.table and inv._version == self.inv_version
                and table._version == self.table_version and table.device == self.device
                and module.attention_scaling == self.scaling)


def _bind(args: tuple, kwargs: dict) -> tuple | None:
    """(x, position_ids) of a rotary module's call, None for a call of
    another form (transformers': (x, position_ids), by position or name)."""
    names = ("x", "position_ids")
    if len(args) > 2 or any(k not in names for k in kwargs) or any(k in names[:len(args)] for k in kwargs):
        return None
    given = {**dict(zip(names, args)), **kwargs}
    return (given["x"], given["position_ids"]) if len(given) == 2 else None


@register_mixin
class RotaryTableMixin:
    """A rotary embedding whose forward is one gather from its table of its
    own outputs where its text model said the positions are below the
    table's end; its own forward (the next class in the MRO) elsewhere
    (module docstring)."""

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # Inductor fuses the module's own steps (and no bound is given)
            return super().forward(*args, **kwargs)
        # The text model's word holds for its one call: taken here whatever this call runs.
        bound = self.__dict__.pop("_mps_ext_bound", None)
        rows = None if bound is None else self._mps_ext_rows(bound, args, kwargs)
        return super().forward(*args, **kwargs) if rows is None else (rows[0], rows[1])

    def _mps_ext_rows(self, bound: tuple[int, int], args: tuple, kwargs: dict) -> torch.Tensor | None:
        """table[:, positions] ([2, B, T, W]) for this call, or None where
        the module's own forward runs."""
        table = self._mps_ext_table()
        bound_, tokens = bound
        call = _bind(args, kwargs)
        if table is None or call is None or bound_ > table.shape[1]:
            return None
        x, pos = call
        if not (isinstance(x, torch.Tensor) and isinstance(pos, torch.Tensor)) or x.dtype != table.dtype or \
                x.device != table.device or pos.device != table.device or pos.dtype != torch.long or \
                pos.shape[-1] != tokens:
            return None
        if pos.dim() == 3 and pos.shape[0] == self._mps_ext_sections and (pos.shape[0] == 1 or pos.stride(0) == 0):
            pos = pos[0]  # the sections are one row expanded: the module computes that row's positions
        # aten.index: one call, one dispatch (indexing with a slice first would add a slice call)
        return torch.ops.aten.index(table, [None, pos]) if pos.dim() == 2 else None

    def _mps_ext_table(self) -> torch.Tensor | None:
        """The table if it was made from the module's frequencies as they
        are, on this device, else None."""
        tag = self.__dict__.get("_mps_ext_rope_tag")
        return tag.table if tag is not None and tag.holds(self) else None

    def _mps_ext_drop(self) -> None:
        self.__dict__.pop("_mps_ext_rope_tag", None)
        self._buffers.pop(_TABLE, None)

    def _apply(self, fn, recurse=True):
        # A cast or a move gives the table other numbers than the module's own forward would (another dtype,
        # another device's cos and sin): the module runs its own forward until optimize makes it again.
        out = super()._apply(fn, recurse)
        if self._mps_ext_table() is None:
            self._mps_ext_drop()
        return out

    def __getstate__(self):
        state = dict(super().__getstate__())
        if self._mps_ext_table() is None:  # a stale table is not copied
            state.pop("_mps_ext_rope_tag", None)
            state["_buffers"] = {k: v for k, v in state["_buffers"].items() if k != _TABLE}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        tag = self.__dict__.get("_mps_ext_rope_tag")
        if tag is not None:
            # The copy's tensors are new objects with version counters anew: the tag names them (it held when
            # the module was copied: __getstate__). Its device stays the one the table was made on: a load
            # onto another device (map_location) drops the table.
            tag = dataclasses.replace(tag, inv_version=tag.inv_freq._version, table_version=tag.table._version)
            self.__dict__["_mps_ext_rope_tag"] = tag
            if not tag.holds(self):
                self._mps_ext_drop()


@register_mixin
class RotaryPositionsMixin:
    """A text model's forward that tells its rotary module the host bound of
    the positions it makes itself (module docstring); the model's own
    forward (the next class in the MRO) otherwise unchanged."""

    def forward(self, *args, **kwargs):
        bound = None if torch.compiler.is_compiling() else self._mps_ext_bound(args, kwargs)
        if bound is None:
            return super().forward(*args, **kwargs)
        rotary = [getattr(self, a) for a in self._mps_ext_rotary.attributes]  # (Gemma 3: a local and a global)
        for r in rotary:
            r.__dict__["_mps_ext_bound"] = bound
        try:
            return super().forward(*args, **kwargs)
        finally:
            for r in rotary:
                r.__dict__.pop("_mps_ext_bound", None)

    def _mps_ext_bound(self, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        """(past + T, T) where this call makes its own positions arange(T) +
        past, None where its caller gives them (or the call is of another
        form: the model's forward then binds it itself)."""
        names = self._mps_ext_rotary.positional
        if len(args) > len(names) or any(k in names[:len(args)] for k in kwargs):
            return None
        given = {**dict(zip(names, args)), **kwargs}
        if given.get("position_ids") is not None or given.get("cache_position") is not None:
            return None
        embeds, ids = given.get("inputs_embeds"), given.get("input_ids")
        src = embeds if embeds is not None else ids
        if not isinstance(src, torch.Tensor) or src.dim() < 2:
            return None
        seen = _seen(given.get("past_key_values"))  # as the model's forward takes it: a host int
        return None if seen is None else (seen + src.shape[1], src.shape[1])


def _seen(past) -> int | None:
    """The tokens a cache holds, as transformers' models take it
    (get_seq_length(): a host int for its caches); None where that is not a
    host int."""
    if past is None:
        return 0
    count = getattr(past, "get_seq_length", None)
    seen = count() if callable(count) else None
    return seen if type(seen) is int and seen >= 0 else None


@dataclasses.dataclass(frozen=True)
class _ModelPlan:
    attributes: tuple[str, ...]  # the converted rotary modules' names in the text model
    positional: tuple[str, ...]  # the text model's forward's parameters a caller may pass by position


def _table_class(cls: type) -> type:
    return fused_subclass(RotaryTableMixin, cls, f"{cls.__name__} whose forward is one gather from a table of its "
                          "own outputs where its text model makes the positions (mps_ext.optimize).")


def _positions_class(cls: type) -> type:
    made = fused_subclass(RotaryPositionsMixin, cls, f"{cls.__name__} telling its rotary embedding the host bound "
                          "of the positions it makes (mps_ext.optimize).")
    # transformers' output capture (output_router_logits, output_hidden_states, ...) finds what a model records
    # by the name of its class, registered when a model is made (PreTrainedModel.__init__): the made class's
    # too, as a model of the original class would have registered it.
    capture = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capture, "_CAN_RECORD_REGISTRY", None)
    if isinstance(registry, dict) and str(made) not in registry:
        dict.__setitem__(registry, str(made), getattr(cls, "_can_record_outputs", None))
    return made


register_maker(RotaryTableMixin, _table_class)
register_maker(RotaryPositionsMixin, _positions_class)


def _positions_for_generate(model: nn.Module, inputs_tensor, model_kwargs):
    """transformers' GenerationMixin._prepare_position_ids_for_generation,
    but None (the model makes its own) where its positions would be those:
    no earlier cache and no padding, so that they are arange(L) (module
    docstring)."""
    original = type(model)._prepare_position_ids_for_generation
    ids = model_kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 0:
        inputs_tensor = ids  # as transformers' own
    seen = _seen(model_kwargs.get("past_key_values"))
    mask = model_kwargs.get("attention_mask")
    if not isinstance(inputs_tensor, torch.Tensor) or inputs_tensor.dim() < 2 or seen != 0:
        return original(model, inputs_tensor, model_kwargs)
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and
                                 mask.shape[1] == inputs_tensor.shape[1] and bool((mask == 1).all())):
        return original(model, inputs_tensor, model_kwargs)
    return None


def _generation_mixins_own(model: nn.Module) -> bool:
    """Whether `model`'s _prepare_position_ids_for_generation is
    transformers' GenerationMixin's (a model that makes other positions for
    generate, a vision-language model's mrope grid, keeps its own)."""
    owner = next((c for c in type(model).__mro__ if "_prepare_position_ids_for_generation" in c.__dict__), None)
    return owner is not None and owner.__name__ == "GenerationMixin" and \
        owner.__module__ == "transformers.generation.utils"


@dataclasses.dataclass
class _Plan:
    parent: str
    model_plan: _ModelPlan
    table: torch.Tensor
    sections: int  # mrope: the sections its position_ids may hold (one row expanded: the table's rows)
    original: object  # the module's own forward


def _original_forward(module: nn.Module):
    return original_class(type(module)).forward


def _make_table(module: nn.Module, forward, positions: int, dtype: torch.dtype, device) -> torch.Tensor | str:
    """[2, positions, W]: the module's own (cos, sin) of positions
    0..positions-1 in `dtype`, or why not."""
    table = None
    with torch.no_grad():
        for start in range(0, positions, _CHUNK):
            n = min(_CHUNK, positions - start)
            pos = torch.arange(start, start + n, device=device)[None]
            try:
                out = forward(module, torch.empty(1, n, 0, dtype=dtype, device=device), pos)
            except Exception as e:  # noqa: BLE001 - a module that takes other arguments
                return f"its forward raised on positions 0..{positions - 1} ({type(e).__name__}: {e})"
            if not (isinstance(out, tuple) and len(out) == 2 and all(
                    isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == (1, n) and t.dtype == dtype
                    for t in out) and out[0].shape == out[1].shape):
                return (f"its forward does not give (cos, sin) of [batch, positions, width] in the model's dtype "
                        f"({dtype})")
            if table is None:
                table = torch.empty(2, positions, out[0].shape[-1], dtype=dtype, device=device)
            table[0, start:start + n] = out[0][0]
            table[1, start:start + n] = out[1][0]
    return table


def _text_model(model: nn.Module, name: str, module: nn.Module) -> tuple[str, nn.Module] | str:
    parent_name, _, attribute = name.rpartition(".")
    if not name:
        return "it is the model itself"
    parent = model.get_submodule(parent_name) if parent_name else model
    if getattr(parent, attribute, None) is not module:
        return f"its parent does not hold it as {attribute}"
    return parent_name, parent


def _model_plan(parent: nn.Module, attribute: str) -> _ModelPlan | str:
    """What the text model's wrapper needs, or why its forward is not one
    that makes its positions as the bound assumes."""
    forward = original_class(type(parent)).forward
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
        source = inspect.getsource(forward)
    except (TypeError, ValueError, OSError):
        return f"its text model's forward ({type(parent).__name__}) has no signature or source to read"
    names = [p.name for p in params]
    if not all(n in names for n in ("input_ids", "position_ids", "past_key_values", "inputs_embeds")) or \
            not all(line in source for line in _MAKES_POSITIONS):
        return (f"its text model ({type(parent).__name__}) does not make its positions as "
                "arange(T) + past_key_values.get_seq_length() (transformers 5's decoder models do)")
    positional = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    return _ModelPlan((attribute,), positional)


def _dtype_of(parent: nn.Module) -> torch.dtype | None:
    emb = getattr(parent, "embed_tokens", None)
    w = getattr(emb, "weight", None)
    return w.dtype if isinstance(emb, nn.Embedding) and isinstance(w, torch.Tensor) else None


def _is_candidate(m: nn.Module) -> bool:
    return isinstance(m._buffers.get("inv_freq"), torch.Tensor) and \
        isinstance(getattr(m, "attention_scaling", None), (int, float))


class RotaryTablePass(Pass):
    """A text model's rotary embedding (module docstring) -> one gather from
    a table of its own outputs at decode (its class and its text model's
    swapped)."""

    name = "rotary"
    title = "rotary embeddings as one gather from a table of their own cos and sin (eager)"

    def candidates(self, model):
        return [n for n, m in model.named_modules() if isinstance(m, RotaryTableMixin) or _is_candidate(m)]

    def already(self, module):
        return isinstance(module, RotaryTableMixin) and module._mps_ext_table() is not None

    def plan(self, model, name, module):
        if isinstance(module, RotaryTableMixin):  # its table dropped (a cast, a move): made again
            module._mps_ext_drop()
        found = _text_model(model, name, module)
        if isinstance(found, str):
            return found
        parent_name, parent = found
        hooked = [type(m).__name__ for m in (module, parent) if "forward" in m.__dict__]
        if hooked:
            # accelerate's hooks (offload, device maps) call the forward they found: the class's would not run
            return f"a hook replaces the forward of {' and '.join(hooked)}"
        rope_type = getattr(module, "rope_type", "default")
        if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
            return f"its rope type {rope_type!r} recomputes its frequencies from the positions of each call"
        positions = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if type(positions) is not int or positions <= 0:
            return "its config has no max_position_embeddings to size the table"
        inv = module.inv_freq
        if inv.device.type == "meta":
            return "on the meta device: nothing to probe"
        dtype = _dtype_of(parent)
        if dtype is None or not dtype.is_floating_point:
            return f"its text model ({type(parent).__name__}) has no embed_tokens to take the output dtype from"
        size = 2 * positions * 2 * inv.numel() * dtype.itemsize
        if size > MAX_TABLE_BYTES:
            return (f"its table of {positions} positions would take {size / 2**20:.0f} MiB, above the "
                    f"{MAX_TABLE_BYTES >> 20} MiB optimize spends on one")
        model_plan = _model_plan(parent, name.rpartition(".")[2])
        if isinstance(model_plan, str):
            return model_plan
        original = _original_forward(module)
        table = _make_table(module, original, positions, dtype, inv.device)
        if isinstance(table, str):
            return table
        sections = 3 if getattr(module, "mrope_section", None) is not None else 0
        return _Plan(parent_name, model_plan, table, sections, original)

    def probe(self, model, name, module, plan):
        """The module's own forward on decode-shaped positions (one token at
        the table's ends and inside it, a batch of several tokens, mrope's
        sections one row expanded) against the table's rows, bit for bit."""
        table, original = plan.table, plan.original
        p = table.shape[1]
        g = torch.Generator().manual_seed(0)
        cases = [torch.tensor([[q]]) for q in sorted({0, 1, p // 3, p // 2, p - 2, p - 1}) if 0 <= q < p]
        cases.append(torch.randint(0, p, (2, 3), generator=g))
        with torch.no_grad():
            for pos in cases:
                pos = pos.to(table.device)
                x = torch.empty(*pos.shape, 0, dtype=table.dtype, device=table.device)
                calls = [pos] + ([pos[None].expand(plan.sections, -1, -1)] if plan.sections else [])
                rows = torch.ops.aten.index(table, [None, pos])
                for given in calls:
                    try:
                        cos, sin = original(module, x, given)
                    except Exception as e:  # noqa: BLE001 - a module that takes other positions
                        return f"its forward raised on a probe ({type(e).__name__}: {e})"
                    if not (cos.shape == sin.shape == rows.shape[1:] and torch.equal(cos, rows[0])
                            and torch.equal(sin, rows[1])):
                        return mismatch(f"its forward on positions of shape {tuple(given.shape)} differs from its "
                                        "own outputs on arange(P) (it computes a position otherwise in a batch)")
        return None

    def apply(self, model, name, module, plan):
        cls = original_class(type(module))
        module.__class__ = _table_class(cls)
        module._mps_ext_sections = plan.sections
        module.register_buffer(_TABLE, plan.table, persistent=False)
        module.__dict__["_mps_ext_rope_tag"] = _Tag.of(module, plan.table)
        parent = model.get_submodule(plan.parent) if plan.parent else model
        parent.__class__ = _positions_class(original_class(type(parent)))
        earlier = parent.__dict__.get("_mps_ext_rotary")
        attributes = plan.model_plan.attributes
        if earlier is not None:
            attributes = (*(a for a in earlier.attributes if a not in attributes), *attributes)
        parent._mps_ext_rotary = dataclasses.replace(plan.model_plan, attributes=attributes)
        generate = ""
        # Only where generate's model calls the text model with the positions generate gives (a CausalLM over
        # it): a vision-language model makes its own mrope positions from them.
        if _generation_mixins_own(model) and getattr(model, getattr(model, "base_model_prefix", ""), None) is parent:
            model.__dict__["_prepare_position_ids_for_generation"] = functools.partial(_positions_for_generate, model)
            generate = "; generate lets the model make them where the prompt has no padding"
        t = plan.table
        return (f"{cls.__name__} -> one gather from a table of its cos and sin at {t.shape[1]} positions "
                f"({t.numel() * t.element_size() / 2**20:.1f} MiB, {str(t.dtype).removeprefix('torch.')}) where "
                f"{type(parent).__name__} makes its positions itself below that{generate}")

    def witness(self, model, name):
        return model.get_submodule(name)._buffers[_TABLE]
