"""Mixture-of-experts blocks (Hugging Face transformers 5.x layout) as fusible MoE ops.

A candidate is a module whose children include

* a **router**: a leaf holding a 2-D weight ``[E, d]``, and
* **experts**: a module holding two 3-D weights, ``[E, 2f, d]`` (each expert's gate rows, then its
  up rows: ``[out, in]`` per expert) and ``[E, d, f]`` (down), with a gated activation,

and optionally a **shared expert** (one more child with parameters, added to the routed output)
with, optionally, a **shared-expert gate** (a leaf with a weight ``[1, d]``; its sigmoid scales the
shared expert: Qwen2-MoE). That is ``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``,
``OlmoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` and their kin. The probe
(:func:`probe_moe`) runs the block with random parameters and tells the routing: softmax or
sigmoid scores, top-k, the chosen scores divided by their sum or not; a block computing anything
else (a group-limited router, a routed scaling factor, random jitter in training) is left alone.

The block becomes a :class:`ConvertedMoE` holding the ORIGINAL router, experts and shared modules
as its children (same names, same Parameter objects: ``state_dict()``, ``named_parameters()``, an
optimizer built before ``convert()`` and Hugging Face's loading code see no change), and
``fo.Sequential(Router, Dispatch, GroupedLinear, SwiGLU, GroupedLinear, Combine)`` computing with
those parameters (lent: :class:`LentWeight`). The router module is still called when its output
is being recorded (``output_router_logits``: transformers records the router logits with a hook on
it), so transformers' load-balancing loss is computed from exactly the original logits.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ..ops.grouped_linear import GroupedLinear
from ..ops.moe import Combine, Dispatch, Router
from ..quantization.casting import FP8StateMixin
from ..quantization.recipes import autocast
from ..sequential import Sequential
from .modules import GATED_OPS, copy_plain_attributes, has_hooks
from .probe import (ACTIVATIONS, PROBE_ROWS, close, find_activation, identify_activation, max_err, probe_device, rand,
                    run)

TOP_K_ATTRS = ("top_k", "num_experts_per_tok")
"""Attributes of the router, then the block, then their ``config``, the top-k is read from."""

JITTER_ATTRS = ("jitter_noise", "router_jitter_noise")
"""Attributes of a random multiplicative noise on the router input in training (Mixtral's)."""

ROUTINGS = (("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False))
"""``(score, normalize)`` readings the probe tries, in order (``fo.Router``'s options)."""

FUSED, LENT = "fusible_moe", "fusible_weights"
"""Names of the children :class:`ConvertedMoE` adds (the ops, the owners of their lent weights)."""


# -- structure ---------------------------------------------------------------------------------------
def _own(m: torch.nn.Module) -> dict:
    return dict(m.named_parameters(recurse=False))


def _parts(block: torch.nn.Module) -> Optional[dict]:
    """The block's children read as a MoE block: ``router``, ``experts`` (names), ``others``
    (the other children holding parameters); None when it has no router and experts."""
    kids = {n: c for n, c in block._modules.items() if c is not None}
    experts = [n for n, c in kids.items() if sum(p.dim() == 3 for p in _own(c).values()) >= 2
               and len({p.shape[0] for p in _own(c).values() if p.dim() == 3}) == 1]
    if len(experts) != 1:
        return None
    e = next(p.shape[0] for p in _own(kids[experts[0]]).values() if p.dim() == 3)
    routers = [n for n, c in kids.items() if n != experts[0] and not c._modules
               and any(p.dim() == 2 and p.shape[0] == e for p in _own(c).values())]
    if len(routers) != 1:
        return None
    others = [n for n, c in kids.items() if n not in (experts[0], routers[0]) and any(True for _ in c.parameters())]
    return {"router": routers[0], "experts": experts[0], "others": others, "num_experts": e}


def _expert_roles(w: dict, d: int) -> Union[tuple, str]:
    """``(fc1 name, fc2 name)`` of the experts' two 3-D weights (fc1 ``[E, 2f, d]``, fc2
    ``[E, d, f]``), or a reason."""
    names = list(w)
    for a, b in (names, names[::-1]):
        (_, o1, i1), (_, o2, i2) = w[a].shape, w[b].shape
        if i1 == d == o2 and o1 == 2 * i2:
            return a, b
    shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in w.items())
    return (f"expert weights {shapes} are not [E, 2f, d] (gate rows, then up rows) and [E, d, f] with the router's "
            f"d={d}")


def _top_k(router: torch.nn.Module, block: torch.nn.Module) -> Optional[int]:
    for owner in (router, block, getattr(router, "config", None), getattr(block, "config", None)):
        for name in TOP_K_ATTRS:
            v = getattr(owner, name, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _is_capture_hook(hook) -> bool:
    """transformers' output-recording hook (``output_capturing_hook``), which only reads."""
    return (getattr(hook, "__name__", "") == "output_capturing_hook"
            and getattr(hook, "__module__", "").startswith("transformers."))


def _hooks_besides_capture(m: torch.nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or any(not _is_capture_hook(h) for h in m._forward_hooks.values()))


def _shared(block: torch.nn.Module, others: list, d: int) -> Union[tuple, str]:
    """``(shared expert name or None, shared gate name or None)``, or a reason."""
    if not others:
        return None, None
    if len(others) == 1:
        return others[0], None
    gates = [n for n in others if not block._modules[n]._modules and any(
        p.dim() == 2 and tuple(p.shape) == (1, d) for p in _own(block._modules[n]).values())]
    if len(others) == 2 and len(gates) == 1:
        return next(n for n in others if n != gates[0]), gates[0]
    return (f"children {', '.join(others)} besides the router and experts: at most a shared expert and its "
            f"[1, d] gate are recognized")


def find_moe(block: torch.nn.Module) -> Union[None, str, dict]:
    """None (not a MoE block), a reason (one left alone), or what :class:`ConvertedMoE` needs:
    the names of the router, its weight, the experts, their fc1/fc2 weights, the shared expert and
    its gate; ``top_k``, ``act`` (activation name)."""
    parts = _parts(block)
    if parts is None:
        return None
    r, x = parts["router"], parts["experts"]
    router, experts = block._modules[r], block._modules[x]
    rparams = _own(router)
    rname = next(n for n, p in rparams.items() if p.dim() == 2 and p.shape[0] == parts["num_experts"])
    extra = [n for n in rparams if n != rname] + [n for n, b in router.named_buffers(recurse=False) if b is not None]
    if extra:
        return (f"the router ({r}) holds {', '.join(extra)} besides its weight (a bias or an expert score correction): "
                f"fo.Router has no such term")
    d = rparams[rname].shape[1]
    for owner, what in ((block, "the block"), (experts, x)):
        own = [n for n, _ in owner.named_parameters(recurse=False)] if owner is block else []
        own += [n for n, b in owner.named_buffers(recurse=False) if b is not None]
        if own:
            return f"{what} holds {', '.join(own)} (tensors the converted block would not compute with)"
    w = {n: p for n, p in _own(experts).items() if p.dim() == 3}
    if len(w) != 2 or len(_own(experts)) != 2:
        return (f"{x} holds {', '.join(_own(experts))}: exactly two 3-D expert weights (no expert biases) are "
                f"converted")
    if getattr(experts, "is_transposed", False):
        return f"{x} stores its weights transposed ([E, in, out]); GroupedLinear takes [E, out, in]"
    if getattr(experts, "is_concatenated", True) is False:
        return f"{x} interleaves gate and up rows; the gated ops take the gate half, then the up half"
    roles = _expert_roles(w, d)
    if isinstance(roles, str):
        return f"{x}: {roles}"
    act = find_activation(experts, [(n, c) for n, c in experts._modules.items() if c is not None])
    if isinstance(act, str):
        return f"{x}: {act}"
    kind = identify_activation(act[1])
    if isinstance(kind, tuple):
        return f"{x}.{act[0]}: {kind[1]}"
    for owner in (block, router):
        for a in JITTER_ATTRS:
            v = getattr(owner, a, 0)
            if isinstance(v, (int, float)) and v > 0:
                return (f"{a}={v}: the router input is multiplied by random noise in training (not reproduced; "
                        f"set it to 0 to convert)")
    if _hooks_besides_capture(router) or has_hooks(experts):
        return f"{r if _hooks_besides_capture(router) else x} has module hooks (they would be lost)"
    k = _top_k(router, block)
    if k is None or k > parts["num_experts"]:
        return f"no top-k in 1..{parts['num_experts']} found (attributes {', '.join(TOP_K_ATTRS)})"
    shared = _shared(block, parts["others"], d)
    if isinstance(shared, str):
        return shared
    if FUSED in block._modules or LENT in block._modules:
        return f"it has a child named {FUSED} or {LENT}, the names a converted block gives its fusible ops"
    return {"router": r, "router_weight": rname, "experts": x, "fc1": roles[0], "fc2": roles[1], "top_k": k,
            "act": kind, "shared": shared[0], "shared_gate": shared[1], "d": d, "num_experts": parts["num_experts"]}


# -- the probe ---------------------------------------------------------------------------------------
def routed_reference(x2d, w_router, w1, w2, top_k: int, score: str, normalize: bool, act) -> torch.Tensor:
    """The routed experts' output for tokens ``x2d`` [T, d]: ``sum_j p_j * w2[e_j] @ (act(g) * u)``,
    ``g, u = (w1[e_j] @ x).chunk(2)``, over the top-k experts ``e_j`` of the scores (``softmax`` or
    ``sigmoid`` of ``x @ w_router.T``), ``p_j`` their scores (divided by their sum: ``normalize``)."""
    logits = x2d @ w_router.t()
    s = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    p, ids = torch.topk(s, top_k, dim=-1)
    if normalize:
        p = p / p.sum(-1, keepdim=True)
    g, u = torch.einsum("tkod,td->tko", w1[ids], x2d).chunk(2, dim=-1)
    y = torch.einsum("tkdf,tkf->tkd", w2[ids], act(g) * u)
    return (y * p.unsqueeze(-1)).sum(1)


def _sub(params: dict, prefix: str) -> dict:
    return {k[len(prefix) + 1:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def probe_moe(block: torch.nn.Module, spec: dict) -> Union[tuple, str]:
    """``(score, normalize)`` of the routing ``block`` computes (with ``spec`` from
    :func:`find_moe`), or a reason. The block runs on random tokens with random parameters (router
    logits of unit scale, so the scores differ) in evaluation mode, then in training mode (it must
    give the same: no random jitter, no dropout), never changing the block."""
    dev = probe_device(block)
    params = {}
    for i, (name, p) in enumerate(block.named_parameters()):
        params[name] = (rand(p.shape, dev, 41 + i) / math.sqrt(p.shape[-1]) if p.dim() > 1
                        else rand(p.shape, dev, 41 + i, 0.5, 1.5))
    d, r, x = spec["d"], spec["router"], spec["experts"]
    tokens = rand((2, PROBE_ROWS, d), dev, 40)
    was = block.training
    try:
        outs = []
        for mode in (False, True):
            block.train(mode)
            outs.append(run(block, params, tokens))
    finally:
        block.train(was)
    y, y_train = outs
    if isinstance(y, Exception):
        return f"raised {type(y).__name__} on a probe input: {y}"
    t2d = tokens.reshape(-1, d)
    extra = 0.0
    with torch.no_grad():
        shared, gate = spec["shared"], spec["shared_gate"]
        if shared is not None:
            extra = run(block._modules[shared], _sub(params, shared), t2d)
            if gate is not None:
                extra = torch.sigmoid(run(block._modules[gate], _sub(params, gate), t2d)) * extra
        w = (params[f"{r}.{spec['router_weight']}"], params[f"{x}.{spec['fc1']}"], params[f"{x}.{spec['fc2']}"])
        refs = [(routed_reference(t2d, *w, spec["top_k"], score, norm, ACTIVATIONS[spec["act"]]) + extra).reshape(
            tokens.shape) for score, norm in ROUTINGS]
    found = next((routing for routing, ref in zip(ROUTINGS, refs) if close(y, ref)), None)
    if found is None:
        what = "the routed experts" + ("" if spec["shared"] is None else " + the shared expert")
        nearest = min(refs, key=lambda ref: (y - ref).abs().max().item() if close_shape(y, ref) else math.inf)
        return (f"does not compute {what} with softmax or sigmoid top-{spec['top_k']} routing, normalized or not "
                f"(nearest: {max_err(y, nearest)}): e.g. a group-limited router or a routed scaling factor")
    if not close(y_train, y):
        return ("its output in training mode differs from evaluation mode's on the same input (random router "
                "jitter or dropout: not reproduced)")
    return found


def close_shape(y, ref) -> bool:
    return isinstance(y, torch.Tensor) and y.shape == ref.shape


# -- the converted block -----------------------------------------------------------------------------
class LentWeight(FP8StateMixin, torch.nn.Module):
    """Owns one fusible op's lent ``weight`` (``op.lend_parameters(this, ("weight",))``):
    ``self.weight`` is ``getattr(source, attr)``, the original module's parameter under its own
    name (whatever is there now: after ``load_state_dict``, ``functional_call``...). Holds the op's
    FP8 delayed-scaling state (in the state dict under this module's name, as every fusible op's)."""

    def __init__(self, source: torch.nn.Module, attr: str) -> None:
        super().__init__()
        self.__dict__["source"] = source  # (not a child: the converted block holds it)
        self.__dict__["attr"] = attr

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.source, self.attr)

    def extra_repr(self) -> str:
        return f"weight={type(self.source).__name__}.{self.attr}"


class ConvertedMoE(torch.nn.Module):
    """A MoE block with its routed experts computed by ``fo.Sequential(Router, Dispatch,
    GroupedLinear, <GLU>, GroupedLinear, Combine)`` (child ``fusible_moe``; its router runs with no
    auxiliary loss of its own). The original router, experts and shared-expert modules stay its
    children under their names and own the parameters; ``fusible_weights`` lends them to the ops.

    ``forward(hidden_states)`` returns what the original returned: the routed output, plus
    ``shared(x)`` (times ``sigmoid(shared_gate(x))``). When the router module has forward hooks
    (transformers' recording hooks, installed by the first call with ``output_router_logits``, or
    hooks added later), it is also called on the tokens, so they see its own output: the original's
    logits, for the load-balancing loss. Its result does not change the routing here.
    ``recipe``: an FP8 recipe the experts run under."""

    convert_children = True  # (fusible_ops.convert goes on into the children: the shared expert is an MLP)

    def __init__(self, block: torch.nn.Module, spec: dict, score: str, normalize: bool, *, source: str = "") -> None:
        super().__init__()
        for name, child in block._modules.items():  # (the original order: state_dict keys keep theirs)
            self._modules[name] = child
        router, experts = block._modules[spec["router"]], block._modules[spec["experts"]]
        w_r, w1, w2 = (getattr(router, spec["router_weight"]), getattr(experts, spec["fc1"]),
                       getattr(experts, spec["fc2"]))
        e, d, f = w2.shape
        owners = {f"{spec['router']}_{spec['router_weight']}": LentWeight(router, spec["router_weight"]),
                  f"{spec['experts']}_{spec['fc1']}": LentWeight(experts, spec["fc1"]),
                  f"{spec['experts']}_{spec['fc2']}": LentWeight(experts, spec["fc2"])}
        setattr(self, LENT, torch.nn.ModuleDict(owners))
        ops = [Router(d, e, spec["top_k"], score=score, normalize=normalize, aux_loss_coeff=0.0, z_loss_coeff=0.0,
                      device="meta", dtype=w_r.dtype),
               GroupedLinear(e, d, 2 * f, bias=False, device="meta", dtype=w1.dtype),
               GroupedLinear(e, f, d, bias=False, device="meta", dtype=w2.dtype)]
        for op, owner in zip(ops, owners.values()):
            op.lend_parameters(owner, ("weight",))
        setattr(self, FUSED, Sequential(ops[0], Dispatch(), ops[1], GATED_OPS[spec["act"]](), ops[2], Combine()))
        self.__dict__.update(source=source, recipe=None, spec=dict(spec), _hidden=d)
        copy_plain_attributes(block, self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        recipe, fused = self.__dict__.get("recipe"), self._modules[FUSED]
        if recipe is None:
            y, _ = fused(hidden_states)
        else:
            with autocast(recipe=recipe):
                y, _ = fused(hidden_states)
        spec, d = self.spec, self._hidden
        x2d = hidden_states.reshape(-1, d)
        router = self._modules[spec["router"]]
        if _observed(router):
            router(x2d)
        if spec["shared"] is not None:
            out = self._modules[spec["shared"]](x2d)
            if spec["shared_gate"] is not None:
                out = torch.sigmoid(self._modules[spec["shared_gate"]](x2d)) * out
            y = (y.reshape(-1, d) + out).reshape(y.shape)
        return y

    def fusion_plan(self, pass_: str = "forward") -> list:
        """The plan of the MoE ops (``Sequential.fusion_plan``)."""
        return self._modules[FUSED].fusion_plan(pass_)

    def explain(self) -> str:
        return self._modules[FUSED].explain()


def _observed(router: torch.nn.Module) -> bool:
    """Whether calling ``router`` would be observed: it has forward hooks. transformers installs
    its recording hooks the first time router logits are requested and keeps them (they record
    while a call requests them). Not "only while recording": under gradient checkpointing the
    recomputation (recording nothing) must save the tensors the first forward saved."""
    return bool(router._forward_hooks or router._forward_pre_hooks)


def convert_moe(m: torch.nn.Module, name: str):
    """``None`` (not a MoE candidate), a reason, or ``(ConvertedMoE, description)``."""
    spec = find_moe(m)
    if spec is None or isinstance(spec, str):
        return spec
    found = probe_moe(m, spec)
    if isinstance(found, str):
        return found
    score, normalize = found
    new = ConvertedMoE(m, spec, score, normalize, source=type(m).__name__)
    glu = type(new._modules[FUSED][3]).__name__
    x = spec["experts"]
    into = (f"fo.Sequential(Router({score}, top-{spec['top_k']}{', normalized' if normalize else ''}), Dispatch, "
            f"GroupedLinear, {glu}, GroupedLinear, Combine) ({x}.{spec['fc1']} [E, 2f, d], {x}.{spec['fc2']} "
            f"[E, d, f] as GroupedLinear weights)")
    if spec["shared"] is not None:
        gate = f"sigmoid({spec['shared_gate']}(x)) * " if spec["shared_gate"] else ""
        into += f" + {gate}{spec['shared']}(x)"
    return new, into


__all__ = ["ConvertedMoE", "LentWeight", "convert_moe", "find_moe", "probe_moe", "routed_reference"]
