"""Whole-``Sequential`` CUDA graphs under the gradient contract.

:func:`make_graphed_callables` wraps ``torch.cuda.make_graphed_callables`` for fusible modules
and keeps every rule of :mod:`fusible_ops.grad` true under replay, which the plain torch
function does not on its own:

* **Warm-up leaves no trace.** Warm-up runs forward and backward for real (on a side stream: it
  also runs Triton's autotuning, which must not happen during capture). Their weight gradients
  would land in ``main_grad`` and their delayed weight gradients would stay queued; both are
  undone (``main_grad`` values, ``grad_added_to_main_grad`` flags and queues are restored), so
  the first replay starts from the state the caller had.
* **``.grad`` accumulates as in eager.** Every trainable parameter in plain ``.grad`` mode gets
  a zero ``.grad`` before capture if it has none: autograd then adds each replay's gradient into
  it instead of adopting the graph's static gradient buffer (which the next replay would
  overwrite). Zero gradients between steps with ``zero_grad(set_to_none=False)``.
* **main_grad accumulates inside the graph**, exactly once per replay; after each backward
  replay the ``grad_added_to_main_grad`` flags are set again (Python code of the op's backward
  does not run under replay, so the wrapper does it) and the returned gradient is the same
  dummy-or-None as in eager.
* **Frozen weights** do no weight-gradient work (the captured backward has none).
* **Delayed weight gradients** (ops with ``delay_wgrad_compute=True``) are captured in their own
  graph per op; after each backward replay ``op.backward_dw()`` replays it (then runs the op's
  wgrad hooks in Python, as in eager). The :func:`~fusible_ops.delayed_wgrad` scheduler is not
  supported under capture (set ``delay_wgrad_compute`` on the ops instead).
* **FP8 weights** (under :func:`fusible_ops.autocast`) are cast once per change, as in eager:
  the graphs read the cached FP8 weight's buffers, and before a forward replay the wrapper
  re-casts into them each weight whose version counter moved (an optimizer step or any other
  in-place update on the host); micro-batches between optimizer steps replay with no weight cast.
  An update the host does not see (an optimizer step captured in a graph of its own) is not
  detected: pass ``fp8_weight_cache=False`` then, and the cast is captured and runs on every
  replay (as under a plain ``torch.cuda.graph`` capture).
* **Dropout** draws its seed on the device from the CUDA generator, so each replay draws a new
  mask (forward and backward of one replay agree).
* **Inputs**: every sample argument must be a CUDA tensor; grouped-linear split sizes are read on
  the device, so they may change between replays (same total rows).

Capture-unsafe paths raise a clear error naming the op (e.g. split sizes on the CPU, which the
op would read on the host).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Union

import torch

from .fuser import cpu_autograd
from .grad import WeightGradMixin
from .op import FusibleOperation
from .quantization.casting import graph_weight_cache, refresh_graph_weights

Callables = Union[torch.nn.Module, tuple]


def _weight_ops(modules) -> list:
    """The weight-owning basic ops inside ``modules`` (also those a fusible module such as
    ``fo.Linear`` holds as its ``basic_ops`` rather than as child modules)."""
    seen, out = set(), []
    for m in modules:
        for sub in m.modules():
            for op in (sub.basic_ops if isinstance(sub, FusibleOperation) else (sub,)):
                if isinstance(op, WeightGradMixin) and id(op) not in seen:
                    seen.add(id(op))
                    out.append(op)
    return out


def _wgrad_params(op) -> list[torch.Tensor]:
    """The parameters whose gradients go through the contract (the weight)."""
    w = getattr(op, "weight", None)
    return [w] if isinstance(w, torch.Tensor) and w.requires_grad else []


class _State:
    """main_grad values, contract flags and queues of every weight-owning op, restorable."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.params = [(op, p) for op in ops for p in _wgrad_params(op)]
        self.main_grads = []
        for op, p in self.params:
            mg = getattr(p, "main_grad", None) if op.accumulate_into_main_grad else None
            self.main_grads.append(mg.clone() if mg is not None else None)
        self.flags = [(p.__dict__.get("grad_added_to_main_grad", _MISSING),
                       p.__dict__.get("skip_backward_post_hook", _MISSING)) for _, p in self.params]

    def restore(self) -> None:
        with torch.no_grad():
            for (op, p), saved in zip(self.params, self.main_grads):
                if saved is not None:
                    p.main_grad.copy_(saved)
        for (_, p), flags in zip(self.params, self.flags):
            for name, value in zip(("grad_added_to_main_grad", "skip_backward_post_hook"), flags):
                if value is _MISSING:
                    p.__dict__.pop(name, None)
                else:
                    setattr(p, name, value)
            p.__dict__.pop("_main_grad_written_by", None)
        for op in self.ops:
            op.__dict__["_pending_wgrads"] = []


_MISSING = object()


