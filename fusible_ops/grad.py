"""The one gradient contract for every op that owns a weight (and every fused op computing
their weight gradients). All weight gradients go through :func:`deliver_weight_grad`.

The table (W = the weight parameter; "returned" = what the op gives autograd for W):

====================  ===========================  ==========================================
accumulate_into_      W has                        result
main_grad             ``grad_added_to_main_grad``
====================  ===========================  ==========================================
False                 (ignored)                    returned: the gradient; autograd adds it to
                                                   an existing ``W.grad``
True                  no                           GEMM adds into ``W.main_grad`` (overwrites if
                                                   ``W.overwrite_main_grad``); returned: None
True                  yes                          as above, then ``W.grad_added_to_main_grad =
                                                   True``; returned: a cached dummy (zeros if
                                                   ``W.zero_out_wgrad``, else uninitialized)
====================  ===========================  ==========================================

Delayed (``delay_wgrad_compute=True`` or inside :func:`delayed_wgrad`): returned: None at
backward; the work is queued on the op and done by ``op.backward_dw()`` (or
:func:`flush_wgrad`), which writes into main_grad per the table, or adds into ``W.grad``
(never assigns over an existing one), then runs the op's wgrad hooks. While work is pending
``W.skip_backward_post_hook = True``. Frozen W (``requires_grad=False``): no work at all, no
main_grad needed. Biases always go through autograd.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import torch

from . import data_parallel

# compute(out, accumulate) -> Tensor: computes dW (shape of W). With `out` given it writes
# into `out` (adding if `accumulate`) and returns it; with out=None it returns a new tensor.
WgradCompute = Callable[[Optional[torch.Tensor], bool], torch.Tensor]

_sched_lock = threading.Lock()
_sched_depth = [0]  # process-wide: autograd runs CUDA backward on its own threads
_sched_ops: dict[int, object] = {}  # id -> op, ops with scheduler-queued work, in order


@contextlib.contextmanager
def delayed_wgrad():
    """Delay every weight gradient computed inside (e.g. around ``loss.backward()``);
    :func:`flush_wgrad` computes them later."""
    with _sched_lock:
        _sched_depth[0] += 1
        if _sched_depth[0] == 1:
            _late_handles.extend(_hook_plain_weights())
    try:
        yield
    finally:
        with _sched_lock:
            _sched_depth[0] -= 1
            if _sched_depth[0] == 0:
                for h in _late_handles:
                    h.remove()
                _late_handles.clear()


def scheduler_active() -> bool:
    return _sched_depth[0] > 0


def flush_wgrad() -> None:
    """Compute every weight gradient delayed by :func:`delayed_wgrad`, in the order queued."""
    with _sched_lock:
        ops = list(_sched_ops.values())
        _sched_ops.clear()
    for op in ops:
        op.backward_dw()


def main_grad_of(op, param: torch.Tensor, shape: Optional[tuple] = None, mg: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``param.main_grad`` (or ``mg``: a data-parallel wrapper's accumulator), validated: present,
    and viewable as ``shape`` (default: the param's shape) without a copy. Returns that view."""
    name = type(op).__name__
    if mg is None:
        mg = getattr(param, "main_grad", None)
    if mg is None:
        raise RuntimeError(
            f"{name}: accumulate_into_main_grad=True but the weight has no main_grad buffer "
            f"(attach weight.main_grad, e.g. a float32 tensor of shape {tuple(param.shape)})"
        )
    shape = tuple(shape) if shape is not None else tuple(param.shape)
    if mg.device != param.device:
        raise RuntimeError(f"{name}: main_grad is on {mg.device}, weight on {param.device}")
    try:
        view = mg.view(shape)
    except RuntimeError:
        view = None
    if view is None or mg.numel() != _prod(shape) or not view.is_contiguous():
        raise RuntimeError(
            f"{name}: main_grad must be one contiguous buffer viewable as {list(shape)} without a copy; "
            f"got shape {list(mg.shape)} with stride {list(mg.stride())}"
        )
    return view


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _dummy_grad(op, param: torch.Tensor) -> torch.Tensor:
    """A cached stand-in gradient for autograd once the real one is in main_grad."""
    zero = bool(getattr(param, "zero_out_wgrad", False))
    cache = op.__dict__.setdefault("_dummy_wgrads", {})
    key = (id(param), zero, param.dtype, param.device, tuple(param.shape))
    d = cache.get(key)
    if d is None:
        d = torch.zeros_like(param) if zero else torch.empty_like(param)
        cache[key] = d
    return d


