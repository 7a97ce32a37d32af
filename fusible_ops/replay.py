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

import os
import struct
import threading
import warnings
import weakref
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import fuser as _fuser
from .fuser_extensions import PlanExtension, register_plan_extension
from .grad import WeightGradMixin, scheduler_active, watch_plain_weights
from .kernels import current_mode
from .kernels import launch as _launch

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


class _Refuse(Exception):
    """The recorded call cannot be replayed (the message says why); ``transient``: the next call
    of its geometry may be (this one compiled or autotuned a kernel)."""

    def __init__(self, why: str, transient: bool = False) -> None:
        super().__init__(why)
        self.transient = transient


RETRY = object()
"""What :func:`record` returns when the next call of the geometry should be recorded again."""

_SCALARS = {"i1": "<b", "i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "u1": "<B", "u8": "<B", "u16": "<H",
            "u32": "<I", "u64": "<Q", "fp32": "<f", "fp64": "<d"}
_SIZES = {"<b": 1, "<B": 1, "<h": 2, "<H": 2, "<i": 4, "<I": 4, "<f": 4, "<q": 8, "<Q": 8, "<d": 8}


def _index(key, names) -> int:
    if isinstance(key, str):
        return names.index(key)
    return key[0] if isinstance(key, tuple) else key


def _kernel_params(ck) -> list:
    """``[(argument index or None, type)]``: the compiled kernel's parameters as its launcher passes
    them (the runtime arguments that are not constexpr, then Triton's scratch pointers: type
    ``*gscratch`` for global scratch the kernel uses, ``*scratch`` for an unused one)."""
    src, md = ck.src, ck.metadata
    names = list(src.fn.arg_names)
    sig = {_index(k, names): v for k, v in src.signature.items()}
    consts = {_index(k, names) for k in getattr(src, "constants", {})}
    params = [(i, sig[i]) for i in sorted(sig) if sig[i] != "constexpr" and i not in consts]
    if hasattr(md, "global_scratch_size"):
        if md.global_scratch_size and getattr(md, "global_scratch_align", 1) > 256:
            raise _Refuse(f"{src.fn.__name__}: global scratch aligned to {md.global_scratch_align} bytes")
        params.append((None, "*gscratch" if md.global_scratch_size else "*scratch"))
    if hasattr(md, "profile_scratch_size"):
        if md.profile_scratch_size:
            raise _Refuse(f"{src.fn.__name__} needs profile scratch")
        params.append((None, "*scratch"))
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        raise _Refuse(f"{src.fn.__name__}: cluster, cooperative or PDL launch")
    return params