def _check_args(modules, sample_args) -> None:
    for j, (m, args) in enumerate(zip(modules, sample_args)):
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"make_graphed_callables: sample argument {i} of callable {j} is a "
                                f"{type(a).__name__}; every argument of a captured graph must be a CUDA tensor")
            if not a.is_cuda:
                raise ValueError(
                    f"make_graphed_callables: sample argument {i} of callable {j} ({type(m).__name__}) is on "
                    f"{a.device}; every argument of a captured graph must be a CUDA tensor (grouped-linear "
                    f"split sizes too: the ops read them on the device)")
        for p in m.parameters():
            if p.requires_grad and not p.is_leaf:
                raise ValueError("make_graphed_callables: parameters must be leaves")


@contextlib.contextmanager
def _without_user_hooks(op):
    """Users' wgrad hooks do not run while ``backward_dw`` is warmed up or captured (they run at
    replay time, in Python)."""
    hooks = op.__dict__["_wgrad_hooks"]
    op.__dict__["_wgrad_hooks"] = []
    try:
        yield
    finally:
        op.__dict__["_wgrad_hooks"] = hooks


def _warm_delayed_wgrads(ops) -> None:
    """Run the weight gradients a warm-up backward queued, so their kernels tune and compile here
    rather than inside the capture of ``backward_dw`` (tuning synchronizes, which a capture
    refuses). What they add to ``.grad`` is put back here; ``main_grad`` and the contract flags
    are put back by ``_State.restore``."""
    for op in ops:
        if not op.has_pending_wgrad():
            continue
        saved = [(p, None if p.grad is None else p.grad.clone()) for p in _wgrad_params(op)]
        with _without_user_hooks(op):
            op.backward_dw()
        with torch.no_grad():
            for p, g in saved:
                if g is None:
                    p.grad = None
                else:
                    p.grad.copy_(g)


def _warmup(modules, sample_args, ops, iters: int) -> None:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(iters):
            for m, args in zip(modules, sample_args):
                out = m(*args)
                outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
                inputs = [a for a in args if a.requires_grad] + [p for p in m.parameters() if p.requires_grad]
                if outs and inputs:
                    torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=True)
                del out, outs
            _warm_delayed_wgrads(ops)
    torch.cuda.current_stream().wait_stream(stream)