_NEVER = object()


def _backward_token(param: torch.Tensor):
    """Identifies the running backward (the autograd graph task) for ``overwrite_main_grad``;
    ``None`` when the weight does not use it (no lookup, nothing for torch.compile to trace)."""
    if not getattr(param, "overwrite_main_grad", False):
        return None
    return torch._C._current_graph_task_id()


def _accumulate_into(param: torch.Tensor, token) -> bool:
    """Whether this delivery adds into main_grad. With ``overwrite_main_grad`` the FIRST
    delivery of one backward (``token``: the autograd graph task, or one ``backward_dw()``
    call) overwrites and later ones (a weight used twice) accumulate."""
    if not getattr(param, "overwrite_main_grad", False):
        return True
    if getattr(param, "_main_grad_written_by", _NEVER) == token:
        return True
    param._main_grad_written_by = token
    return False


def _apply_now(op, param: torch.Tensor, compute: WgradCompute, *, delayed: bool, token, dp=None) -> Optional[torch.Tensor]:
    """Run ``compute`` per the table. Returns what autograd gets (immediate) or None (delayed).
    ``dp``: the weight's data-parallel binding (:func:`fusible_ops.data_parallel.wrapper_of`):
    main_grad is its accumulator, autograd gets what it hands over, and under DDP a delayed
    gradient is kept on it until reduced."""
    if dp is not None and (op.accumulate_into_main_grad or (delayed and dp.keeps_delayed)):
        if op.accumulate_into_main_grad:
            mg, fresh = dp.main_grad(op, param)
            compute(main_grad_of(op, param, getattr(op, "main_grad_shape", None), mg), not fresh)
        else:
            dp.out = compute(None, False).to(param.dtype) if dp.out is None else compute(dp.out, True)
        return None if delayed else dp.take(param)
    if op.accumulate_into_main_grad:
        mg = main_grad_of(op, param, getattr(op, "main_grad_shape", None))
        compute(mg, _accumulate_into(param, token))
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
            return None if delayed else _dummy_grad(op, param)
        return None
    if delayed:
        with torch.no_grad():
            if param.grad is None:
                param.grad = compute(None, False).to(param.dtype)
            else:
                compute(param.grad, True)
        return None
    return compute(None, False)


def deliver_weight_grad(op, param: torch.Tensor, compute: WgradCompute) -> Optional[torch.Tensor]:
    """The single entry point for a weight gradient. Call it in backward only when the weight
    requires grad. Returns what the op returns to autograd for ``param``."""
    if not (op.accumulate_into_main_grad or op.delay_wgrad_compute or scheduler_active()):
        return compute(None, False)  # plain .grad mode, immediate: autograd gets the gradient
    if (param.grad_fn is not None or not param.requires_grad) and (
        op.accumulate_into_main_grad or op.delay_wgrad_compute or scheduler_active()
    ):
        raise RuntimeError(
            f"{type(op).__name__}: the weight is computed (a parametrization or a functional_call "
            f"tensor with history), so it has no main_grad and no .grad of its own; use plain .grad "
            f"mode (accumulate_into_main_grad=False, no delayed weight gradients) for it"
        )
    token = _backward_token(param)
    dp = data_parallel.wrapper_of(param)
    if op.delay_wgrad_compute or scheduler_active():
        pending = op.__dict__.setdefault("_pending_wgrads", [])
        pending.append((param, compute, token))
        param.skip_backward_post_hook = True
        if dp is not None:
            data_parallel.queued(op, dp)
        if not op.delay_wgrad_compute:
            with _sched_lock:
                _sched_ops.setdefault(id(op), op)
        return None
    return _apply_now(op, param, compute, delayed=False, token=token, dp=dp)


