"""The generate episode that proves the stateful passes' conversions
(_protocol.py): what a user's `model.generate` exercises, run once over the
whole model with every converted cache-using module in shadow.

The episode: a batch of two prompts, the second left-padded, greedy
`generate` of a few tokens (prefill, then decode steps, with the cache the
model makes for itself and the masks it builds), then the cache cropped by
one position (where it can be: assisted decoding and prompt lookup crop it)
and one more decode step on it. Every call of a shadowed module runs
- its fused path with torch's ops in the kernels' place (the module's
  `_mps_ext_fused_call(True, args, kwargs)`: reference ops, wherever the
  kernels would run), on the real arguments,
  so that the episode's cache holds what the fused path leaves in it
  (the KV cache's buffers grow as they do at decode), and its output goes on;
- its own forward (the class it was) on a copy of the arguments' caches;
and compares the two: outputs, then every attribute of the caches
(tensors by value). A module whose fused path does not take any call of
the episode, or that differs once, is reported with the first difference.

Anything but a transformers model with `generate` and a config cannot be
run so: its stateful conversions are reported as unproved, and reverted.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import torch
from torch import nn

from ._classes import original_class
from ._protocol import _exact

PROMPT = 5      # tokens of each prompt (the second: 2 of them padding)
NEW_TOKENS = 3  # greedy tokens generated before the crop


def _is_cache(obj) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return False
    return isinstance(obj, Cache)


def _copy_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args and kwargs with each cache (at the top level) deep-copied, once
    (one object passed under two names stays one)."""
    memo: dict = {}

    def one(v):
        return copy.deepcopy(v, memo) if _is_cache(v) else v

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _caches(args: tuple, kwargs: dict) -> list:
    seen, out = set(), []
    for v in (*args, *kwargs.values()):
        if _is_cache(v) and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def difference(want, got, tolerance: float, where: str = "output", _depth: int = 0) -> str | None:
    """None if `got` is `want` (tensors equal, or within `tolerance` of the
    largest magnitude when it is not 0), else where they first differ.
    Lists, tuples, dicts and objects' attributes are compared member by
    member (mps_ext's own bookkeeping, `_mps_ext_*`, apart)."""
    if _depth > 6:
        return None
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{where}: a {type(want).__name__} against a {type(got).__name__}"
        if want.shape != got.shape or want.dtype != got.dtype:
            return f"{where}: shape {tuple(want.shape)} {want.dtype} against {tuple(got.shape)} {got.dtype}"
        if want.is_floating_point() and tolerance:
            w, g = _exact(want), _exact(got)
            scale = float(w.abs().max()) if w.numel() else 0.0
            err = float((w - g).abs().max()) if w.numel() else 0.0
            ok = bool(torch.equal(w.isnan(), g.isnan())) and (err <= tolerance * scale or err == 0.0)
            return None if ok else f"{where}: relative difference {err / max(scale, 1e-30):.3g} (bound {tolerance:g})"
        if not torch.equal(want, got):
            same_nan = want.is_floating_point() and bool(torch.equal(want.isnan(), got.isnan())) and \
                bool(torch.equal(want.nan_to_num(), got.nan_to_num()))
            if not same_nan:
                return f"{where}: other values"
        return None
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(want) != len(got):
            return f"{where}: {type(want).__name__} of {len(want)} against {type(got).__name__}"
        for i, (w, g) in enumerate(zip(want, got)):
            d = difference(w, g, tolerance, f"{where}[{i}]", _depth + 1)
            if d:
                return d
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or want.keys() != got.keys():
            return f"{where}: keys {sorted(map(str, want))} against {sorted(map(str, got)) if isinstance(got, dict) else got}"  # noqa: E501
        for k in want:
            d = difference(want[k], got[k], tolerance, f"{where}[{k!r}]", _depth + 1)
            if d:
                return d
        return None
    if want is None or isinstance(want, (bool, int, float, str)):
        return None if want == got or (want != want and got != got) else f"{where}: {want!r} against {got!r}"
    if _is_cache(want) or hasattr(want, "__dict__") and type(want).__module__.startswith("transformers"):
        if type(want) is not type(got):
            return f"{where}: a {type(want).__name__} against a {type(got).__name__}"
        wv = {k: v for k, v in vars(want).items() if not k.startswith("_mps_ext")}
        gv = {k: v for k, v in vars(got).items() if not k.startswith("_mps_ext")}
        return difference(wv, gv, tolerance, f"{where}.{type(want).__name__}", _depth + 1)
    return None  # anything else (a config, a function): not state a layer leaves


