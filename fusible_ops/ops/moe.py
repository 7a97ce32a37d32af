"""Mixture-of-experts routing as ops: :class:`Router`, :class:`Dispatch`, :class:`Combine`.

A MoE layer is a run of basic ops in one ``Sequential``::

    Router -> Dispatch -> GroupedLinear -> GLU -> GroupedLinear -> Combine

The routing (a :class:`Routing` record: expert ids, probabilities, per-expert counts, the sort
permutation) travels with the activations from the ``Router`` to the ``Dispatch``, the routed
``GroupedLinear``\\ s (every ``GroupedLinear`` between a ``Dispatch`` and the next ``Combine``,
fed the per-expert counts as their split sizes by the fuser) and the ``Combine``: the user passes
no split sizes. In backward the record is the channel for the probabilities' gradient, which
``Combine`` computes and ``Router`` consumes.

What must hold:

* Router..Combine run in ONE fuser (:class:`RoutingLayout` checks it when the fuser is built:
  a hook or a non-fusible module in between is an error naming the ops, never a wrong result).
* No host sync: the top-k, the counts per expert and the stable sort of the copies by expert
  (tokens of one expert keep token order: deterministic) come from three kernels
  (:func:`~fusible_ops.kernels.moe_router.route`: a counting sort, no atomics); copies are
  placed in one pass that reads each token once
  (:func:`~fusible_ops.kernels.moe_combine.scatter_copies`) and summed back
  over ``top_k`` in a fixed order.
* Probabilities are float32 (the router's math is float32 whatever the activations' dtype);
  ``Combine`` weights the expert outputs by them in float32, summing each token's copies in one
  pass (:mod:`fusible_ops.kernels.moe_combine`). The auxiliary loss is a float32 scalar.

Expert parallel (``Dispatch(ep_group=group)``): each rank holds ``E / ep`` experts and exchanges
token copies with all-to-all (:mod:`fusible_ops.ops.moe_ep`); that path syncs with the host once
per layer per forward and is not graph-capturable.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..grad import WeightGradMixin, deliver_weight_grad
from ..kernels.gemm import linear_wgrad
from ..kernels.moe_combine import combine_bwd, gather_sum, scatter_copies
from ..kernels.moe_router import expert_counts_ref, route, router_dlogits, sort_by_expert_ref
from ..op import BasicOperation
from ..training_state import VersionedStateMixin
from .comm import GroupRef
from .grouped_linear import GroupedLinear
from .moe_ep import (ExpertExchange, PaddedLayout, RoutingError, check_layout, check_not_capturing,
                     from_experts_autograd, to_experts_autograd)
from .moe_routing import _RECORDS, Routing, RoutingLayout, record_routing, routing_layout
from .validation import check_input

PADDED_DECLINED = ("ep_exchange='padded' takes effect only where the layer fuses as rule moe_ep_overlap (Dispatch -> "
                   "GroupedLinear -> activation -> GroupedLinear -> Combine, not under FP8 autocast); here the "
                   "unfused ops run (Sequential.explain() says why)")

SCORES = ("softmax", "sigmoid")

__all__ = ["Combine", "Dispatch", "Router", "Routing", "RoutingError", "RoutingLayout", "record_routing",
           "routing_layout"]  # (Routing, its layout and record_routing live in moe_routing.py)


def _lowp_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """16-bit CUDA operands of one dtype: the router's GEMMs run on tensor cores."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype


def _router_logits(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2d @ weight.T`` in float32 (float64 for float64 inputs, as the reference runs). 16-bit
    CUDA operands: one tensor-core GEMM with float32 accumulation and output (the same values as
    float32 math on the 16-bit inputs, up to summation order)."""
    if _lowp_cuda(x2d, weight):
        return torch.mm(x2d, weight.t(), out_dtype=torch.float32)
    acc = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    return x2d.to(acc) @ weight.to(acc).t()


class Router(VersionedStateMixin, WeightGradMixin, BasicOperation):
    """Routes each token (row of ``x`` [..., in_features]) to ``top_k`` of ``num_experts`` experts.

    ``logits = x @ weight.T`` in float32 (``weight`` [E, in_features]). ``score="softmax"``:
    ``s = softmax(logits)``, the top-k of ``s`` is selected. ``score="sigmoid"`` (DeepSeek-V3):
    ``s = sigmoid(logits)``, selection by the top-k of ``s + expert_bias`` when ``expert_bias=True``
    (a non-trainable [E] float32 buffer, zeros at start, used only for selection: aux-loss-free
    balancing; training calls (grad mode on, the router in training mode) add their token copies
    per expert into the int64 buffer ``expert_load``, and :meth:`update_expert_bias` takes the
    balancing step from it). Probabilities: the selected ``s`` (divided by their sum when
    ``normalize=True``), float32 [T, k].

    Output: ``x`` unchanged (the routing travels with it to :class:`Dispatch`), and the extra
    output ``aux_loss``, a float32 scalar, differentiable::

        aux_loss = aux_loss_coeff * E * sum_e f_e * P_e  +  z_loss_coeff * mean_t(logsumexp(logits_t) ** 2)

    with ``f_e`` the fraction of the ``T * k`` token copies routed to expert e (no gradient) and
    ``P_e`` the mean over tokens of the router probability of e (``s``; for sigmoid scoring ``s``
    normalized over the experts). Uniform routing gives ``aux_loss_coeff``. Defaults:
    ``aux_loss_coeff=1e-2``, ``z_loss_coeff=0.0``.

    Gradient contract as every weight-owning op (``accumulate_into_main_grad``,
    ``delay_wgrad_compute``; a frozen weight costs no weight-gradient GEMM and its input is not
    saved). Must run in one fuser with a following :class:`Dispatch` and :class:`Combine`.
    """

    routing_role = "router"
    num_extra_outputs = 1

    def __init__(self, in_features: int, num_experts: int, top_k: int = 2, *, score: str = "softmax",
                 normalize: bool = False, expert_bias: bool = False, aux_loss_coeff: float = 1e-2,
                 z_loss_coeff: float = 0.0, device=None, dtype=None, accumulate_into_main_grad: bool = False,
                 delay_wgrad_compute: bool = False) -> None:
        super().__init__()
        if in_features <= 0 or num_experts <= 0:
            raise ValueError(f"Router: sizes must be positive, got ({in_features}, {num_experts})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"Router: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if score not in SCORES:
            raise ValueError(f"Router: score must be one of {SCORES}, got {score!r}")
        if expert_bias and score != "sigmoid":
            raise ValueError("Router: expert_bias (selection bias) is for score='sigmoid'")
        if aux_loss_coeff < 0 or z_loss_coeff < 0:
            raise ValueError(f"Router: loss coefficients must be >= 0, got {aux_loss_coeff}, {z_loss_coeff}")
        self.in_features, self.num_experts, self.top_k = int(in_features), int(num_experts), int(top_k)
        self.score, self.normalize = score, bool(normalize)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.weight = torch.nn.Parameter(torch.empty(num_experts, in_features, device=device, dtype=dtype))
        bias = torch.zeros(num_experts, device=device, dtype=torch.float32) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        load = torch.zeros(num_experts, device=device, dtype=torch.int64) if expert_bias else None
        self.register_buffer("expert_load", load)
        if expert_bias:  # (library state: the format version comes with it)
            self._add_format_entry(device)
        self._init_wgrad(accumulate_into_main_grad, delay_wgrad_compute)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # torch.nn.Linear's init

    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """DeepSeek-V3's aux-loss-free balancing step, on the device (no host sync):
        ``expert_bias += rate * sign(mean load - load)`` with the load counted in ``expert_load``
        since the last call (training calls; also those of a CUDA-graph warm-up), which is then
        zeroed. Call it once per optimizer step. Needs ``expert_bias=True``."""
        if self.expert_bias is None:
            raise RuntimeError("Router.update_expert_bias: the router was built without expert_bias=True")
        with torch.no_grad():
            load = self.expert_load.to(torch.float32)
            self.expert_bias.add_(torch.sign(load.mean() - load), alpha=rate)
            self.expert_load.zero_()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"score={self.score!r}, normalize={self.normalize}, expert_bias={self.expert_bias is not None}")

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(n, 4, top_k=2, z_loss_coeff=1e-3, **factory), n

    @classmethod
    def _contract_ops(cls, n: int, **factory) -> list:
        """A whole MoE layer around an ``_example`` router (it cannot run alone): for tests."""
        router, _ = cls._example(n, **factory)
        e = router.num_experts
        return [router, Dispatch(), GroupedLinear(e, n, 2 * n, bias=False, **factory), _swiglu(),
                GroupedLinear(e, n, n, bias=False, **factory), Combine()]

    # routing math (shared by the op and its reference; differentiable) -------------------
    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)

    def select(self, scores: torch.Tensor, given: Optional[Routing] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, probabilities [T, k]) from the scores. ``given``: a routing
        whose ``expert_ids`` were preset (a reference run replaying a run's choice): they are
        used, after checking they are a top-k within ``given.selection_tol``."""
        sel = (scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)).detach()
        if given is None or given.expert_ids is None:
            ids = torch.topk(sel, self.top_k, dim=-1).indices
        else:
            ids = given.expert_ids.to(sel.device)
            _check_top_k(self, sel, ids, given.selection_tol)
        vals = scores.gather(1, ids)
        return ids, (vals / vals.sum(-1, keepdim=True) if self.normalize else vals)

    def aux_loss(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        tokens = logits.shape[0]
        aux = logits.new_zeros(())
        if tokens == 0:
            return aux
        if self.aux_loss_coeff:
            p = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            f = counts.to(logits.dtype) / (tokens * self.top_k)
            aux = aux + self.aux_loss_coeff * self.num_experts * (f * p.mean(0)).sum()
        if self.z_loss_coeff:
            aux = aux + self.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
        return aux

    def _route(self, x: torch.Tensor, routing: Routing) -> tuple:
        x2d = x.reshape(-1, self.in_features)
        logits = _router_logits(x2d, self.weight)
        scores = self.scores(logits)
        ids, probs = self.select(scores, routing)
        counts = expert_counts_ref(ids, self.num_experts)
        routing.token_shape, routing.expert_ids, routing.probs, routing.split_sizes = x.shape[:-1], ids, probs, counts
        return x2d, logits, ids, counts, self.aux_loss(logits, scores, counts)

    def _route_kernels(self, x: torch.Tensor, routing: Routing) -> tuple:
        """:meth:`_route` through :func:`~fusible_ops.kernels.moe_router.route` (three kernels on
        CUDA, no autograd): also fills the sort permutation of the copies (``routing.perm``)."""
        x2d = x.reshape(-1, self.in_features)
        logits = _router_logits(x2d, self.weight)
        r = route(logits, self.top_k, score=self.score, normalize=self.normalize, bias=self.expert_bias,
                  score_sum=self.aux_loss_coeff > 0, zsum=self.z_loss_coeff > 0)
        routing.token_shape, routing.expert_ids, routing.probs, routing.split_sizes = x.shape[:-1], r.ids, r.probs, \
            r.counts
        routing.perm, routing.inv_perm = r.perm, r.inv_perm
        tokens = x2d.shape[0]
        aux = logits.new_zeros(())
        if tokens and r.score_sum is not None:  # aux_coeff * E * sum_e (count_e / (T k)) * (score_sum_e / T)
            scale = self.aux_loss_coeff * self.num_experts / (tokens * tokens * self.top_k)
            aux = torch.dot(r.counts.to(r.score_sum.dtype), r.score_sum) * scale
        if tokens and r.zsum is not None:
            aux = aux + r.zsum * (self.z_loss_coeff / tokens)
        return x2d, logits, r.ids, r.counts, aux

    # fuser interface -------------------------------------------------------------------------
    def fuser_forward(self, ctxs, x, *, extra_inputs, routing: Routing = None, **kwargs):
        _need_routing(self, routing)
        check_input(self, x, features=self.in_features, like=self.weight)
        ctx = ctxs[0]
        preset = routing.expert_ids is not None  # (a reference replaying a run's choice)
        x2d, logits, ids, counts, aux = (self._route if preset else self._route_kernels)(x, routing)
        if _RECORDS:
            _RECORDS[-1].append(ids)
        if self.expert_load is not None and ctx.training:  # (training calls only: not under no_grad)
            self.expert_load.add_(counts)
        if ctx.requires_grad:
            ctx.weight_grad = ctx.weight_requires_grad and self.weight.requires_grad
            routing.probs_grad = ctx.weight_grad or ctx.input_requires_grad
            ctx.save_for_backward(x2d if ctx.weight_grad else None, self.weight if ctx.input_requires_grad else None,
                                  logits, ids, counts)
            ctx.input_shape = x.shape
        return x, [(aux,)]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, routing: Routing = None, **kwargs):
        ctx = ctxs[0]
        x2d, w, logits, ids, counts = ctx.saved_tensors
        (daux,) = grad_extra_outputs[0]
        if not (ctx.input_requires_grad or ctx.weight_grad):
            return None, [(None,)], [()]
        # 16-bit CUDA: the logits' gradient is rounded to the activations' dtype and both GEMMs run
        # on tensor cores with float32 accumulation (as autograd does for a 16-bit nn.Linear);
        # elsewhere in float32 (float64 for float64).
        lowp = logits.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16)  # (x has the weight's dtype)
        dl = router_dlogits(logits, ids, routing.dprobs, counts, daux, score=self.score, normalize=self.normalize,
                            aux_coeff=self.aux_loss_coeff, z_coeff=self.z_loss_coeff,
                            out_dtype=self.weight.dtype if lowp else logits.dtype)
        dx = None
        if ctx.input_requires_grad:
            if dy is not None and dy.dtype == dl.dtype == w.dtype:  # Dispatch's gradient added by the GEMM
                if routing is not None and dy is routing.fresh_dx and dy.is_contiguous():  # (ours: no copy of dy)
                    dx = dy.view(-1, w.shape[1]).addmm_(dl, w).view(ctx.input_shape)
                else:  # (out of place, addmm copies dy into its result first)
                    dx = torch.addmm(dy.reshape(-1, w.shape[1]), dl, w).reshape(ctx.input_shape)
            else:
                dx = (dl @ w.to(dl.dtype)).to(w.dtype).reshape(ctx.input_shape)
                dx = dx if dy is None else dy + dx
        dw = None
        if ctx.weight_grad:
            xf = x2d.to(dl.dtype)
            dw = deliver_weight_grad(self, self.weight, lambda out, acc: linear_wgrad(dl, xf, out, acc)
                                     if out is not None else linear_wgrad(dl, xf).to(self.weight.dtype))
        return dx, [(dw,)], [()]

    def reference_forward(self, x, routing: Routing):
        *_, aux = self._route(x, routing)
        return x, aux