class _GraphedWgrad:
    """A pending delayed weight gradient that replays a captured graph (see ``backward_dw``)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, params: list, keep_alive: list) -> None:
        self.graph = graph
        self.params = params
        self.keep_alive = keep_alive  # the captured closures' tensors live in the graph's pool

    def run(self) -> None:
        self.graph.replay()
        for p in self.params:
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True


def _capture_delayed(ops, pool) -> dict:
    """One graph per op with queued (captured) delayed weight gradients."""
    graphs = {}
    for op in ops:
        pending = list(op.__dict__.get("_pending_wgrads") or ())
        if not pending:
            continue
        g = torch.cuda.CUDAGraph()
        with _without_user_hooks(op), torch.cuda.graph(g, pool=pool):
            op.backward_dw()
        params = []
        for p, _, _ in pending:
            if not any(p is q for q in params):
                params.append(p)
        graphs[id(op)] = _GraphedWgrad(g, params, pending)
    return graphs


def make_graphed_callables(modules: Callables, sample_args, *, num_warmup_iters: int = 3,
                           pool=None, fp8_weight_cache: bool = True) -> Callables:
    """Capture forward and backward of fusible modules (a ``Sequential``, or a tuple of them run
    in that order) in CUDA graphs, as ``torch.cuda.make_graphed_callables`` does, with the
    gradient contract intact under replay (see this module's docstring for what is guaranteed).

    ``sample_args``: a tuple of CUDA tensors per module (a tuple of such tuples for a tuple of
    modules), with the ``requires_grad`` and shapes of every later call. Returns the module(s)
    with forward replaced by graph replay, like torch's function. Call it before the first
    optimizer step of the graphed region and after attaching ``main_grad`` buffers.
    ``fp8_weight_cache``: FP8 weights are re-cast before a replay only when their version counter
    moved (False: the cast is in the graph and runs on every replay; needed when the weights are
    updated where the host cannot see it, e.g. by an optimizer step replayed from a graph). While it
    runs it holds one copy of every ``main_grad`` (to undo the warm-up's accumulation).
    """
    single = not isinstance(modules, tuple)
    mods = (modules,) if single else tuple(modules)
    args = (tuple(sample_args),) if single else tuple(tuple(a) for a in sample_args)
    if len(mods) != len(args):
        raise ValueError(f"make_graphed_callables: {len(mods)} modules but {len(args)} sample argument tuples")
    for m in mods:
        if getattr(m.__dict__.get("forward"), "_fusible_ops_graphed", False):
            raise ValueError(f"make_graphed_callables: this {type(m).__name__} is already graphed (its forward "
                             f"replays a captured graph, which a new capture cannot contain); capture the "
                             f"original module, or a copy.deepcopy of it made before graphing")
    _check_args(mods, args)
    ops = _weight_ops(mods)
    for op in ops:
        if op.has_pending_wgrad():
            raise RuntimeError(f"make_graphed_callables: {type(op).__name__} has queued weight gradients; "
                               f"run backward_dw() first")
    for m in mods:
        for p in m.parameters():
            owner_mg = any(op.accumulate_into_main_grad and any(p is q for q in _wgrad_params(op)) for op in ops)
            if p.requires_grad and p.grad is None and not owner_mg:
                p.grad = torch.zeros_like(p)
    state = _State(ops)
    # Warm-up and capture take the fused kernels and the fuser's autograd function whatever the
    # input size (small CUDA inputs otherwise run torch's own ops under PyTorch's autograd, see
    # fusible_ops.fuser.NATIVE_MAX_NUMEL): the contract bookkeeping below is built around them.
    with cpu_autograd(False):
        _warmup(mods, args, ops, num_warmup_iters)
        torch.cuda.synchronize()
        state.restore()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with graph_weight_cache(fp8_weight_cache) as fp8_weights:
            graphed = torch.cuda.make_graphed_callables(mods, args, num_warmup_iters=0, allow_unused_input=True,
                                                        pool=pool)
            graphed = tuple(graphed)  # (torch returns a tuple for a tuple of callables)
            delayed = _capture_delayed(ops, pool)
    torch.cuda.synchronize()
    state.restore()
    for m in graphed:
        _install_after_backward(m, ops, delayed, fp8_weights)
    return graphed[0] if single else graphed


def _install_after_backward(module: torch.nn.Module, ops, delayed: dict, fp8_weights: list) -> None:
    """Before each forward replay: re-cast the FP8 weights the graph reads if they changed. After
    each backward replay: set the contract flags and queue the delayed-wgrad graphs, as the ops'
    own backward would in eager mode."""
    mine = [op for op in ops if any(op is o for o in _weight_ops((module,)))]
    owners = {id(m) for m in module.modules()} | {id(op) for op in mine}
    my_fp8 = [e for e in fp8_weights if id(e[0]) in owners]
    flagged = [p for op in mine if op.accumulate_into_main_grad and id(op) not in delayed for p in _wgrad_params(op)]
    queued = [(op, delayed[id(op)]) for op in mine if id(op) in delayed]
    graphed_forward = _without_cycle(module)

    def after_backward(grad_inputs, grad_outputs):
        for p in flagged:
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True
        for op, item in queued:
            op.__dict__["_pending_wgrads"].append(item)
            for p in item.params:
                p.skip_backward_post_hook = True

    def forward(*args):
        if my_fp8:
            refresh_graph_weights(my_fp8)
        out = graphed_forward(*args)
        first = out[0] if isinstance(out, tuple) else out
        if (flagged or queued) and first.grad_fn is not None:
            first.grad_fn.register_hook(after_backward)
        return out

    forward._fusible_ops_graphed = True
    module.forward = forward


def _cells(fn) -> dict:
    """A closure's free variables by name, as cells (empty when ``fn`` has none)."""
    return dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))


def _without_cycle(module: torch.nn.Module):
    """The graphed forward torch installed on ``module``, re-made so that ``del module`` frees its
    parameters without the cyclic garbage collector.

    torch's forward closes over the module itself (``module -> forward -> module``), and its
    replay runs through an autograd function class made per capture, which holds the parameters
    (its static inputs) and is, as every class, in a cycle of its own. The forward returned here
    holds the module by a weak reference, and when the module is freed the capture's forward-side
    references (the parameters, static inputs and outputs, the forward graph) are dropped from those
    closures. An output of the module still waiting for its backward keeps its backward graph.
    Falls back to torch's forward as it is when its closure is not the one expected."""
    fwd = module.forward
    cells = _cells(fwd)
    if not {"func", "graph_training_state", "graphed", "orig_fwd"} <= cells.keys():
        return fwd
    functionalized = cells["graphed"].cell_contents
    state = cells["graph_training_state"].cell_contents
    orig = cells["orig_fwd"].cell_contents
    unbound = orig.__func__ if getattr(orig, "__self__", None) is module else None
    if unbound is None:
        return fwd
    ref = weakref.ref(module)

    def forward(*args, **kwargs):
        m = ref()
        if m.training == state:
            return functionalized(*args, **kwargs)
        return unbound(m, *args, **kwargs)

    outer = _cells(functionalized)
    graphed_cls = outer.get("Graphed")
    dropped = list(outer.values())
    if graphed_cls is not None:
        dropped += _cells(graphed_cls.cell_contents.forward).values()
    weakref.finalize(module, _drop, dropped)
    return forward


def _drop(cells: list) -> None:
    for c in cells:
        c.cell_contents = None


__all__ = ["make_graphed_callables"]