class ContractGate(torch.autograd.Function):
    """Identity on contract weights, for a call that runs under PyTorch's own autograd
    (:data:`fusible_ops.fuser.CPU_AUTOGRAD`: CPU, small CUDA inputs), on the weights of ops with
    ``accumulate_into_main_grad`` or ``delay_wgrad_compute`` (on every trainable contract weight
    when :func:`delayed_wgrad` is active at forward; plain-mode weights otherwise go to autograd's
    ``.grad`` accumulation, hooked by :func:`delayed_wgrad` while it is active, because an autograd
    function costs about 11 us per call on a CPU host): the ops compute with the aliases it returns
    (``ctx.gated_weight``), so each weight's gradient, computed by autograd, passes through
    :func:`deliver_weight_grad` in backward (main_grad, the flag and dummy, delayed weight
    gradients, :func:`delayed_wgrad` around the backward) exactly as the ops' own backward
    delivers it. The delivery adds the computed gradient (``compute(out, accumulate)`` adds or
    copies it into ``out``).

    Its outputs are ``detach()``-ed aliases of the weights (same storage and version counter, so
    an in-place update of a weight between forward and backward is still caught), not views: a
    view would make autograd track the view chain through every later ``t()`` of the linears
    (measured: 2-3 us per weight per call on CPU)."""

    @staticmethod
    def forward(ctx, ops, *weights):
        ctx.ops, ctx.weights = ops, weights  # (parameters, not saved activations)
        return tuple([w.detach() for w in weights])

    @staticmethod
    def backward(ctx, *grads):
        if not scheduler_active() and not any(_flagged(op) for op in ctx.ops):
            return (None, *grads)  # plain .grad mode, immediate: deliver_weight_grad's first case
        out = [None]
        for op, w, g in zip(ctx.ops, ctx.weights, grads):
            out.append(None if g is None else deliver_weight_grad(op, w, _computed(g)))
        return tuple(out)


def _flagged(op) -> bool:
    return op.accumulate_into_main_grad or op.delay_wgrad_compute


def _computed(g: torch.Tensor) -> WgradCompute:
    """A :data:`WgradCompute` for a gradient already computed."""
    def compute(out, accumulate):
        if out is None:
            return g
        return out.add_(g) if accumulate else out.copy_(g)
    return compute


# Calls under PyTorch's autograd (CPU, small CUDA inputs) gate only the weights of flagged ops (the
# gate costs an autograd function per call). A plain-mode weight's gradient goes to autograd's AccumulateGrad
# directly, which is the contract's answer unless delayed_wgrad() is active at backward: for that
# case delayed_wgrad() hooks, while it is active, the AccumulateGrad node of every plain-mode
# weight of the fusers that ran such calls (see watch_plain_weights), and the hook delivers the
# gradient through deliver_weight_grad (queued) in place of accumulating it.
_watched = weakref.WeakSet()  # fusers whose cpu_autograd plans leave plain-mode weights ungated
_late_handles: list = []


def watch_plain_weights(fuser) -> None:
    """Register a fuser whose cpu_autograd plans leave plain-mode contract weights ungated (once
    per plan made): :func:`delayed_wgrad` hooks their weights while it is active. A copy of the
    fuser (``copy.deepcopy`` of its module, unpickling) is watched too (see
    ``OperationFuser.__setstate__``)."""
    _watched.add(fuser)
    fuser.plain_watched = True


def _hook_plain_weights() -> list:
    """Node pre-hooks on the AccumulateGrad nodes of the watched fusers' trainable plain-mode
    leaf weights, one per weight (its first op delivers); returns their handles."""
    handles, seen = [], set()
    for fuser in list(_watched):
        for op in fuser.ops:
            if not isinstance(op, WeightGradMixin) or _flagged(op):
                continue
            w = getattr(op, "weight", None)
            if not isinstance(w, torch.Tensor) or not w.requires_grad or w.grad_fn is not None or id(w) in seen:
                continue
            seen.add(id(w))
            w = data_parallel.computed_with(w)  # (FSDP2: the unsharded weight the forward used)
            node = torch.autograd.graph.get_gradient_edge(w).node
            handles.append(node.register_prehook(_LateDelay(op, w)))
    return handles


class _LateDelay:
    """The pre-hook :func:`_hook_plain_weights` puts on a weight's AccumulateGrad node: under
    :func:`delayed_wgrad` the incoming gradient is delivered (queued on ``op``) and autograd
    accumulates nothing (an undefined gradient)."""

    __slots__ = ("op", "weight")

    def __init__(self, op, weight) -> None:
        self.op, self.weight = op, weight

    def __call__(self, grad_outputs):
        g = grad_outputs[0]
        if g is None or not scheduler_active():
            return None
        return (deliver_weight_grad(self.op, self.weight, _computed(g)),)