class Dispatch(BasicOperation):
    """Token copies grouped by expert: input ``x`` [..., H] (the Router's tokens), output
    [T * k, H], row ``i`` = the token of copy ``perm[i]``; rows of expert 0 first, then expert 1...
    (``Routing.split_sizes`` rows each; tokens of one expert in token order). Backward sums each
    token's k copies' gradients in a fixed order. Needs a :class:`Router` before it and a
    :class:`Combine` after it in the same fuser.

    ``ep_group``: a ``torch.distributed`` group for expert parallelism (``None`` or one rank: all
    experts are local). With ``ep`` ranks, rank r owns experts ``[r * E / ep, (r + 1) * E / ep)``
    (``E`` divisible by ``ep``; the routed ``GroupedLinear``\\ s have ``E / ep`` groups and hold
    those experts' weights); the output is then the copies of the local experts from every rank,
    local expert 0 first (from rank 0, 1, ...), then 1, ... (``Routing.local_split_sizes`` rows
    each). The exchange (:mod:`~fusible_ops.ops.moe_ep`) is collective: every rank of the group
    runs it, each with its own tokens; one host sync per forward; not graph-capturable. The
    Router's weight is replicated: all-reduce its gradient over the ranks (data parallel).

    ``ep_chunks`` (expert parallel only): the exchange and the expert MLP after it run as a pipeline
    of this many chunks of the local experts, each chunk's all-to-all overlapping another chunk's
    expert GEMMs (rule ``moe_ep_overlap``, :mod:`~fusible_ops.fusion_rules.moe_ep_overlap`); 1 turns
    the overlap off. The result does not depend on it. The default, 2 (1 with ``ep_exchange="padded"``),
    measured best on 2 H200s (NVLink, NCCL; harness case ``ep_moe``, 2026-11-28): 1.05x the step
    without overlap; 4 chunks 0.99x, 8 chunks 0.76x (docs/scaling-out.md says why).

    ``ep_exchange`` (expert parallel only): ``"sync"`` (default) sends each peer exactly its copies
    after one host read of the split sizes per forward; ``"padded"`` reads nothing on the host, so
    the layer captures in a CUDA graph, at ``ep`` times the traffic (each peer gets a fixed
    capacity, this rank's N copies; :class:`~fusible_ops.ops.moe_ep.PaddedLayout`). Padded needs
    the same token count on every rank and runs as one chunk where rule ``moe_ep_overlap`` fuses
    the layer (not under FP8); elsewhere the synced exchange runs (docs/scaling-out.md)."""

    routing_role = "dispatch"

    def __init__(self, ep_group=None, *, ep_chunks: Optional[int] = None, ep_exchange: str = "sync") -> None:
        super().__init__()
        if ep_exchange not in ("sync", "padded"):
            raise ValueError(f"Dispatch: ep_exchange must be 'sync' or 'padded', got {ep_exchange!r}")
        if ep_chunks is None:
            ep_chunks = 2 if ep_exchange == "sync" else 1
        if isinstance(ep_chunks, bool) or not isinstance(ep_chunks, int) or ep_chunks < 1:
            raise ValueError(f"Dispatch: ep_chunks must be a positive int, got {ep_chunks!r}")
        if ep_exchange == "padded" and ep_chunks != 1:
            raise ValueError(f"Dispatch: ep_exchange='padded' exchanges in one piece (ep_chunks=1), got "
                             f"ep_chunks={ep_chunks}: each chunk would pad to the full capacity")
        self.ep = GroupRef("Dispatch", ep_group, none_ok=True)
        self.ep_chunks, self.ep_exchange = ep_chunks, ep_exchange
        self._layout_checked = False  # (expert parallel: every rank's layout compared on the first call)
        self._padded_key = None  # (ep_exchange="padded": the (copies, hidden, dtype) every rank agreed on)

    @property
    def ep_size(self) -> int:
        return self.ep.size

    def extra_repr(self) -> str:
        if self.ep.size <= 1:
            return ""
        return (f"ep_size={self.ep.size}, ep_rank={self.ep.rank}, ep_chunks={self.ep_chunks}"
                + (f", ep_exchange={self.ep_exchange!r}" if self.ep_exchange != "sync" else ""))

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    @staticmethod
    def gather_index(routing: Routing) -> torch.Tensor:
        """The token (row of the input) of each output row, before any expert-parallel exchange."""
        return Dispatch.tokens_of(routing.perm, routing.top_k)

    @staticmethod
    def tokens_of(perm: torch.Tensor, top_k: int) -> torch.Tensor:
        """The token of each expert-ordered row, from the rows' copy indices ``perm`` (t * k + j)."""
        return torch.div(perm, top_k, rounding_mode="floor")

    def padded_layout(self, routing: Routing, hidden: int, dtype: torch.dtype) -> PaddedLayout:
        """The ``ep_exchange="padded"`` exchange of this call (:meth:`PaddedLayout.plan`)."""
        lay, self._padded_key = PaddedLayout.plan("Dispatch", self.ep, routing.split_sizes,
                                                  routing.num_tokens * routing.top_k, hidden, dtype, self._padded_key)
        return lay

    def _rows(self, x, routing: Routing, exchange: bool = True) -> torch.Tensor:
        """Validate the tokens, sort the copies by expert, compare the ranks' layouts (first call);
        ``exchange``: also plan the host-synced exchange (``routing.exchange``)."""
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] != routing.num_tokens:
            raise ValueError(f"Dispatch: the input has {x2d.shape[0]} rows but the Router routed "
                             f"{routing.num_tokens} tokens")
        if routing.perm is None:  # (the Router's kernels sort the copies when they pick the experts)
            routing.perm, routing.inv_perm = sort_by_expert_ref(routing.expert_ids)
        if self.ep.size > 1:
            if routing.ep_error is not None or not self._layout_checked:
                check_layout("Dispatch", self.ep, routing.num_experts, routing.ep_error, x2d.device)
                self._layout_checked = True
            if exchange:
                if self.ep_exchange == "padded":
                    check_not_capturing("Dispatch", self.ep, PADDED_DECLINED)
                routing.exchange = ExpertExchange.plan("Dispatch", self.ep, routing.split_sizes, x2d.shape[1],
                                                       x2d.dtype)
                routing.local_split_sizes = routing.exchange.local_counts
        return x2d

    def begin(self, ctx, x, routing: Routing) -> torch.Tensor:
        """Validate, sort the copies by expert (fills ``routing.perm``), save what backward needs;
        returns the tokens as [T, H] (a fused op that gathers inside its own kernels starts here)."""
        _need_routing(self, routing)
        check_input(self, x)
        x2d = self._rows(x, routing)
        if ctx.input_requires_grad:
            ctx.save_for_backward(routing.inv_perm)
            ctx.input_shape, ctx.top_k, ctx.exchange = x.shape, routing.top_k, routing.exchange
        return x2d

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing: Routing = None, **kwargs):
        x2d = self.begin(ctxs[0], x, routing)
        y = scatter_copies(x2d, routing.inv_perm.view(-1, routing.top_k))  # (each token read once)
        return (y if routing.exchange is None else routing.exchange.to_experts(y)), [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, routing: Routing = None, **kwargs):
        ctx = ctxs[0]
        if not ctx.input_requires_grad:
            return None, [()], [()]
        (inv,) = ctx.saved_tensors
        if ctx.exchange is not None:
            dy = ctx.exchange.from_experts(dy)
        dx = gather_sum(dy.reshape(-1, dy.shape[-1]), inv.view(-1, ctx.top_k))  # each token's k copies, in order
        dx = dx.reshape(ctx.input_shape)
        if routing is not None:
            routing.fresh_dx = dx
        return dx, [()], [()]

    def reference_forward(self, x, routing: Routing):
        x2d = self._rows(x, routing)
        y = x2d[self.gather_index(routing)]
        return y if routing.exchange is None else to_experts_autograd(y, routing.exchange)


