"""The modules :func:`fusible_ops.convert` puts in a model's place: norms and MLPs made of fusible ops,
whose ``state_dict()`` is the original module's (same keys, in the same order, shapes and dtypes).

* :class:`ConvertedRMSNorm`, :class:`ConvertedLayerNorm`: ``fo.RMSNorm`` / ``fo.LayerNorm`` holding the
  original ``weight`` (and ``bias``) Parameter objects.
* :class:`ConvertedMLP`: a ``fo.Sequential`` whose children keep the original attribute names
  (``fc1``, ``act``, ``fc2``; ``0``, ``1``, ``2``; ``down_proj``...), so its parameter names are the
  original ones. A plain MLP's linears hold the original Parameter objects. A gated MLP's gate and
  up projections become ONE ``fo.Linear`` ``gate_up_proj`` with weight ``[2f, d]`` (gate rows first,
  then up: the gated ops activate the first half), a new Parameter; state-dict hooks split it back
  into the original two keys on ``state_dict()`` (views of the fused tensor) and join the two on
  ``load_state_dict()``. The replaced gate and up Parameters are *retired*: an optimizer that still
  holds one raises at its next ``step()`` (see :func:`retire`).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from ..ops.activation import GEGLU, GELU, ReGLU, ReLU, SiLU, SwiGLU
from ..ops.linear import Linear
from ..ops.norm import LayerNorm, RMSNorm
from ..quantization.recipes import autocast
from ..sequential import Sequential

_LOW = (torch.bfloat16, torch.float16)

GATED_OPS = {"silu": SwiGLU, "gelu": GEGLU, "gelu_tanh": lambda: GEGLU("tanh"), "relu": ReGLU}
"""The gated fusible op (a fresh instance from calling the entry) for each activation name of
:data:`~fusible_ops.convert.probe.ACTIVATIONS`: ``act(a) * b`` of the halves ``a, b`` of its input."""
PLAIN_OPS = {"silu": SiLU, "gelu": GELU, "gelu_tanh": lambda: GELU("tanh"), "relu": ReLU}
"""The plain fusible op for each activation name."""


class _ConvertedNorm:
    """What both converted norms add to the fusible norm they subclass: where the original came
    from, and its output dtype for a 16-bit input with float32 parameters (``out_dtype_rule``,
    found by :func:`~fusible_ops.convert.probe.probe_norm`)."""

    def _setup(self, params: dict, source: str, out_dtype_rule: Optional[str]) -> None:
        for name, p in params.items():
            setattr(self, name, p)  # the original Parameter objects: same tensors, same optimizer state
        self.__dict__["source"] = source
        self.__dict__["out_dtype_rule"] = out_dtype_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The fused norm; a 16-bit input with float32 parameters, where the original returned
        float32 (``out_dtype_rule == "promote"``, Hugging Face's ``weight * x.to(input_dtype)``),
        runs that formula in plain PyTorch so the result has the original's dtype and rounding."""
        w = self.weight
        if self.out_dtype_rule == "promote" and x.dtype in _LOW and w.dtype == torch.float32:
            return self._promoted(x)
        return super().forward(x)