def gate_weights(gated: tuple, ctxs: list, params: list) -> None:
    """Route the plan's contract weights through :class:`ContractGate` (eager, grad mode):
    ``gated`` = (ops, their basic-op indices, their weights' indices in ``params``); each op's
    ctx gets its alias as ``ctx.gated_weight``."""
    ops, idx, pidx = gated
    views = _GATE_APPLY(ops, *[params[k] for k in pidx])
    for i, v in zip(idx, views):
        ctxs[i].gated_weight = v


def contract_weights(ops, params, counts, flagged_only: bool = False) -> Optional[tuple]:
    """:func:`gate_weights`' ``gated`` for the trainable ``weight`` of each :class:`WeightGradMixin`
    op among ``ops`` (``params``: their parameters, ``counts`` per op, flat), or None when there
    is none (computed once per plan). ``flagged_only``: only ops with ``accumulate_into_main_grad``
    or ``delay_wgrad_compute``."""
    found, k = [], 0
    for i, (op, c) in enumerate(zip(ops, counts)):
        if isinstance(op, WeightGradMixin) and (_flagged(op) or not flagged_only):
            for j, n in enumerate(op.param_names()):
                if n == "weight" and params[k + j].requires_grad:
                    found.append((op, i, k + j))
        k += c
    return (tuple([f[0] for f in found]), [f[1] for f in found], [f[2] for f in found]) if found else None


# (autograd.Function.apply minus its Python preamble, as the fuser's eager calls use it)
_GATE_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, ContractGate)


class WeightGradMixin:
    """Adds the contract's flags, ``backward_dw`` and wgrad hooks to a weight-owning op.

    The op sets ``accumulate_into_main_grad`` and ``delay_wgrad_compute`` in its constructor
    (via :meth:`_init_wgrad`) and routes every weight gradient through
    :func:`deliver_weight_grad`.
    """

    def _init_wgrad(self, accumulate_into_main_grad: bool, delay_wgrad_compute: bool) -> None:
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.__dict__["_pending_wgrads"] = []
        self.__dict__["_wgrad_hooks"] = []

    def register_wgrad_hook(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Register ``fn()`` to run after each ``backward_dw()`` that computed something.
        Returns a function that removes the hook."""
        hooks = self.__dict__["_wgrad_hooks"]
        hooks.append(fn)
        return lambda: hooks.remove(fn) if fn in hooks else None

    def has_pending_wgrad(self) -> bool:
        return bool(self.__dict__.get("_pending_wgrads"))

    def backward_dw(self) -> None:
        """Compute every queued weight gradient, in order, then run the wgrad hooks once.
        Does nothing when nothing is pending."""
        pending = self.__dict__.get("_pending_wgrads")
        if not pending:
            return
        self.__dict__["_pending_wgrads"] = []
        params = []
        for item in pending:
            if isinstance(item, tuple):
                param, compute, token = item
                with torch.no_grad():
                    _apply_now(self, param, compute, delayed=True, token=token, dp=data_parallel.wrapper_of(param))
                done = (param,)
            else:  # a captured delayed-wgrad graph (fusible_ops.graphs): replay it
                item.run()
                done = item.params
            for param in done:
                if not any(p is param for p in params):
                    params.append(param)
        for p in params:
            p.skip_backward_post_hook = False
        data_parallel.computed(self, params)  # (under a wrapper: reduced now, if their backward was synced)
        for fn in list(self.__dict__["_wgrad_hooks"]):
            fn()


def check_flagged_ops(ops, params, counts) -> bool:
    """Forward-time checks for ops with ``accumulate_into_main_grad`` / ``delay_wgrad_compute``
    (and every training call inside a DDP forward): their weights must be leaves (not
    parametrized or computed); the contract weights' data-parallel bindings are refreshed
    (:func:`fusible_ops.data_parallel.on_forward`). Returns whether one is bound to DDP."""
    k = 0
    for op, count in zip(ops, counts):
        mine, k = params[k : k + count], k + count
        flagged = getattr(op, "accumulate_into_main_grad", False) or getattr(op, "delay_wgrad_compute", False)
        if flagged and any(p.grad_fn is not None for p in mine):
            raise RuntimeError(
                f"{type(op).__name__}: accumulate_into_main_grad / delay_wgrad_compute need leaf weights, but "
                f"a weight is computed (a parametrization such as weight_norm, or a functional_call tensor "
                f"with history); use plain .grad mode for this op"
            )
    found = contract_weights(ops, params, counts)
    return found is not None and data_parallel.on_forward(found[0], [params[k] for k in found[2]])
