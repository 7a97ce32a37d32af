"""Quantizing a tensor under a recipe: :func:`quantize`, the delayed-scaling state, the weight cache.

Delayed-scaling state lives on the module that owns the weight (the ``BasicLinear``, or the
``Linear`` that lends it its weight) as two buffers: ``fp8_amax_history`` [history_len, 3] and
``fp8_scale`` [3] (columns: input, weight, grad_output). They are created on first use, so a
module that never ran delayed scaling has exactly ``torch.nn.Linear``'s state-dict keys; a
checkpoint that holds them restores them (see :class:`FP8StateMixin`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..kernels.fp8_cast import cast_block, cast_tensor, delayed_update, scale_from_amax_ref, tensor_amax
from ..training_state import VersionedStateMixin
from .recipes import (FP8_MAX, ROLES, Float8BlockScaling, Float8CurrentScaling, Float8DelayedScaling,
                      amax_reduction_group, fp8_dtype)
from .tensor import Float8Tensor, float8

_ROLE_INDEX = {r: i for i, r in enumerate(ROLES)}
_HISTORY, _SCALE = "fp8_amax_history", "fp8_scale"
# Batched updates (quantization.delayed): a module's ``__dict__[_ARMED][r]`` holds, after its
# fuser updated role r's column for this call, the (scale, newest entry) its cast takes instead of
# updating the column itself; ``_WATCH.stack[-1]`` (a list, while a fuser learns a plan's columns)
# gets (owner, role index) of each column a cast updates itself.
_ARMED = "_fp8_armed"


class _Watch(threading.local):
    stack: list

    def __init__(self) -> None:
        self.stack = []


_WATCH = _Watch()


# ---- delayed-scaling state


class FP8StateMixin(VersionedStateMixin):
    """For modules that may own delayed-scaling buffers: a checkpoint that holds them creates them
    on load (so ``load_state_dict`` restores the state exactly, also into a fresh module). With
    the buffers comes the format version buffer (:mod:`fusible_ops.training_state`)."""

    def _before_load(self, state_dict, prefix: str) -> None:
        device = _device_of(self)
        for name in (_HISTORY, _SCALE):
            t = state_dict.get(prefix + name)
            if t is not None and getattr(self, name, None) is None:
                self.register_buffer(name, torch.empty_like(t, device=device))
        if self._buffers.get(_HISTORY) is not None:
            self._add_format_entry(device)

    def _parameter_swapped(self, name: str, old: torch.Tensor, new: torch.Tensor) -> None:
        """The weight cache holds the FP8 form of the tensor this module held: a swap drops it.
        FSDP2 swaps at every unshard and reshard (and keeps the unsharded tensor's version
        counter, so the cache key could not tell two unshards apart), so each unsharded weight is
        cast once per unshard and its FP8 copy does not outlive the reshard. A swap from or to a
        ``DTensor`` (FSDP2's sharded parameter) marks the module sharded: see
        :func:`weight_for_backward`."""
        weight_swapped(self, old, new)
        super()._parameter_swapped(name, old, new)


def weight_swapped(owner: torch.nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """``owner``'s parameter ``old`` was replaced by ``new``: drop its cached FP8 weight, and mark
    it sharded when either is a ``DTensor`` (see ``FP8StateMixin._parameter_swapped``). For a
    module that owns a weight the ops cast and sets parameters through its own ``__setattr__``."""
    owner.__dict__.pop("_fp8_weight_cache", None)
    if _is_dtensor(old) or _is_dtensor(new):
        owner.__dict__["_fp8_sharded"] = True


def _is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def _reusable(owner: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``owner``'s cached FP8 form of ``weight`` may serve a later call. Not for a weight
    that FSDP2 gathers where ``owner`` does not see the swaps (a parameter of another module, or
    of a module without our ``__setattr__``, e.g. a converted MoE block's experts): FSDP2 keeps
    its version counter and often its address across unshards, so nothing in the cache key would
    tell that the bytes were gathered again after an optimizer step; such a weight is cast at
    every call (and marked sharded). Decided once per weight object."""
    ok = _REUSE.get(weight)
    if ok is not None:
        return ok
    sees = (type(owner).__setattr__ is not torch.nn.Module.__setattr__ and hasattr(owner, "_parameter_swapped")
            and any(p is weight for p in owner._parameters.values()))
    ok = sees or not _fsdp_unsharded(weight)
    if not ok:
        owner.__dict__["_fp8_sharded"] = True
    _REUSE[weight] = ok
    return ok


_REUSE = WeakIdKeyDictionary()  # weight -> whether its cached FP8 form may be reused (see _reusable)


def _fsdp_unsharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is the unsharded parameter of an FSDP2 (``fully_shard``) module."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    for ref in list(_module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        group = getattr(state, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()):
            if getattr(fp, "_unsharded_param", None) is weight:
                return True
    return False


def _device_of(module: torch.nn.Module):
    for p in module.parameters(recurse=False):
        return p.device
    return None


def delayed_state(owner: torch.nn.Module, recipe: Float8DelayedScaling, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax_history [L, 3], scale [3])`` of ``owner``, created (history 0, scale 1) on first use
    or when the recipe's history length changes. While ``torch.compile`` traces, the state must
    exist already (a trace cannot register buffers): else a ``RuntimeError`` says to call
    :func:`init_delayed_state` first."""
    hist = owner._buffers.get(_HISTORY)
    if hist is None or hist.shape[0] != recipe.amax_history_len or hist.device != device:
        if torch.compiler.is_compiling():
            have = "none" if hist is None else f"history length {hist.shape[0]} on {hist.device}"
            raise RuntimeError(
                f"{type(owner).__name__}: Float8DelayedScaling under torch.compile needs the delayed-scaling state "
                f"(history length {recipe.amax_history_len} on {device}; found {have}) made before the first compiled "
                f"call: run fusible_ops.quantization.init_delayed_state(model, recipe) (or one eager training step "
                f"under the recipe) first."
            )
        hist = torch.zeros(recipe.amax_history_len, len(ROLES), dtype=torch.float32, device=device)
        owner.register_buffer(_HISTORY, hist)
        owner.register_buffer(_SCALE, torch.ones(len(ROLES), dtype=torch.float32, device=device))
        if isinstance(owner, VersionedStateMixin):
            owner._add_format_entry(device)
    return hist, owner._buffers[_SCALE]


def init_delayed_state(model: torch.nn.Module, recipe: Float8DelayedScaling, device=None) -> None:
    """Create, in every module of ``model`` that keeps delayed-scaling state, the buffers its
    first training call under ``recipe`` would create (history 0, scale 1, the format version),
    so that a loader filling a state dict's tensors in place (``torch.distributed.checkpoint``)
    finds them; existing buffers are kept. ``device``: for modules without parameters
    (``Quantize``); default: the device of the model's first parameter."""
    if not isinstance(recipe, Float8DelayedScaling):
        raise TypeError(f"init_delayed_state: recipe must be a Float8DelayedScaling, got {recipe!r}")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for m in model.modules():
        owner_of = getattr(m, "param_owner", None)
        if isinstance(m, FP8StateMixin) and (owner_of is None or owner_of("weight") is m):
            delayed_state(m, recipe, _device_of(m) or torch.device(device))


def _delayed_scale(owner, recipe: Float8DelayedScaling, role: str, x: torch.Tensor, record: bool = True):
    """Update ``role``'s scale from its history, start a new history entry; return (scale [1],
    the new entry [1] for the cast to raise to this tensor's amax). Device ops only.

    Weights are the exception: they are cast once per change (the weight cache), so a scale
    from past casts would lag a whole optimizer step; their scale comes from their current amax,
    written as the newest entry of their column without rolling it (so the state depends on the
    weight, not on how many times it was cast: a resumed run re-casts a frozen weight).

    ``record=False`` (an evaluation call: grad mode off, or the op in eval mode): nothing is
    written. Inputs and output gradients use the current ``fp8_scale`` (1 before any training
    call); a weight its current amax. The entry returned is None then.

    Inside a fuser's training call (:mod:`fusible_ops.quantization.delayed`) the update of an input
    or output-gradient column has usually run already, batched with the fuser's other columns:
    the cast then takes the token its fuser left on ``owner`` (the same scale and entry)."""
    if role == "weight":
        return weight_scale(owner, recipe, tensor_amax(x), record), None
    r = _ROLE_INDEX[role]
    if record:
        armed = owner.__dict__.get(_ARMED)
        if armed is not None and armed[r] is not None:  # updated already, with its fuser's other columns
            token, armed[r] = armed[r], None
            return token
    fmax = FP8_MAX[fp8_dtype(recipe, role)] / (2.0 ** recipe.margin)
    if not record:
        scale = owner._buffers.get(_SCALE)
        if scale is None:
            return torch.ones(1, dtype=torch.float32, device=x.device), None
        return scale[r : r + 1].to(x.device), None
    hist, scale = delayed_state(owner, recipe, x.device)
    delayed_update(hist, scale, r, fmax, recipe.amax_compute_algo == "max")  # one launch
    watch = _WATCH.stack
    if watch and watch[-1] is not None:
        watch[-1].append((owner, r))
    return scale[r : r + 1], hist[0:1, r]


def weight_scale(owner, recipe: Float8DelayedScaling, amax: torch.Tensor, record: bool = True) -> torch.Tensor:
    """Delayed scaling's scale [1] for a weight whose amax is ``amax`` (fp32 [1]); with ``record``,
    written into ``owner``'s state as newest entry of the weight column (not rolled) with the
    scale it gives (see :func:`_delayed_scale`). The FP8 all-gather passes the whole weight's
    amax, reduced over the shards (:mod:`fusible_ops.quantization.fsdp`)."""
    r = _ROLE_INDEX["weight"]
    fmax = FP8_MAX[fp8_dtype(recipe, "weight")] / (2.0 ** recipe.margin)
    if not record:
        return scale_from_amax_ref(amax, fmax)
    hist, scale = delayed_state(owner, recipe, amax.device)
    delayed_update(hist, scale, r, fmax, True, amax)
    return scale[r : r + 1]


def reduce_amax(amax: torch.Tensor) -> torch.Tensor:
    """An amax (current scaling's, or delayed scaling's new history entry) made the max over the
    active ``amax_reduction_group`` (in place; one all-reduce), so that every rank of the group
    casts with the scale one process holding all their rows would take. No group: unchanged.
    Delayed scaling reduces an entry as soon as its cast recorded it, so the state is the same on
    every rank of the group after every call (a checkpoint holds one copy of it)."""
    group = amax_reduction_group()
    if group is not None:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


# ---- the hand-off object


class InputQuantizer:
    """What an FP8 consumer (a linear) wants its input to be: handed to the op before it (the
    ``next_op_input_quantizer`` keyword of ``fuser_forward``) so that the producer writes FP8
    itself. Fixed per plan (the recipe is part of the plan key). :class:`GradOutputQuantizer` is
    the same for the gradient a linear's backward reads (``prev_op_grad_output_quantizer``)."""

    role = "input"

    def __init__(self, recipe, consumer) -> None:
        self.recipe = recipe
        self.consumer = consumer
        self.colwise = None  # set by the fuser's plan: whether the consumer computes its weight gradient
        self.training = None  # set by the fuser's plan: a training call (grad mode on, consumer in train mode)

    @property
    def owner(self) -> torch.nn.Module:
        """The module holding the consumer's delayed-scaling state."""
        return self.consumer.param_owner("weight")

    def need_colwise(self) -> bool:
        """Whether the consumer's weight gradient will read the transposed copy (from the plan;
        a forward inside ``autograd.Function`` runs with grad mode off, so it cannot ask that)."""
        if self.colwise is not None:
            return self.colwise
        return torch.is_grad_enabled() and self.consumer.weight.requires_grad

    def records(self) -> bool:
        """Whether the cast records delayed-scaling state: a training call (from the plan, which
        knows the call's grad mode; else grad mode now), with the consumer and the module owning
        its weight in training mode."""
        if self.training is not None:
            return self.training
        return torch.is_grad_enabled() and self.consumer.training and self.owner.training

    def __call__(self, x: torch.Tensor) -> Float8Tensor:
        """A standalone cast of ``x`` for the consumer."""
        return quantize(x, self.recipe, self.role, transposed=self.need_colwise(), owner=self.owner,
                        record=self.records())

    def fused_mode(self) -> str:
        """How a producer serves this consumer: ``"fp8"`` (delayed scaling: the scale is known
        first, the producer writes FP8 itself; with a transposed copy needed, it records the amax
        and one cast writes both layouts), ``"amax"`` (current scaling: the producer's pass
        also takes the amax, a cast follows), ``"cast"`` (block scaling, or tracing under
        torch.compile: a standalone cast of the producer's output)."""
        if torch.compiler.is_compiling() or isinstance(self.recipe, Float8BlockScaling):
            return "cast"
        return "fp8" if isinstance(self.recipe, Float8DelayedScaling) else "amax"

    def produce(self, run, like: torch.Tensor, direct: bool = True) -> Float8Tensor:
        """The consumer's FP8 input from a producer. ``run(amax=None, scale=None, fp8_dtype=None)``
        runs the producer's kernel: without ``amax`` it returns its plain output; with ``amax``
        (fp32 [1], raised to max|y|) and no ``scale`` its plain output; with ``scale`` the FP8 bytes
        q [rows, cols]. When the consumer needs the transposed copy too (its weight gradient), the
        producer writes its plain output and one cast kernel writes both layouts (the producers'
        FP8 epilogue, ``fp8_cast.fp8_epilogue``, writes no transposed copy). ``like``: a tensor
        of the producer's input dtype and device. ``direct=False``: the producer cannot write FP8
        (only its plain output and the amax)."""
        mode = self.fused_mode()
        if mode == "cast":
            return self(run())
        dtype = fp8_dtype(self.recipe, self.role)
        colwise = self.need_colwise()
        inv = torch.empty(1, dtype=torch.float32, device=like.device)
        if mode == "amax":
            amax = torch.zeros(1, dtype=torch.float32, device=like.device)
            y = run(amax=amax)
            q, qt = cast_tensor(y, reduce_amax(amax), dtype, colwise, from_amax=True, inv=inv)  # (scale: in the cast)
            return self._wrap(y.dtype, y.shape, q, qt, inv)
        scale, entry = _delayed_scale(self.owner, self.recipe, self.role, like, self.records())
        recorded = entry is not None
        if not recorded:  # (an evaluation call records nothing: the producer raises a scratch amax)
            entry = torch.zeros(1, dtype=torch.float32, device=like.device)
        if colwise or not direct:  # both layouts: the producer's pass records the amax, one cast + transpose pass
            y = run(amax=entry)
            if recorded:
                reduce_amax(entry)
            q, qt = cast_tensor(y, scale, dtype, colwise, inv=inv)
            return self._wrap(y.dtype, y.shape, q, qt, inv)
        q, qt = run(amax=entry, scale=scale, fp8_dtype=dtype), None
        if recorded:
            reduce_amax(entry)
        return self._wrap(like.dtype, (*like.shape[:-1], q.shape[-1]), q, qt, 1.0 / scale)

    def _wrap(self, dtype, shape, q, qt, inv) -> Float8Tensor:
        inv = inv.reshape(())
        return float8(q, inv, dtype, shape, scaling="tensor", data_t=qt,
                            scale_inv_t=inv if qt is not None else None, recipe=self.recipe)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.recipe).__name__}, for {type(self.consumer).__name__})"