class Combine(BasicOperation):
    """Back to token order, weighted by the router probabilities, summed over ``top_k``: input
    [T * k, H] in :class:`Dispatch`'s order, output [..., H] in the Router input's leading shape,
    ``y[t] = sum_j probs[t, j] * x[position of copy (t, j)]`` (float32 probabilities and
    accumulation, one pass: :func:`~fusible_ops.kernels.moe_combine.gather_sum`). Backward gives
    the copies' gradient and, when the router needs it, the probabilities' gradient
    ``dprobs[t, j] = <dy[t], x[position of copy (t, j)]>`` (handed to the Router), both in one
    pass over ``dy`` (:func:`~fusible_ops.kernels.moe_combine.combine_bwd`); it keeps the input
    only when the router needs ``dprobs``.

    After an expert-parallel :class:`Dispatch` the input is the local experts' rows; they go back
    to their tokens' ranks first (the reverse all-to-all), so ``dprobs`` is computed on the
    token's own rank; backward sends the copies' gradient to the experts' ranks."""

    routing_role = "combine"

    @classmethod
    def _example(cls, n: int, **factory):
        return cls(), n

    @staticmethod
    def _rows(x, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """(x as [T * k, H] rows in Dispatch's order, the [T, k] row index of each token's copies)."""
        t, k = routing.num_tokens, routing.top_k
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.shape[0] != t * k:
            raise ValueError(f"Combine: the input has {x2d.shape[0]} rows; the Router routed {t} tokens to "
                             f"top_k={k} experts each ({t * k} copies)")
        return x2d, routing.inv_perm.view(t, k)

    def fuser_forward(self, ctxs, x, *, extra_inputs, routing: Routing = None, **kwargs):
        _need_routing(self, routing)
        check_input(self, x)
        ctx = ctxs[0]
        exchange = routing.exchange
        x2d, index = self._rows(x if exchange is None else exchange.from_experts(x, "Combine"), routing)
        y = gather_sum(x2d, index, routing.probs).reshape(*routing.token_shape, x2d.shape[1])
        if ctx.requires_grad:
            ctx.probs_grad = routing.probs_grad
            ctx.save_for_backward(x2d if ctx.probs_grad else None,
                                  routing.probs if ctx.input_requires_grad else None, index)
            ctx.input_shape, ctx.exchange = x.shape, exchange
        return y, [()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, routing: Routing = None, **kwargs):
        ctx = ctxs[0]
        rows, p, index = ctx.saved_tensors
        dx, dprobs = combine_bwd(dy.reshape(-1, ctx.input_shape[-1]), rows if ctx.probs_grad else None, index,
                                 p if ctx.input_requires_grad else None)
        if ctx.probs_grad:
            routing.dprobs = dprobs
        if dx is not None:
            dx = (dx if ctx.exchange is None else ctx.exchange.to_experts(dx)).reshape(ctx.input_shape)
        return dx, [()], [()]

    def reference_forward(self, x, routing: Routing):
        if routing.exchange is not None:
            x = from_experts_autograd(x.reshape(-1, x.shape[-1]), routing.exchange, "Combine")
        x2d, index = self._rows(x, routing)
        rows = x2d[index]  # [T, k, H]
        y = (rows * routing.probs.to(x.dtype).unsqueeze(-1)).sum(1)
        return y.reshape(*routing.token_shape, rows.shape[-1])


def _check_top_k(router: Router, sel: torch.Tensor, ids: torch.Tensor, tol) -> None:
    """Given expert ids must be a top-k of the selection scores ``sel``: no unselected expert
    scores more than ``rtol * |score| + atol * max(1, max |sel|)`` above a selected one."""
    if ids.shape != (sel.shape[0], router.top_k):
        raise ValueError(f"Router: given expert ids have shape {list(ids.shape)}, expected {[sel.shape[0], router.top_k]}")
    if sel.numel() == 0 or router.top_k == router.num_experts:
        return
    rtol, atol = tol if tol is not None else (0.0, 0.0)
    chosen = sel.gather(1, ids).min(-1).values
    others = sel.scatter(1, ids, float("-inf")).max(-1).values
    slack = rtol * others.abs() + atol * max(1.0, sel.abs().max().item())
    if (others > chosen + slack).any():
        t = int((others - chosen - slack).argmax())
        raise AssertionError(f"Router: the run's experts {ids[t].tolist()} for token {t} are not a top-{router.top_k} "
                             f"of the reference selection scores {sel[t].tolist()} (rtol {rtol}, atol {atol})")


def _need_routing(op, routing) -> None:
    if routing is None:
        raise RoutingError(f"{type(op).__name__} got no routing: it must run inside a fuser (a Sequential) "
                           f"together with its Router, Dispatch and Combine")


def _swiglu():
    from .activation import SwiGLU

    return SwiGLU()
