"""Replay of fused CUDA training calls from C++: the host path without Python.

A fused call's forward and backward cost far more host time in Python (the autograd function, the
fuser, the ops, the launchers: 25 frames) than its launches do. For plans whose ops opt in
(``replayable``), the fuser records one call per input geometry and replays it: a C++ autograd node
(``csrc/replay.cpp``) allocates the same tensors and launches the same compiled Triton binaries,
with the same integers, through the CUDA driver, in forward and in backward.

How a geometry gets its recipe:

1. Its first call takes the Python path (Triton compiles and caches the binaries).
2. Its second call is recorded first: the plan's forward and its backward (on a scratch gradient)
   run on the call's own inputs (detached) under a recorder that sees every launch of a cached
   binary and every ATen op. It accepts allocations, views and ATen ops whose results depend on
   their inputs alone (GEMMs, adds, column sums: replayed through the dispatcher). A compile or
   an autotuning run makes the next call record again; any other ATen op (a host read, a random
   draw), a dropout seed or a pointer into memory that is neither an input nor an allocation of
   the call makes the geometry Python-only for good.
3. Every call of the geometry, the second included, then runs the recipe (``Recipe`` in C++),
   which checks the inputs' sizes, strides, dtypes, device and pointer alignment against the
   recording and declines (the call takes the Python path) on any difference.

FP8: plans under :class:`~fusible_ops.Float8CurrentScaling` are replayed too (the amaxes, scales
and casts are launches and ATen ops on the call's own tensors). The cached FP8 weights the recorded call read become inputs
after the call's own: before each replay, :func:`~fusible_ops.quantization.cached_weight` hands
them over (one host-side check per weight; a cast when the weight changed, e.g. after an optimizer
step). Delayed scaling is not replayed (each call updates its amax history), nor is block scaling.

What must hold for an op to set ``replayable``: see :attr:`FusibleOperation.replayable` (in
short, only what the recorder accepts, every argument a function of the inputs' geometry and the
op's attributes, and gradients returned to autograd as they are: no plan of an op flagged for
``main_grad`` or delayed weight gradients is replayed). The recorder checks the first part on the
recorded call.

Built on the fuser (this module imports it; the fuser does not import this one): the plan
extension registered here when the module is imported (``import fusible_ops`` imports it) gives
each new plan its :class:`Replayer` (:func:`replayer_for`), once per plan.

The C++ extension is built with ``torch.utils.cpp_extension`` on the first recording in a process
(about 30 s the first time; cached on disk by torch). ``FUSIBLE_OPS_REPLAY=0`` (or setting
:data:`ENABLED` to False), or a build that fails (a warning says why), leaves every call on the
Python path.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import fuser as _fuser
from .fuser_extensions import PlanExtension, register_plan_extension
from .grad import WeightGradMixin, scheduler_active, watch_plain_weights
from .kernels import current_mode
from .quantization.recipes import amax_reduction_group
from .kernels import launch as _launch
from .quantization.casting import replay_weight_tensors, replay_weights
from .quantization.recipes import Float8CurrentScaling
from .replay_steps import (_BwdSlots, _geometry, _lifetimes, _ref, _Refuse, _renumber, _Slots,
                           _steps, _used)

ENABLED = os.environ.get("FUSIBLE_OPS_REPLAY", "1") != "0"
"""Replay eligible fused CUDA training calls from C++ (see the module docstring)."""

_EXT: list = [None]  # the built extension; False once a build failed


def extension():
    """The C++ replay extension, built on first use (None when it cannot be built)."""
    ext = _EXT[0]
    if ext is None:
        try:
            from torch.utils import cpp_extension

            src = os.path.join(os.path.dirname(__file__), "csrc", "replay.cpp")
            ext = cpp_extension.load(name="fusible_ops_replay", sources=[src], extra_cflags=["-O2"], with_cuda=True)
        except Exception as e:  # no compiler, no CUDA headers: the Python path serves every call
            warnings.warn(f"fusible_ops: the C++ replay extension could not be built, fused calls keep the "
                          f"Python host path ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)
            ext = False
        _EXT[0] = ext
    return ext or None


_ALLOC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty_strided.default}
_NOT_REPLAYED = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.nondeterministic_seeded)


def _op_refusal(func) -> Optional[str]:
    """Why an ATen op cannot be replayed with its recorded arguments, or None."""
    if func.namespace != "aten":
        return f"{func} is not an ATen op"
    if any(t in func.tags for t in _NOT_REPLAYED):
        return f"{func}: its output depends on data or on a random generator"
    returns = func._schema.returns
    if not returns or any(str(r.type) != "Tensor" for r in returns):
        return f"{func} returns something other than tensors"
    return None


class _Recorder(TorchDispatchMode):
    """Sees the ATen ops and the cached-binary launches of a recorded call (one phase at a time):
    ``allocs`` (tensors, kept alive while recording so that no address is reused) and ``steps``
    (``("launch", entry, grid, raw)`` and ``("op", func, args, kwargs, out)`` in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list = []
        self.steps: list = []
        self.failure: Optional[str] = None
        self.transient = False
        self.thread = threading.get_ident()  # (launches of other threads are not this call's)

    def fail(self, why: str, transient: bool = False) -> None:
        """Refuse the recording; ``transient``: a later call may succeed (a kernel compiled or
        autotuned during this one)."""
        if self.failure is None and threading.get_ident() == self.thread:
            self.failure, self.transient = why, transient

    def launch(self, entry, grid, raw) -> None:
        if threading.get_ident() == self.thread:
            self.steps.append(("launch", entry, tuple(grid), list(raw)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOC:
            if out.device.type != "cuda":
                self.fail(f"{func} on {out.device}")
            self.allocs.append(out)
        elif not getattr(func, "is_view", False):
            why = _op_refusal(func)
            if why is None:
                self.steps.append(("op", func, args, kwargs, out))
            else:
                self.fail(why)
        return out

    def __enter__(self):
        _launch.RECORDER[0] = self
        return super().__enter__()

    def __exit__(self, *exc):
        _launch.RECORDER[0] = None
        return super().__exit__(*exc)


RETRY = object()
"""What :func:`record` returns when the next call of the geometry should be recorded again."""

def record(fuser, plan, inputs: list, n_extra: int, weights: Optional[list] = None):
    """Record one call of ``plan`` on ``inputs`` (x, the extra inputs, the parameters) and build
    its recipe; None when it cannot be replayed, :data:`RETRY` when a later call may be (the reason
    in ``record.last_failure``). ``weights`` (a list) gets ``(owner, weight, recipe, transposed,
    grouped, record)`` of each cached FP8 weight the call read (inputs of the recipe after ``inputs``)."""
    ext = extension()
    if ext is None:
        record.last_failure = "the C++ extension could not be built"
        return None
    try:
        return _build(ext, fuser, plan, inputs, n_extra, _fuser._RAW_APPLY, _fuser._FuserFunction,
                      [] if weights is None else weights)
    except _Refuse as e:
        record.last_failure = str(e)
        return RETRY if e.transient else None
    except Exception as e:  # (e.g. an earlier kernel's device-side assert): the Python path meets it too
        record.last_failure = f"{type(e).__name__}: {e}"
        return RETRY


record.last_failure = None
record.last_summary = None


def _names(steps) -> str:
    return "[" + ", ".join(s[1][4].src.fn.__name__ if s[0] == "launch" else str(s[1]) for s in steps) + "]"


def explain(module) -> list[str]:
    """One line per input geometry that ``module``'s fusers have recorded (a ``Sequential``, a
    fuser, or any module holding them): what its replay runs (allocations, kernels and ATen ops
    per direction), or why it takes the Python path."""
    lines, fuser_type = [], _fuser.OperationFuser
    for m in module.modules() if isinstance(module, torch.nn.Module) else [module]:
        fusers = [m] if isinstance(m, fuser_type) else [
            s for s, _ in (getattr(m, "_stages", None) or ()) if isinstance(s, fuser_type)]
        for f in fusers:
            for plan in f._plans.values():
                if plan.replay is not None:
                    lines.extend(plan.replay.notes.values())
    return lines


@contextlib.contextmanager
def _unrecorded():
    """Hides what runs inside from the recorder (an FP8 weight cast made while recording: the
    cached weight is an input of the recorded call, not part of it)."""
    rec, _launch.RECORDER[0] = _launch.RECORDER[0], None
    try:
        with _disable_current_modes():
            yield
    finally:
        _launch.RECORDER[0] = rec


def _check_distinct(inputs) -> list:
    """``(j, i)`` for each input j that is input i (one tensor passed twice, e.g. split sizes for two
    grouped linears); refuses inputs that otherwise share memory."""
    aliases, distinct = [], []
    for j, t in enumerate(inputs):
        i = next((i for i in distinct if inputs[i] is t), None)
        if i is None:
            distinct.append(j)
        else:
            aliases.append((j, i))
    spans = sorted((inputs[i].untyped_storage().data_ptr(), inputs[i].untyped_storage().nbytes()) for i in distinct)
    if any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise _Refuse("inputs share memory")
    return aliases


def _build(ext, fuser, plan, inputs, n_extra, raw_apply, fn, weights: list):
    _check_distinct(inputs)
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with _Recorder() as rec, replay_weights(_unrecorded) as seen:
        y = raw_apply(leaves[0], fuser, plan, n_extra, *leaves[1:])[0]
    weights.extend(seen)
    if rec.failure:
        raise _Refuse(rec.failure, rec.transient)
    if y.grad_fn is None:
        raise _Refuse("the forward made no autograd node")
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    with _Recorder() as rec2:
        grads = fn.backward(y.grad_fn, dy)
    if rec2.failure:
        raise _Refuse(rec2.failure, rec2.transient)
    input_grads = [grads[0], *grads[4:]]
    if len(input_grads) != len(inputs):
        raise _Refuse("the backward's gradients do not match the inputs")
    # FP8: the cached weights the call read are inputs too (each replay passes them in, cast anew
    # when their parameter changed), after the call's own inputs
    extra = replay_weight_tensors(weights)
    inputs, input_grads = [*inputs, *extra], [*input_grads, *[None] * len(extra)]
    aliases = _check_distinct(inputs)
    fwd = _Slots(inputs, rec.allocs)
    fwd_steps = _steps(rec.steps, fwd, ext.param_info)
    out = _ref(y, fwd)
    if fwd.kind[out[0]] == "given":
        raise _Refuse("the output is an input")
    # Backward: the gradient, the forward tensors it reads (saved, found on first use), its own.
    saved: list = []
    bwd = _BwdSlots([dy], rec2.allocs, fwd, saved)
    bwd_steps = _steps(rec2.steps, bwd, ext.param_info)
    grad_refs = [None if g is None else _ref(g, bwd) for g in input_grads]
    # Replay numbering (unused allocations dropped): forward [inputs, allocs, op outputs];
    # backward [dy, saved..., allocs, op outputs].
    f_map = fwd.numbering(_used(fwd_steps) | {out[0]} | set(saved))
    b_map = bwd.numbering(_used(bwd_steps) | {g[0] for g in grad_refs if g is not None})
    used_inputs = {q[1] for s in fwd_steps if s[0] != "op" for q in s[5]}
    used_inputs |= {s for s in saved if s < len(inputs)}  # (backward launches point into them too)
    in_geo = [_geometry(t, t.data_ptr() % 16 if i in used_inputs else -1) for i, t in enumerate(inputs)]
    if out[1] and out[0] in saved:
        raise _Refuse("the backward reads an output that is a view")
    f_allocs = [_geometry(t, 0) for i, t in enumerate(fwd.tensors) if fwd.kind[i] == "alloc" and i in f_map]
    b_allocs = [_geometry(t, 0) for i, t in enumerate(bwd.tensors) if bwd.kind[i] == "alloc" and i in b_map]
    record.last_summary = (f"forward: {len(f_allocs)} allocations, {_names(rec.steps)}; "
                           f"backward: {len(b_allocs)} allocations, {_names(rec2.steps)}")
    fwd_steps, bwd_steps = _renumber(fwd_steps, f_map), _renumber(bwd_steps, b_map)
    out_slot, saved_slots = f_map[out[0]], [f_map[s] for s in saved]
    grad_slots = [(-1, False, [], [], 0) if g is None else [b_map[g[0]], *g[1:]] for g in grad_refs]
    return ext.make_recipe(
        y.device.index, in_geo, f_allocs, fwd_steps,
        _lifetimes(fwd_steps, len(inputs), len(f_allocs), {out_slot, *saved_slots}),
        [[out_slot, *out[1:]]], saved_slots, [_geometry(dy, 0)], b_allocs, bwd_steps,
        _lifetimes(bwd_steps, 1 + len(saved), len(b_allocs), {g[0] for g in grad_slots}),
        grad_slots, aliases)


def replayer_for(fuser, plan, device_type: str, n_extra: int, recipe) -> Optional["Replayer"]:
    """The :class:`Replayer` of a new plan, or None when its calls are never replayed: not a CUDA
    training plan, delayed or block FP8 scaling (delayed: an amax history each call updates), MoE routing,
    flagged contract weights, parametrized weights, extra outputs, channels, or a step that is not
    ``replayable``."""
    if not (ENABLED and plan.requires_grad and device_type == "cuda" and fuser._routing is None
            and (recipe is None or type(recipe) in _REPLAYED_RECIPES)
            and not fuser._wgrad_flagged and not fuser._parametrized and fuser.num_extra_outputs == 0
            and fuser._channels is None
            and all(g.op.replayable for g in plan.forward + plan.backward)):
        return None
    if any(isinstance(op, WeightGradMixin) for op in fuser.ops):
        # A replay returns contract weights' gradients to autograd (plain mode): under a
        # delayed_wgrad() entered around the backward, its hooks deliver them.
        watch_plain_weights(fuser)
    return Replayer(fuser, plan, n_extra)


def _attach(fuser, plan, layout, n_extra: int, recipe) -> None:
    """The plan extension's hook (once per new plan of every fuser): ``plan.replay``. None for a
    plan made while torch.compile traces (compiled calls are never replayed; the replayer's
    registrations would be state dynamo guards on: a recompile on the next call)."""
    plan.replay = None if torch.compiler.is_compiling() else replayer_for(
        fuser, plan, plan.device_type, n_extra, recipe)


# (no state but the weight cache; block scaling: its recordings did not reproduce the Python path
# on an H200, see tests/test_replay_fp8.py, so it keeps the Python path)
_REPLAYED_RECIPES = (Float8CurrentScaling,)
_autocast = torch.is_autocast_enabled
_MAX_TRIES = 3  # recordings per geometry that compile or autotune before it stays Python-only


class Replayer:
    """A plan's recipes, per input geometry (see the module docstring). :meth:`run` returns the
    call's output, or None when the call must take the Python path."""

    def __init__(self, fuser, plan, n_extra: int) -> None:
        # (held weakly: the fuser holds the plan, which holds this; strong references back would be
        # a cycle that keeps the model's parameters alive after ``del`` until the cyclic GC runs)
        self._fuser, self._plan, self.n_extra = weakref.ref(fuser), weakref.ref(plan), n_extra
        self.recipes = _launch.geometry_cache()  # (emptied with the launch geometries: tiling may change)
        self.run_recipe = None
        self.replayed = 0  # calls served (tests read it)
        self.notes: dict = {}  # geometry -> what explain() reports
        # FP8: the cached weights the recorded calls read, passed in after the call's own inputs
        # (owner and parameter held weakly; None until a recording)
        self.weights: Optional[list] = None

    def __getstate__(self) -> dict:
        # A copy (copy.deepcopy, pickling) records its own recipes: a recipe is a C++ object
        # bound to this process's compiled kernels.
        return {"fuser": self.fuser, "plan": self.plan, "n_extra": self.n_extra}

    @property
    def fuser(self):
        return self._fuser()

    @property
    def plan(self):
        return self._plan()

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fuser"], state["plan"], state["n_extra"])

    def run(self, x: torch.Tensor, extra: tuple, params: list) -> Optional[torch.Tensor]:
        if scheduler_active() or _autocast("cuda") or amax_reduction_group() is not None:
            # (inside delayed_wgrad() at forward: the contract's Python path; under torch.autocast
            # the ATen ops of a call cast as autocast says when they run, not as when recorded;
            # an FP8 amax-reduction group: its collectives are not recorded)
            return None
        mode = current_mode()
        r = self.recipes.get(mode)  # (the recipe of the last call in this mode)
        inputs = [x, *extra, *params] if extra else [x, *params]
        if r is not None:
            full = self._with_weights(inputs) if self.weights else inputs
            if full is None:
                return None
            try:
                outs = self.run_recipe(r, full)
            except TypeError:  # (a non-tensor input: the Python path raises the op's own error)
                return None
            if outs:
                self.replayed += 1
                return outs[0]
        return self._new_geometry(mode, inputs, r)

    def _with_weights(self, inputs: list) -> Optional[list]:
        """``inputs`` and the cached FP8 weights' tensors (cast first where a weight changed);
        None when a weight's module or parameter is gone."""
        weights = [(o(), w(), *rest) for o, w, *rest in self.weights]
        if any(e[0] is None or e[1] is None for e in weights):
            return None
        return inputs + replay_weight_tensors(weights)

    def _new_geometry(self, mode: str, inputs: list, tried) -> Optional[torch.Tensor]:
        if not _launch.DIRECT or any(not isinstance(t, torch.Tensor) or not t.is_cuda for t in inputs):
            return None
        key = (mode, *[(t.shape, t.stride(), t.dtype, t.data_ptr() % 16) for t in inputs])
        r = self.recipes.get(key)
        if r is None:
            if ("seen", key) not in self.recipes:  # its first call: the Python path compiles the kernels
                _launch.remember(self.recipes, ("seen", key), True)
                return None
            if torch.cuda.is_current_stream_capturing():
                return None  # (a recording's own launches would join the graph)
            weights: list = []
            r = record(self.fuser, self.plan, inputs, self.n_extra, weights)
            if r is not None and r is not RETRY and not self._same_weights(weights):
                record.last_failure = "its FP8 weights differ from an earlier recording's"
                r = None
            shapes = [tuple(t.shape) for t in inputs]
            if len(self.notes) >= 256:  # (bounded under dynamic shapes)
                self.notes.clear()
            if r is RETRY:  # (a kernel compiled during the recording: e.g. the first call ran no backward)
                tries = _launch.remember(self.recipes, ("tries", key), self.recipes.get(("tries", key), 0) + 1)
                self.notes[key] = f"{shapes}: recording again at the next call ({record.last_failure})"
                if tries < _MAX_TRIES:
                    return None
                r = None
            self.notes[key] = (f"{shapes}: replayed; {record.last_summary}" if r is not None else
                               f"{shapes}: Python path ({record.last_failure})")
            r = _launch.remember(self.recipes, key, r or False)
            if r is not False and self.run_recipe is None:
                self.run_recipe = extension().run
        if r is False or r is tried:  # (``tried`` declined this call already)
            return None
        full = self._with_weights(inputs) if self.weights else inputs
        outs = None if full is None else self.run_recipe(r, full)
        if not outs:
            return None
        self.recipes[mode] = r
        self.replayed += 1
        return outs[0]

    def _same_weights(self, entries: list) -> bool:
        """Keeps the first recording's FP8 weights (weakly); whether ``entries`` are the same."""
        if self.weights is None:
            self.weights = [(weakref.ref(o), weakref.ref(w), *rest) for o, w, *rest in entries]
        return len(entries) == len(self.weights) and all(
            o is e[0] and w is e[1] and rest == list(e[2:]) for (o, w, *rest), e in
            zip([(a(), b(), *r) for a, b, *r in self.weights], entries))


register_plan_extension(PlanExtension("replay", _attach))

__all__ = ["ENABLED", "RETRY", "Replayer", "explain", "extension", "record", "replayer_for"]