class GradOutputQuantizer(InputQuantizer):
    """The gradient a linear's backward reads (role ``"grad_output"``: E5M2 under ``"hybrid"``),
    produced by the backward of the op after it; the transposed copy serves its weight gradient."""

    role = "grad_output"


# ---- quantize


def quantize(x: torch.Tensor, recipe, role: str, *, transposed: bool = False,
             owner: Optional[torch.nn.Module] = None, record: bool = True) -> Float8Tensor:
    """``x`` [..., K] as a :class:`Float8Tensor` under ``recipe`` for ``role`` (``"input"``,
    ``"weight"``, ``"grad_output"``). ``transposed`` also makes the column-wise copy (in the same
    pass). ``owner``: the module holding delayed-scaling state (needed for that recipe).
    ``record=False``: an evaluation cast, which changes no delayed-scaling state (it uses the
    current scale; see :func:`_delayed_scale`)."""
    if role not in _ROLE_INDEX:
        raise ValueError(f"quantize: role must be one of {ROLES}, got {role!r}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"quantize: x must be fp32/fp16/bf16, got {x.dtype}")
    if isinstance(recipe, Float8BlockScaling):
        q, s, qt, st = cast_block(x, square=(role == "weight"), pow2=recipe.power_of_two_scales,
                                  transposed=transposed)
        scaling = "128x128" if role == "weight" else "1x128"
        return float8(q, s, x.dtype, x.shape, scaling=scaling, data_t=qt, scale_inv_t=st, recipe=recipe)
    dtype = fp8_dtype(recipe, role)
    inv = torch.empty(1, dtype=torch.float32, device=x.device)
    if isinstance(recipe, Float8CurrentScaling):  # the cast kernel derives the scale from the amax
        q, qt = cast_tensor(x, reduce_amax(tensor_amax(x)), dtype, transposed, from_amax=True, inv=inv)
    elif isinstance(recipe, Float8DelayedScaling):
        if owner is None:
            raise ValueError("quantize: Float8DelayedScaling needs owner= (the module holding the amax history)")
        scale, amax_out = _delayed_scale(owner, recipe, role, x, record)
        q, qt = cast_tensor(x, scale, dtype, transposed, amax_out, inv=inv)
        if amax_out is not None:
            reduce_amax(amax_out)
    else:
        raise TypeError(f"quantize: unknown recipe {recipe!r}")
    inv = inv.reshape(())
    return float8(q, inv, x.dtype, x.shape, scaling="tensor", data_t=qt, scale_inv_t=inv if transposed else None,
                        recipe=recipe)


def with_colwise(t: Float8Tensor) -> Float8Tensor:
    """``t`` with its column-wise form: a transpose of the FP8 bytes for per-tensor scaling; for
    block scaling (whose transposed tiles need the high-precision values) a re-quantization of
    the dequantized values."""
    if t.colwise is not None:
        return t
    data, inv = t.rowwise
    if t.scaling == "tensor":
        return float8(data, inv, t.dtype, t.shape, scaling="tensor", data_t=data.t().contiguous(),
                            scale_inv_t=inv, recipe=t._recipe)
    role = "weight" if t.scaling == "128x128" else "input"
    return quantize(t.dequantize(), t._recipe, role, transposed=True)


# ---- weight cache


def _cast_weight(owner, weight: torch.Tensor, recipe, transposed: bool, grouped: bool,
                 record: bool = True) -> Float8Tensor:
    """The weight's FP8 form. ``grouped`` (experts' weights [G, N, K]): the row-wise bytes
    [G, N, K] and, with ``transposed``, the per-group transposed copy [G, K, N] (what the
    input-gradient grouped GEMM reads K-major), both for all groups at once. Per-tensor scaling:
    one scale_inv for all groups. Block scaling: 128x128 blocks of each group (N a multiple of 128,
    so no block spans two experts), scale_inv [G, N/128, K/128] and, transposed, [G, K/128, N/128].
    ``record``: see :func:`quantize`."""
    with torch.no_grad():
        if not grouped:
            return quantize(weight.detach(), recipe, "weight", transposed=transposed, owner=owner, record=record)
        G, N, K = weight.shape
        block = isinstance(recipe, Float8BlockScaling)
        if block and N % 128:
            raise ValueError(f"grouped FP8 weights under block scaling need out_features divisible by 128, got {N}")
        wq = quantize(weight.detach().reshape(G * N, K), recipe, "weight", owner=owner, record=record)
        data, inv = wq.rowwise
        data = data.view(weight.shape)
        data_t = data.view(torch.uint8).transpose(1, 2).contiguous().view(data.dtype) if transposed else None
        if not block:
            return float8(data, inv, weight.dtype, weight.shape, scaling="tensor", data_t=data_t,
                                scale_inv_t=inv if transposed else None, recipe=recipe)
        inv = inv.view(G, N // 128, inv.shape[1])
        inv_t = inv.transpose(1, 2).contiguous() if transposed else None
        return float8(data, inv, weight.dtype, weight.shape, scaling="128x128", data_t=data_t,
                            scale_inv_t=inv_t, recipe=recipe)


def cached_weight(owner: torch.nn.Module, weight: torch.Tensor, recipe, transposed: bool,
                  grouped: bool = False, record: bool = True) -> Float8Tensor:
    """The FP8 weight, quantized once per change of the weight: the cache on ``owner`` is keyed on
    the parameter's identity, storage, version counter (bumped by every in-place update, e.g. an
    optimizer step), the recipe, the forms needed and, under delayed scaling, ``record`` (an
    evaluation cast records no state, so the next training call casts again and records the
    weight's amax). Counts casts in ``owner.fp8_weight_casts``. ``grouped``: experts' weights
    [G, N, K] (see :func:`_cast_weight`).

    Under CUDA-graph capture: inside :func:`fusible_ops.make_graphed_callables` the graph reads
    the cached FP8 weight's buffers (made during its warm-up) and the graphed module re-casts into
    them before a replay only when the weight's version changed (:func:`refresh_graph_weights`);
    under any other capture the cast is captured and runs on every replay.

    While ``torch.compile`` traces, the cast is part of the graph and runs on every call (no
    cache: reading its key, the parameter's storage pointer and version, in a trace would break
    the graph, and a cache written by a trace would be guarded on); not counted."""
    record = record or not isinstance(recipe, Float8DelayedScaling)  # (only delayed scaling records)
    if getattr(weight, "fp8_gathered", False):  # FSDP2 gathered it in FP8 (quantization.fsdp): no cast
        return weight.fp8_form(owner, recipe, transposed, grouped, record and isinstance(recipe, Float8DelayedScaling))
    if torch.compiler.is_compiling():
        return _cast_weight(owner, weight, recipe, transposed, grouped, record)
    if _REPLAY is not None:  # a C++ replay records this call: the cached weight is one of its inputs
        entries, outside = _REPLAY
        entries.append((owner, weight, recipe, transposed, grouped, record))
        with outside():  # (a cast made now is not part of the recorded call)
            return _cached_weight(owner, weight, recipe, transposed, grouped, record)
    return _cached_weight(owner, weight, recipe, transposed, grouped, record)


def weight_for_backward(owner: torch.nn.Module, weight: torch.Tensor, wq) -> tuple:
    """What a forward saves for its input gradient's transposed FP8 weight: ``wq.colwise``
    (``(data_t, scale_inv_t)``). Under FSDP2 (``owner``'s parameters are sharded: see
    ``FP8StateMixin._parameter_swapped``) ``(weight, None)`` instead: the unsharded weight, whose
    memory FSDP2 frees at the reshard after forward and gathers again before backward, so no FP8
    copy of a whole weight is kept between forward and backward; :func:`weight_in_backward` then
    takes the transposed copy from the weight cache (no cast where the weight stayed unsharded, one
    per unshard where it was gathered again)."""
    if owner.__dict__.get("_fp8_sharded"):
        return weight, None
    return wq.colwise


def weight_in_backward(owner: torch.nn.Module, saved: tuple, recipe, grouped: bool, record: bool) -> tuple:
    """``(data_t, scale_inv_t)`` from what :func:`weight_for_backward` saved."""
    data, inv = saved
    if data is not None and inv is None:
        return cached_weight(owner, data, recipe, transposed=True, grouped=grouped, record=record).colwise
    return saved


def _cache_key(weight, recipe, transposed: bool, grouped: bool, record: bool) -> tuple:
    return (id(weight), weight.data_ptr(), weight._version, recipe, transposed, grouped, record)


def _cached_weight(owner, weight, recipe, transposed: bool, grouped: bool, record: bool) -> Float8Tensor:
    key = _cache_key(weight, recipe, transposed, grouped, record)
    hit = owner.__dict__.get("_fp8_weight_cache")
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        if _GRAPH_WEIGHTS is not None and hit is not None and hit[0][:2] == key[:2] and hit[0][3:] == key[3:]:
            _GRAPH_WEIGHTS.append((owner, weight, recipe, transposed, grouped, record, hit[1]))
            return hit[1]
        return _cast_weight(owner, weight, recipe, transposed, grouped, record)
    reusable = _reusable(owner, weight)
    if hit is not None and hit[0] == key and reusable:
        return hit[1]
    wq = _cast_weight(owner, weight, recipe, transposed, grouped, record)
    if reusable:
        owner.__dict__["_fp8_weight_cache"] = (key, wq)
    owner.__dict__["fp8_weight_casts"] = owner.__dict__.get("fp8_weight_casts", 0) + 1
    return wq


_GRAPH_WEIGHTS: Optional[list] = None  # set while make_graphed_callables captures
_REPLAY: Optional[tuple] = None  # (entries, outside) while a C++ replay records a call


@contextlib.contextmanager
def replay_weights(outside):
    """While a C++ replay (:mod:`fusible_ops.replay`) records a call: yields a list that gets the
    arguments ``(owner, weight, recipe, transposed, grouped, record)`` of every :func:`cached_weight` call,
    whose cast (when the weight changed) runs under ``outside()``, a context that hides it from the
    recorder. The recording then reads the cached FP8 weight as an input, and each replay passes
    it in from :func:`replay_weight_tensors`."""
    global _REPLAY
    entries: list = []
    outer, _REPLAY = _REPLAY, (entries, outside)
    try:
        yield entries
    finally:
        _REPLAY = outer


def replay_weight_tensors(entries) -> list:
    """The tensors of each entry's cached FP8 weight (from :func:`replay_weights`), in a fixed
    order: bytes, scale_inv, then the transposed bytes and scale_inv where the entry has them. A
    weight that changed since its last cast (e.g. an optimizer step) is cast first, once."""
    out = []
    for e in entries:
        wq = cached_weight(*e)
        out.append(wq._data)
        out.append(wq._scale_inv)
        if wq._data_t is not None:
            out.append(wq._data_t)
            if wq._scale_inv_t is not wq._scale_inv:
                out.append(wq._scale_inv_t)
    return out


@contextlib.contextmanager
def graph_weight_cache(enabled: bool = True):
    """Collect, while a graph is captured inside, the cached FP8 weights the graph reads: yields a
    list of ``(owner, weight, recipe, transposed, grouped, record, Float8Tensor)`` for :func:`refresh_graph_weights`
    (stays empty when not ``enabled``: the casts are captured)."""
    global _GRAPH_WEIGHTS
    entries: list = []
    outer, _GRAPH_WEIGHTS = _GRAPH_WEIGHTS, (entries if enabled else None)
    try:
        yield entries
    finally:
        _GRAPH_WEIGHTS = outer


def refresh_graph_weights(entries) -> None:
    """Before a replay: re-cast, into the buffers the graph reads, every captured FP8 weight whose
    parameter changed since its last cast (its version counter moved, e.g. an optimizer step), so
    micro-batches replayed between optimizer steps cast each weight once. One host-side check per
    weight; no work on the device when nothing changed."""
    for owner, weight, recipe, transposed, grouped, record, wq in entries:
        key = _cache_key(weight, recipe, transposed, grouped, record)
        hit = owner.__dict__.get("_fp8_weight_cache")
        if hit is not None and hit[0] == key and hit[1] is wq:
            continue
        new = _cast_weight(owner, weight, recipe, transposed, grouped, record)
        with torch.no_grad():
            wq._data.copy_(new._data)
            wq._scale_inv.copy_(new._scale_inv)
            if wq._data_t is not None:
                wq._data_t.copy_(new._data_t)
                if wq._scale_inv_t is not wq._scale_inv:
                    wq._scale_inv_t.copy_(new._scale_inv_t)
        owner.__dict__["_fp8_weight_cache"] = (key, wq)
        owner.__dict__["fp8_weight_casts"] = owner.__dict__.get("fp8_weight_casts", 0) + 1


__all__ = ["FP8StateMixin", "GradOutputQuantizer", "InputQuantizer", "cached_weight", "delayed_state", "graph_weight_cache",
           "init_delayed_state", "quantize", "refresh_graph_weights", "replay_weight_tensors", "replay_weights",
           "weight_for_backward", "weight_in_backward", "weight_scale", "weight_swapped", "with_colwise"]
