"""``fusible_ops.convert(model)``: the model a user already has, with what the converter recognizes
replaced by fusible ops (see docs/convert.md).

Recognized by structure, then confirmed numerically (:mod:`fusible_ops.convert.probe`), never by
class name, so architectures never tested convert too:

* **norms**: a leaf module with a 1-D ``weight`` (and ``bias``) and an epsilon attribute
  (``variance_epsilon``, ``eps``, ``epsilon``) that computes ``fo.RMSNorm`` / ``fo.LayerNorm`` math
  -> :class:`~fusible_ops.convert.modules.ConvertedRMSNorm` / ``ConvertedLayerNorm``;
* **MLPs**: a module whose children are leaves: two or three linears of chaining shapes and one
  activation (a parameter-free child, or a function attribute) that is silu, gelu, gelu(tanh) or
  relu -> :class:`~fusible_ops.convert.modules.ConvertedMLP`, a ``fo.Sequential``: gated
  ``down(act(gate(x)) * up(x))`` as ``Linear(d, 2f), SwiGLU/GEGLU/ReGLU, Linear(f, d)`` (gate and
  up fused into one parameter, see modules.py), an already fused ``[2f, d]`` gate-first projection
  as it is, plain ``fc2(act(fc1(x)))`` as ``Linear, act, Linear``;
* **MoE blocks** (Hugging Face transformers 5.x layout): a router with a weight ``[E, d]`` and
  experts with 3-D weights ``[E, 2f, d]``, ``[E, d, f]`` (and a shared expert) ->
  :class:`~fusible_ops.convert.moe.ConvertedMoE`: ``fo.Sequential(Router, Dispatch, GroupedLinear,
  SwiGLU, GroupedLinear, Combine)`` over the original parameters (:mod:`fusible_ops.convert.moe`);
* **the causal-LM head** of a Hugging Face ``*ForCausalLM`` model: the loss with labels as
  ``linear_cross_entropy`` (:mod:`fusible_ops.convert.head`).

Attention and everything else stay the model's own. New kinds plug in as one more entry of
:data:`CONVERTERS`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..quantization.recipes import RECIPES
from . import head as _head
from .modules import (GATED_OPS, PLAIN_OPS, ConvertedLayerNorm, ConvertedMLP, ConvertedRMSNorm,
                      copy_plain_attributes, has_hooks, linear_holding, retire)
from .moe import ConvertedMoE, convert_moe
from .probe import ACTIVATIONS, find_activation, identify_activation, linear_spec, norm_eps, probe_mlp, probe_norm
from .report import ConversionReport, Entry

CONVERTED_TYPES = (ConvertedRMSNorm, ConvertedLayerNorm, ConvertedMLP, ConvertedMoE, _head.ConvertedLMHead)
FUSED_NAME = "gate_up_proj"


def _cls(m) -> str:
    return type(m).__name__


# -- norms ---------------------------------------------------------------------------------------
def convert_norm(m: torch.nn.Module, name: str):
    """``None`` (not a norm candidate), a reason (a candidate left alone), or ``(module, into)``."""
    if m._modules:
        return None
    params = dict(m.named_parameters(recurse=False))
    has_eps = any(a in m.__dict__ for a in ("variance_epsilon", "eps", "epsilon"))
    if not params:
        return "no weight (elementwise_affine=False)" if has_eps and hasattr(m, "normalized_shape") else None
    w, b = params.get("weight"), params.get("bias")
    if w is None or w.dim() != 1 or set(params) - {"weight", "bias"} or not has_eps:
        return None
    if b is not None and b.shape != w.shape:
        return None
    eps = norm_eps(m)
    if isinstance(eps, str):
        return eps
    found = probe_norm(m, eps, b is not None)
    if isinstance(found, str):
        return found
    kind, rule = found
    if kind == "RMSNorm":
        return ConvertedRMSNorm(w, eps, source=_cls(m), out_dtype_rule=rule), "fo.RMSNorm"
    return ConvertedLayerNorm(w, b, eps, source=_cls(m), out_dtype_rule=rule), "fo.LayerNorm"


# -- MLPs ----------------------------------------------------------------------------------------
_ROLE_WORDS = {"gate": ("gate", "w1"), "up": ("up", "w3"), "down": ("down", "w2", "out", "proj")}


def _role_score(name: str, role: str) -> int:
    return int(any(w in name for w in _ROLE_WORDS[role]))


def _hypotheses(specs: dict):
    """The MLP readings the linears' shapes allow: ``("gated", (gate, up, down))``, ``("gated",
    (fused, None, down))`` or ``("plain", (fc1, fc2))``, the likeliest by name first."""
    names = list(specs)
    out = []
    if len(names) == 3:
        for dn in names:
            g_u = [n for n in names if n != dn]
            for g, u in (g_u, g_u[::-1]):
                (gi, go, _), (ui, uo, _), (di, do, _) = specs[g], specs[u], specs[dn]
                if gi == ui == do and go == uo == di:
                    score = _role_score(g, "gate") + _role_score(u, "up") + _role_score(dn, "down")
                    out.append((-score, "gated", (g, u, dn)))
    elif len(names) == 2:
        for a, b in (names, names[::-1]):
            (ai, ao, _), (bi, bo, _) = specs[a], specs[b]
            if ai == bo and ao == bi:
                out.append((-_role_score(b, "down"), "plain", (a, b)))
            if ai == bo and ao == 2 * bi:
                out.append((-_role_score(b, "down"), "gated", (a, None, b)))
    return [(kind, roles) for _, kind, roles in sorted(out, key=lambda t: t[0])]


def convert_mlp(m: torch.nn.Module, name: str):
    """``None`` (not an MLP candidate), a reason, or ``(module, into)``."""
    children = list(m._modules.items())
    if len(children) < 2 or any(c is None or c._modules for _, c in children):
        return None
    linear, free = {}, []
    for n, c in children:
        if any(True for _ in c.parameters()):
            w = getattr(c, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                return None
            linear[n] = c
        elif isinstance(c, (torch.nn.Dropout, torch.nn.Identity)) and getattr(c, "p", 0) == 0:
            continue  # (the identity: nothing to convert)
        else:
            free.append((n, c))
    if len(linear) not in (2, 3):
        return None
    shapes = {n: tuple(c.weight.shape) for n, c in linear.items()}
    hyps = _hypotheses({n: (s[1], s[0], None) for n, s in shapes.items()})
    if not hyps:
        return None
    # an MLP-shaped module from here on: a reason for anything that stops it
    specs = {}
    for n, c in linear.items():
        spec = linear_spec(c)
        if isinstance(spec, str):
            return f"{n}: {spec}"
        specs[n] = spec
    drops = [f"{n} (p={c.p})" for n, c in free if isinstance(c, torch.nn.Dropout)]
    if drops:
        return f"has dropout {', '.join(drops)}: its place in the forward cannot be probed"
    act = find_activation(m, free)
    if isinstance(act, str):
        return act
    act_name, act_fn = act
    kind = identify_activation(act_fn)
    if isinstance(kind, tuple):
        return f"{act_name}: {kind[1]}"
    why = []
    for shape, roles in hyps:
        bad = probe_mlp(m, specs, ACTIVATIONS[kind], roles if shape == "gated" else None)
        if bad is None:
            return _build_mlp(m, name, shape, roles, linear, act_name, kind)
        why.append(bad)
    readings = " or ".join(_describe(s, r) for s, r in hyps)
    return f"does not compute {readings} ({why[0]})"


def _describe(shape, roles) -> str:
    if shape == "plain":
        return f"{roles[1]}(act({roles[0]}(x)))"
    g, u, d = roles
    return f"{d}(act({g}(x)) * {u}(x))" if u else f"{d}(act(a) * b), a, b = {g}(x).chunk(2)"


def _build_mlp(m, name: str, shape: str, roles, linear: dict, act_name: str, kind: str):
    key_order = list(m.state_dict(keep_vars=True).keys())
    split = None
    if shape == "plain":
        a, b = roles
        act = PLAIN_OPS[kind]()
        named = [(a, linear_holding(linear[a].weight, linear[a].bias)), (act_name, act),
                 (b, linear_holding(linear[b].weight, linear[b].bias))]
        into = f"fo.Sequential(Linear, {type(act).__name__}, Linear)"
    else:
        g, u, d = roles
        act = GATED_OPS[kind]()
        if u is None:
            first = linear_holding(linear[g].weight, linear[g].bias)
            fused_name, into_note = g, "gate/up already one weight"
        else:
            gw, uw = linear[g].weight, linear[u].weight
            if gw.requires_grad != uw.requires_grad or gw.dtype != uw.dtype or gw.device != uw.device:
                return f"{g} and {u} differ in requires_grad, dtype or device"
            with torch.no_grad():
                w = torch.nn.Parameter(torch.cat([gw, uw]), requires_grad=gw.requires_grad)
                gb, ub = linear[g].bias, linear[u].bias
                bias = None if gb is None else torch.nn.Parameter(torch.cat([gb, ub]), requires_grad=gb.requires_grad)
            fused_name = FUSED_NAME if FUSED_NAME not in m._modules else f"{g}_{u}"
            first = linear_holding(w, bias)
            split = (fused_name, g, u)
            for n in (g, u):
                for pn, p in linear[n].named_parameters():
                    retire(p, f"{name}.{n}.{pn}" if name else f"{n}.{pn}")
            into_note = f"{g} + {u} fused into {fused_name} [2f, d]"
        named = [(fused_name, first), (act_name, act), (d, linear_holding(linear[d].weight, linear[d].bias))]
        into = f"fo.Sequential(Linear, {type(act).__name__}, Linear) ({into_note})"
    new = ConvertedMLP(named, source=_cls(m), split=split, key_order=key_order)
    copy_plain_attributes(m, new)
    return new, into


CONVERTERS: list = [("norm", convert_norm), ("moe", convert_moe), ("mlp", convert_mlp)]
"""``(kind, fn)``: ``fn(module, name)`` returns None (not this kind), a reason (a candidate left
alone) or ``(replacement, description)``. Tried in order on every module, parents first."""


def convert(model: torch.nn.Module, *, recipe=None, module_filter_fn: Optional[Callable] = None,
            verbose: bool = False) -> torch.nn.Module:
    """Replace what is recognized in ``model`` by fusible ops, in place; returns the model (a new
    module only when ``model`` itself is a norm or an MLP).

    * ``recipe``: an FP8 recipe (``fo.Float8CurrentScaling()``...) every converted module runs
      under, or None (then wrap calls in ``fo.autocast`` yourself, or run without FP8).
    * ``module_filter_fn(module, name) -> bool``: a candidate it returns False for is left alone.
    * ``verbose``: print the report.

    The report (:class:`~fusible_ops.convert.report.ConversionReport`: every module converted, every
    candidate left alone with the reason) is attached as ``model.fusible_ops_report``.
    ``state_dict()`` keys, shapes and dtypes stay the original's. Parameters are kept (norms, plain
    MLPs, down projections, MoE routers and experts, the head), except a gated MLP's gate and up weights, fused into one new
    parameter: build the optimizer after ``convert()`` (an optimizer holding a replaced parameter
    raises at ``step()``)."""
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise TypeError(f"fusible_ops.convert: recipe must be None or an FP8 recipe instance, got {recipe!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fusible_ops.convert: model must be a torch.nn.Module, got {type(model).__name__}")
    report = ConversionReport(recipe=recipe)
    root, made, done = model, [], []
    for name, m in list(model.named_modules()):
        if any(name.startswith(p + ".") for p in done) or (name and any(p == "" for p in done)):
            continue
        if isinstance(m, CONVERTED_TYPES):
            report.add(name, _cls(m), reason="already converted")
            continue
        for _, fn in CONVERTERS:
            found = fn(m, name)
            if found is None:
                continue
            if isinstance(found, tuple) and module_filter_fn is not None and not module_filter_fn(m, name):
                found = "module_filter_fn returned False"
            if isinstance(found, tuple) and has_hooks(m):
                found = "has module hooks (they would be lost)"
            if isinstance(found, str):
                report.add(name, _cls(m), reason=found)
                break
            new, into = found
            new.train(m.training)
            if name:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, new)
            else:
                root = new
            made.append(new)
            if not getattr(new, "convert_children", False):  # (a converted MoE block's shared expert converts too)
                done.append(name)
            report.add(name, _cls(m), into)
            break
    _convert_head(root, report, module_filter_fn, made)
    for new in made:  # (not an attribute assignment: on an op that bumps its state version, and a fuser seeing a
        new.__dict__["recipe"] = recipe  # version change inside a torch.compile trace re-plans there: a recompile)
    root.fusible_ops_report = report
    if verbose:
        print(report)
    return root


def _convert_head(model, report: ConversionReport, module_filter_fn, made: list) -> None:
    found = _head.candidate(model)
    if found is None:
        return
    name, old = found
    if isinstance(old, CONVERTED_TYPES):
        return
    spec = linear_spec(old)
    reason = None
    if isinstance(spec, str):
        reason = spec
    elif spec[2]:
        reason = "the output embedding has a bias (linear_cross_entropy takes a bias-free head)"
    elif module_filter_fn is not None and not module_filter_fn(old, name):
        reason = "module_filter_fn returned False"
    elif has_hooks(old):
        reason = "has module hooks (they would be lost)"
    else:
        reason = _head.install(model, name, old, old.weight, _cls(old))
    if reason is not None:
        report.add(name, f"{_cls(old)} + {_cls(model)}.loss_function", reason=reason)
        return
    made.append(model.get_submodule(name))
    report.add(name, f"{_cls(old)} + {_cls(model)}.loss_function",
               "fo.Sequential(BasicLinear, CrossEntropy) with labels (linear_cross_entropy: no logits); "
               "logits without labels")


def to_original_names(model: torch.nn.Module, tensors: dict) -> dict:
    """``tensors`` keyed by the converted model's parameter names (e.g. ``{n: p.grad for n, p in
    model.named_parameters()}``), re-keyed by the original model's names: a fused gate/up tensor
    becomes its two halves (views). Names outside converted MLPs are kept."""
    out = dict(tensors)
    for prefix, mod in model.named_modules():
        if not isinstance(mod, ConvertedMLP):
            continue
        dot = prefix + "." if prefix else ""
        for rel, parts in mod.original_names().items():
            if dot + rel in out and parts[0][1] is not None:
                t = out.pop(dot + rel)
                for orig, rows in parts:
                    out[dot + orig] = None if t is None else t[rows]
    return out


__all__ = ["CONVERTERS", "ConversionReport", "Entry", "convert", "convert_mlp", "convert_norm", "to_original_names"]