class _Slots:
    """The tensors of one direction, as the replay numbers them: the given ones (inputs; in
    backward the gradient, then forward tensors it reads), then allocations, then op outputs."""

    def __init__(self, given: Sequence[torch.Tensor], allocs: Sequence[torch.Tensor]) -> None:
        self.tensors = [*given, *allocs]
        self.kind = ["given"] * len(given) + ["alloc"] * len(allocs)

    def add(self, t: torch.Tensor, kind: str) -> int:
        self.tensors.append(t)
        self.kind.append(kind)
        return len(self.tensors) - 1

    def find(self, ptr: int) -> tuple[int, int]:
        """(slot, byte offset) of a pointer into one of the tensors (inside its own extent)."""
        for i, t in enumerate(self.tensors):
            off = ptr - t.data_ptr()
            if 0 <= off < max(_extent(t), 1):
                return i, off
        raise _Refuse(f"the call reads memory that is neither an input nor made by the call ({ptr:#x})")

    def numbering(self, used: set) -> dict:
        """Slot -> replay slot: given ones in order, then the used allocations, then op outputs
        (the replay makes every op output, used or not)."""
        m, n = {}, 0
        for kind in ("given", "alloc", "op"):
            for i, k in enumerate(self.kind):
                if k == kind and (kind != "alloc" or i in used):
                    m[i] = n
                    n += 1
        return m


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _ref(t: torch.Tensor, slots: _Slots) -> list:
    """``[slot, view, sizes, strides, element offset]`` of a tensor a step reads or the call hands
    out: the slot itself or a view of it (in the slot's dtype)."""
    if t.numel():
        slot, off = slots.find(t.data_ptr())
    else:
        slot = next((i for i, s in enumerate(slots.tensors) if s is t), None)
        if slot is None:
            raise _Refuse("an empty tensor that the call did not make")
        off = 0
    base = slots.tensors[slot]
    if t.dtype != base.dtype:
        raise _Refuse("a view that reinterprets a tensor's dtype")
    same = off == 0 and t.shape == base.shape and t.stride() == base.stride()
    return [slot, not same, list(t.shape), list(t.stride()), off // t.element_size()]


def _launch_step(entry, grid, raw, slots: _Slots, param_info) -> tuple:
    """A recorded launch in the C++ form: (fn, grid, threads, shared, values, pointers)."""
    ck = entry[4]
    values, ptrs, sizes = [], [], []
    g = tuple(grid) + (1,) * (3 - len(grid))
    scratch = None
    for k, (i, ty) in enumerate(_kernel_params(ck)):
        v = None if i is None else raw[i]
        if ty == "*gscratch":  # (a fresh buffer per launch, sized as Triton sizes it)
            scratch = [k, g[0] * g[1] * g[2] * ck.metadata.num_ctas * ck.metadata.global_scratch_size]
            values.append(0)
            sizes.append(8)
        elif ty.startswith("*"):
            if v is not None and not isinstance(v, int):
                raise _Refuse(f"pointer argument {i} is a {type(v).__name__}")
            if v:  # (a None or 0 pointer stays 0)
                ptrs.append([k, *slots.find(v)])
            values.append(0)
            sizes.append(8)
        else:
            fmt = _SCALARS.get(ty)
            if fmt is None or not isinstance(v, (int, float, bool)):
                raise _Refuse(f"argument {i} of type {ty}")
            values.append(int.from_bytes(struct.pack(fmt, v).ljust(8, b"\0"), "little"))
            sizes.append(_SIZES[fmt])
    info = param_info(int(ck.function))
    if info is None or [s for _, s in info] != sizes:
        raise _Refuse(f"{ck.src.fn.__name__}: the driver reports parameters {info}, the recording {sizes}")
    step = (int(ck.function), g, 32 * ck.metadata.num_warps, int(ck.metadata.shared), values, ptrs)
    return step if scratch is None else step + (scratch,)


def _op_step(func, args, kwargs, out, slots: _Slots) -> tuple:
    """A recorded ATen op in the C++ form: ("op", name, overload, values, tensors, new outputs);
    its new outputs become slots."""
    schema = func._schema
    values, tensors = [], []
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(args):
            v = args[i]
        elif a.name in kwargs:
            v = kwargs[a.name]
        elif a.has_default_value():
            v = a.default_value
        else:
            raise _Refuse(f"{func}: no value for {a.name}")
        if isinstance(v, torch.Tensor):
            if not v.is_cuda:
                raise _Refuse(f"{func} reads a tensor on {v.device}")
            tensors.append([i, _ref(v, slots)])
            v = None
        elif isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
            raise _Refuse(f"{func} takes a list of tensors")
        values.append(v)
    outs = out if isinstance(out, (list, tuple)) else (out,)
    given = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    new = []
    for o in outs:
        if not o.is_cuda:
            raise _Refuse(f"{func} returns a tensor on {o.device}")
        new.append(not any(o is g for g in given))  # (an in-place op returns its argument)
        if new[-1]:
            slots.add(o, "op")
    return ("op", schema.name, schema.overload_name, values, tensors, new)


def _steps(recorded, slots: _Slots, param_info) -> list:
    out = []
    for step in recorded:
        if step[0] == "launch":
            out.append(_launch_step(*step[1:], slots, param_info))
        else:
            out.append(_op_step(*step[1:], slots))
    return out


def _renumber(steps, m: dict) -> list:
    """``steps`` with every slot read through ``m``."""
    out = []
    for s in steps:
        if s[0] == "op":
            out.append(s[:4] + ([[i, [m[r[0]], *r[1:]]] for i, r in s[4]],) + s[5:])
        else:
            out.append(s[:5] + ([[k, m[slot], off] for k, slot, off in s[5]],) + s[6:])
    return out


def _used(steps) -> set:
    got = set()
    for s in steps:
        if s[0] == "op":
            got.update(r[0] for _, r in s[4])
        else:
            got.update(q[1] for q in s[5])
    return got


class _BwdSlots(_Slots):
    """Backward's tensors: a pointer into none of its own is a forward tensor the backward reads
    (appended to ``saved`` as its forward slot, numbered here on first use). A module-level class:
    one defined inside the recording would be a reference cycle holding the recorded call's inputs,
    and through them their autograd history (AccumulateGrad nodes made on the recording's stream),
    until Python's cyclic GC ran: a later CUDA-graph capture of the model then failed."""

    def __init__(self, given, allocs, fwd: _Slots, saved: list) -> None:
        super().__init__(given, allocs)
        self.fwd, self.saved = fwd, saved

    def find(self, ptr: int) -> tuple[int, int]:
        try:
            return _Slots.find(self, ptr)
        except _Refuse:
            s, off = self.fwd.find(ptr)
            self.saved.append(s)
            return self.add(self.fwd.tensors[s], "given"), off


def _geometry(t: torch.Tensor, align: int) -> tuple:
    return (list(t.shape), list(t.stride()), _DT[t.dtype], align)


class _Dtypes(dict):
    def __missing__(self, dtype):  # (the C++ side reads a dtype off an empty example tensor)
        self[dtype] = torch.empty(0, dtype=dtype)
        return self[dtype]


_DT = _Dtypes()


def record(fuser, plan, inputs: list, n_extra: int):
    """Record one call of ``plan`` on ``inputs`` (x, the extra inputs, the parameters) and build
    its recipe; None when it cannot be replayed, :data:`RETRY` when a later call may be (the reason
    in ``record.last_failure``)."""
    ext = extension()
    if ext is None:
        record.last_failure = "the C++ extension could not be built"
        return None
    try:
        return _build(ext, fuser, plan, inputs, n_extra, _fuser._RAW_APPLY, _fuser._FuserFunction)
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


def _build(ext, fuser, plan, inputs, n_extra, raw_apply, fn):
    aliases, distinct = [], []  # (one tensor passed twice, e.g. split sizes for two grouped linears)
    for j, t in enumerate(inputs):
        i = next((i for i in distinct if inputs[i] is t), None)
        if i is None:
            distinct.append(j)
        else:
            aliases.append((j, i))
    spans = sorted((inputs[i].untyped_storage().data_ptr(), inputs[i].untyped_storage().nbytes()) for i in distinct)
    if any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise _Refuse("inputs share memory")
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with _Recorder() as rec:
        y = raw_apply(leaves[0], fuser, plan, n_extra, *leaves[1:])[0]
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
    return ext.make_recipe(
        y.device.index, in_geo, f_allocs, _renumber(fwd_steps, f_map), [[f_map[out[0]], *out[1:]]],
        [f_map[s] for s in saved], [_geometry(dy, 0)], b_allocs, _renumber(bwd_steps, b_map),
        [(-1, False, [], [], 0) if g is None else [b_map[g[0]], *g[1:]] for g in grad_refs], aliases)


def replayer_for(fuser, plan, device_type: str, n_extra: int, recipe) -> Optional["Replayer"]:
    """The :class:`Replayer` of a new plan, or None when its calls are never replayed: not a CUDA
    training plan, an FP8 ``recipe``, MoE routing, flagged contract weights, parametrized weights,
    extra outputs, or a step that is not ``replayable``."""
    if not (ENABLED and plan.requires_grad and device_type == "cuda" and fuser._routing is None and recipe is None
            and not fuser._wgrad_flagged and not fuser._parametrized and fuser.num_extra_outputs == 0
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
        if scheduler_active() or _autocast("cuda"):
            # (inside delayed_wgrad() at forward: the contract's Python path; under torch.autocast
            # the ATen ops of a call cast as autocast says when they run, not as when recorded)
            return None
        mode = current_mode()
        r = self.recipes.get(mode)  # (the recipe of the last call in this mode)
        inputs = [x, *extra, *params] if extra else [x, *params]
        if r is not None:
            try:
                outs = self.run_recipe(r, inputs)
            except TypeError:  # (a non-tensor input: the Python path raises the op's own error)
                return None
            if outs:
                self.replayed += 1
                return outs[0]
        return self._new_geometry(mode, inputs, r)

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
            r = record(self.fuser, self.plan, inputs, self.n_extra)
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
        outs = self.run_recipe(r, inputs)
        if not outs:
            return None
        self.recipes[mode] = r
        self.replayed += 1
        return outs[0]


register_plan_extension(PlanExtension("replay", _attach))

__all__ = ["ENABLED", "RETRY", "Replayer", "explain", "extension", "record", "replayer_for"]