class ConvertedRMSNorm(_ConvertedNorm, RMSNorm):
    """``fo.RMSNorm`` in place of a module that computes ``x / sqrt(mean(x^2) + eps) * weight`` (a
    ``torch.nn.RMSNorm`` or a Hugging Face ``*RMSNorm``); holds the original ``weight``."""

    def __init__(self, weight: torch.nn.Parameter, eps: float, *, source: str = "",
                 out_dtype_rule: Optional[str] = None) -> None:
        super().__init__(weight.shape[0], eps, device="meta", dtype=weight.dtype)
        self._setup({"weight": weight}, source, out_dtype_rule)

    def _promoted(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class ConvertedLayerNorm(_ConvertedNorm, LayerNorm):
    """``fo.LayerNorm`` in place of a module that computes a LayerNorm with weight and bias;
    holds the original ``weight`` and ``bias``."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter, eps: float, *, source: str = "",
                 out_dtype_rule: Optional[str] = None) -> None:
        super().__init__(weight.shape[0], eps, device="meta", dtype=weight.dtype)
        self._setup({"weight": weight, "bias": bias}, source, out_dtype_rule)

    def _promoted(self, x):
        return F.layer_norm(x.float(), (self.size,), self.weight, self.bias, self.eps)


def linear_holding(weight: torch.nn.Parameter, bias: Optional[torch.nn.Parameter]) -> Linear:
    """A ``fo.Linear`` whose parameters are ``weight`` [out, in] and ``bias`` (the given objects)."""
    out_f, in_f = weight.shape
    lin = Linear(in_f, out_f, bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    return lin


def has_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` has module hooks (a replacement would lose them)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def copy_plain_attributes(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Give ``new`` the plain attributes of ``old`` that other code may read (``config``, sizes,
    flags: ints, floats, strings, bools) which ``new`` does not have."""
    for k, v in old.__dict__.items():
        if not k.startswith("_") and k != "training" and not hasattr(new, k) and (
                k == "config" or isinstance(v, (int, float, str, bool))):
            setattr(new, k, v)


class ConvertedMLP(Sequential):
    """A ``fo.Sequential`` in place of an MLP module, its children named as the original's.

    ``named``: ``[(name, module), ...]`` in call order. ``split``: for a gated MLP whose gate and up
    projections were fused, ``(fused_name, gate_name, up_name)``: ``state_dict()`` gives
    ``gate_name.weight`` / ``up_name.weight`` (and biases) as the two halves of
    ``fused_name.weight``, and ``load_state_dict()`` takes them. ``key_order``: the original
    module's state-dict keys (relative), the order ``state_dict()`` keeps. ``recipe``: an FP8 recipe
    every call runs under (``fo.autocast(recipe)``), or None."""

    def __init__(self, named: list, *, source: str = "", split: Optional[tuple] = None,
                 key_order: Optional[list] = None, recipe=None) -> None:
        super().__init__(*[m for _, m in named])
        mods = list(self._modules.values())
        self._modules.clear()  # (the stages and name table refer to the modules, not their names)
        for (name, _), m in zip(named, mods):
            self._modules[name] = m
        self.source = source
        self.recipe = recipe
        self._split = split
        self._key_order = list(key_order or [])
        if split is not None:
            self.register_state_dict_post_hook(_split_state)
            self.register_load_state_dict_pre_hook(_join_state)
            self.register_load_state_dict_post_hook(_report_missing)

    def forward(self, x: torch.Tensor, *extra_inputs, **named):
        if self.recipe is None:
            return super().forward(x, *extra_inputs, **named)
        with autocast(recipe=self.recipe):
            return super().forward(x, *extra_inputs, **named)

    def original_names(self) -> dict:
        """``{parameter name here: [(original name, rows or None), ...]}`` (names relative to this
        module): ``rows`` is the slice of the fused tensor an original parameter is."""
        out = {}
        for name, p in self.named_parameters():
            out[name] = [(name, None)]
        if self._split is not None:
            fused, gate, up = self._split
            for kind in ("weight", "bias"):
                key = f"{fused}.{kind}"
                if key in out:
                    half = dict(self.named_parameters())[key].shape[0] // 2
                    out[key] = [(f"{gate}.{kind}", slice(0, half)), (f"{up}.{kind}", slice(half, 2 * half))]
        return out


def _split_state(module: ConvertedMLP, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: this module's entries (the last ones added) rewritten as the
    original's: the fused gate/up tensors as two halves (views), in the original key order."""
    mine = {}
    while state_dict:
        key = next(reversed(state_dict))
        if not key.startswith(prefix):
            break
        mine[key[len(prefix):]] = state_dict.pop(key)
    expanded = {}
    for rel, parts in module.original_names().items():
        if rel not in mine:
            continue
        t = mine.pop(rel)
        for name, rows in parts:
            expanded[name] = t if rows is None else t[rows]
    expanded.update(mine)  # (anything else: buffers, e.g. FP8 delayed-scaling state)
    order = [k for k in module._key_order if k in expanded] + [k for k in expanded if k not in module._key_order]
    for rel in order:
        state_dict[prefix + rel] = expanded[rel]


def _join_state(module: ConvertedMLP, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                error_msgs) -> None:
    """load_state_dict pre-hook: the original gate and up entries joined into the fused one. With
    only one of the two present, that half is copied into the fused parameter here and the
    other is reported missing (by :func:`_report_missing`)."""
    fused, gate, up = module._split
    missing = {}
    params = dict(module.named_parameters())
    for kind in ("weight", "bias"):
        target = f"{fused}.{kind}"
        if target not in params or prefix + target in state_dict:
            continue
        keys = [f"{prefix}{gate}.{kind}", f"{prefix}{up}.{kind}"]
        have = [k in state_dict for k in keys]
        if all(have):
            a, b = state_dict.pop(keys[0]), state_dict.pop(keys[1])
            if a.shape != b.shape:
                error_msgs.append(f"ConvertedMLP ({module.source}): {keys[0]} has shape {list(a.shape)} but {keys[1]} "
                                  f"has {list(b.shape)}; they must match to form {prefix}{target}")
                continue
            state_dict[prefix + target] = torch.cat([a, b])
            continue
        p, half = params[target], params[target].shape[0] // 2
        for i, (k, present) in enumerate(zip(keys, have)):
            if present:
                with torch.no_grad():
                    p[i * half:(i + 1) * half].copy_(state_dict.pop(k))
        missing[prefix + target] = [k for k, present in zip(keys, have) if not present]
    module.__dict__["_load_missing"] = missing


def _report_missing(module: ConvertedMLP, incompatible_keys) -> None:
    """load_state_dict post-hook: missing keys under the original names, not the fused one."""
    for target, names in module.__dict__.pop("_load_missing", {}).items():
        if target in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(target)
        incompatible_keys.missing_keys.extend(names)


# -- retired parameters ------------------------------------------------------------------------
_RETIRED: dict = {}  # id(param) -> (weak reference, name): (a WeakKeyDictionary would compare tensors with ==)
_HOOK: list = []


def retire(param: torch.nn.Parameter, name: str) -> None:
    """Mark ``param`` (named ``name`` in the model) as replaced by :func:`fusible_ops.convert`: an
    optimizer that holds it raises a ``RuntimeError`` at its next ``step()`` instead of silently
    never updating the parameter that replaced it."""
    key = id(param)
    _RETIRED[key] = (weakref.ref(param, lambda _, key=key: _RETIRED.pop(key, None)), name)
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def retired_name(param) -> Optional[str]:
    """The model name of ``param`` if :func:`retire` marked it, else None."""
    entry = _RETIRED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _check_optimizer(optimizer, args, kwargs) -> None:
    if not _RETIRED:
        return
    stale = [n for group in optimizer.param_groups for p in group["params"] for n in (retired_name(p),) if n]
    if stale:
        shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        raise RuntimeError(f"fusible_ops.convert: this {type(optimizer).__name__} holds parameters that convert() "
                           f"replaced ({shown}): build the optimizer after convert()")


__all__ = ["GATED_OPS", "PLAIN_OPS", "ConvertedLayerNorm", "ConvertedMLP", "ConvertedRMSNorm", "copy_plain_attributes",
           "has_hooks", "linear_holding", "retire", "retired_name"]