class _Shadow:
    """The episode's stand-in forward of one converted module."""

    def __init__(self, module: nn.Module, tolerance: float):
        self.module, self.tolerance = module, tolerance
        self.taken, self.calls, self.first = 0, 0, None
        self.own = module.__dict__.get("forward")  # an instance forward (a hook's) stays where it was

    def __call__(self, *args, **kwargs):
        m = self.module
        self.calls += 1
        theirs = _copy_caches(args, kwargs)
        call = m._mps_ext_fused_call(True, args, kwargs)
        original = original_class(type(m)).forward
        if call is None:
            return original(m, *args, **kwargs)
        self.taken += 1
        got = call()
        want = original(m, *theirs[0], **theirs[1])
        if self.first is None:
            d = difference(want, got, self.tolerance)
            if d is None:
                for i, (w, g) in enumerate(zip(_caches(*theirs), _caches(args, kwargs))):
                    d = difference(w, g, self.tolerance, f"cache {i}")
                    if d:
                        d = f"the cache it leaves differs: {d}"
                        break
            if d:
                self.first = f"call {self.calls}: {d}"
        return got


@contextlib.contextmanager
def _quiet():
    logs = [logging.getLogger(n) for n in ("transformers", "transformers.generation.utils")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _why_no_episode(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if not (callable(getattr(model, "generate", None)) and config is not None):
        return (f"{type(model).__name__} has no generate: optimize proves the layers that use a cache in a "
                "generate episode, so call it on the model with its LM head (AutoModelForCausalLM)")
    if any(p.device.type == "meta" for p in model.parameters()):
        return "parameters on the meta device (offloaded): the episode cannot run them"
    return None


def _forward_step(model, ids, mask, cache):
    import inspect
    params = inspect.signature(model.forward).parameters
    key = "past_key_values" if "past_key_values" in params or "cache" not in params else "cache"
    return model(input_ids=ids, attention_mask=mask, use_cache=True, **{key: cache})


def run_episode(model: nn.Module, modules: dict[str, tuple[nn.Module, float]]) -> dict[str, str]:
    """{name: why} for each of `modules` ({name: (module, tolerance)}) the
    episode does not prove (module docstring); {} when all hold."""
    why = _why_no_episode(model)
    if why:
        return {name: f"not proved in a generate episode: {why}" for name in modules}
    shadows = {name: _Shadow(m, tol) for name, (m, tol) in modules.items()}
    param = next(model.parameters())
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 4:
        return {name: "not proved in a generate episode: the config has no vocabulary size" for name in modules}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (2, PROMPT), generator=g).to(param.device)
    mask = torch.ones(2, PROMPT, dtype=torch.long, device=param.device)
    mask[1, :2] = 0
    training = [(m, m.training) for m in model.modules()]
    model.train(False)
    for s in shadows.values():
        s.module.forward = s
    failed: dict[str, str] = {}
    try:
        with torch.no_grad(), _quiet():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, use_cache=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            cache = getattr(out, "past_key_values", None)
            crop = getattr(cache, "crop", None)
            if cache is not None and callable(crop):
                n = int(cache.get_seq_length())
                try:
                    crop(n - 1)
                except Exception:  # noqa: BLE001 - a cache of recurrent states cannot crop: no crop then
                    pass
                else:
                    step_mask = torch.cat([mask, mask.new_ones(2, n - PROMPT)], 1)
                    _forward_step(model, out.sequences[:, n - 1:n], step_mask, cache)
    except Exception as e:  # noqa: BLE001 - the model's own generate raised: nothing is proved
        failed = {name: f"the generate episode raised ({type(e).__name__}: {e})" for name in modules}
    finally:
        for s in shadows.values():
            if s.own is None:
                s.module.__dict__.pop("forward", None)
            else:
                s.module.forward = s.own
        for m, t in training:
            m.training = t
    for name, s in shadows.items():
        if name in failed:
            continue
        if s.first:
            failed[name] = f"it differs from its own forward in a generate episode ({s.first})"
        elif not s.taken:
            failed[name] = (f"its fused path took none of its {s.calls} calls in a generate episode (prefill, "
                            "decode, crop): the calls this model makes are not the ones it knows")
    return failed
