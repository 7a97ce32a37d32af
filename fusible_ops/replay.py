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
   binary and every ATen op. Allocations and views are all the ATen work it accepts; a compute
   op, a compile, an autotuning run, a dropout seed or a pointer into memory that is neither an
   input nor an allocation of the call makes the geometry Python-only for good.
3. Every call of the geometry, the second included, then runs the recipe (``Recipe`` in C++),
   which checks the inputs' sizes, strides, dtypes, device and pointer alignment against the
   recording and declines (the call takes the Python path) on any difference.

What must hold for an op to set ``replayable``: on CUDA, its ``fuser_forward`` /
``fuser_backward`` (or ``op_forward`` / ``op_backward``) issue only :class:`DirectKernel` launches,
allocations and views, with every launch argument a function of the inputs' sizes, strides, dtypes,
device and the op's own attributes (assigning one makes a new plan); and the gradients it returns go
to autograd as they are (no ``main_grad`` delivery, no delayed weight gradients: the fuser replays
no plan of a flagged op). The recorder checks the first part on the recorded call.

The C++ extension is built with ``torch.utils.cpp_extension`` on the first recording in a process
(a minute the first time; cached on disk by torch). ``FUSIBLE_OPS_REPLAY=0`` (or setting
:data:`ENABLED` to False), or a build that fails (a warning says why), leaves every call on the
Python path.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Recorder(TorchDispatchMode):
    """Sees the ATen ops and the cached-binary launches of a recorded call (one phase at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: list = []  # (kept alive while recording: no address is reused)
        self.launches: list = []
        self.failure: Optional[str] = None
        self.transient = False

    def fail(self, why: str, transient: bool = False) -> None:
        """Refuse the recording; ``transient``: a later call may succeed (a kernel compiled or
        autotuned during this one)."""
        if self.failure is None:
            self.failure, self.transient = why, transient

    def launch(self, entry, grid, raw) -> None:
        self.launches.append((entry, tuple(grid), list(raw)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOC:
            if out.device.type != "cuda":
                self.fail(f"{func} on {out.device}")
            self.allocs.append(out)
        elif not getattr(func, "is_view", False):
            self.fail(f"{func} ran")
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


def _index(key, names) -> int:
    if isinstance(key, str):
        return names.index(key)
    return key[0] if isinstance(key, tuple) else key


def _kernel_params(ck) -> list:
    """``[(argument index or None, type)]``: the compiled kernel's parameters as its launcher passes
    them (the runtime arguments that are not constexpr, then Triton's scratch pointers)."""
    src, md = ck.src, ck.metadata
    names = list(src.fn.arg_names)
    sig = {_index(k, names): v for k, v in src.signature.items()}
    consts = {_index(k, names) for k in getattr(src, "constants", {})}
    params = [(i, sig[i]) for i in sorted(sig) if sig[i] != "constexpr" and i not in consts]
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(md, attr):
            if getattr(md, attr):
                raise _Refuse(f"{src.fn.__name__} needs {attr}")
            params.append((None, "*scratch"))
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        raise _Refuse(f"{src.fn.__name__}: cluster, cooperative or PDL launch")
    return params


_SIZES = {"<b": 1, "<B": 1, "<h": 2, "<H": 2, "<i": 4, "<I": 4, "<f": 4, "<q": 8, "<Q": 8, "<d": 8}


class _Slots:
    """Tensors a phase's launches may point into: ``[given..., allocations...]``, by address."""

    def __init__(self, given: Sequence[torch.Tensor]) -> None:
        self.tensors = list(given)
        self.n_given = len(given)

    def add_allocs(self, allocs) -> None:
        self.tensors.extend(allocs)

    def find(self, ptr: int) -> tuple[int, int]:
        """(slot, byte offset) of a pointer into one of the tensors (inside its own extent)."""
        for i, t in enumerate(self.tensors):
            off = ptr - t.data_ptr()
            if 0 <= off < max(_extent(t), 1):
                return i, off
        raise _Refuse(f"a launch points at memory that is neither an input nor an allocation of the call ({ptr:#x})")


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _launches(recorded, slots: _Slots, param_info) -> list:
    """The C++ form of recorded launches: (fn, grid, threads, shared, values, pointers)."""
    out = []
    for entry, grid, raw in recorded:
        ck = entry[4]
        params = _kernel_params(ck)
        values, ptrs, sizes = [], [], []
        for k, (i, ty) in enumerate(params):
            v = None if i is None else raw[i]
            if ty.startswith("*"):
                if v is not None and not isinstance(v, int):
                    raise _Refuse(f"pointer argument {i} is a {type(v).__name__}")
                if v:  # (a None or 0 pointer stays 0)
                    ptrs.append((k, *slots.find(v)))
                values.append(0)
                sizes.append(8)
            else:
                fmt = _SCALARS.get(ty)
                if fmt is None or not isinstance(v, (int, float, bool)):
                    raise _Refuse(f"argument {i} of type {ty}")
                b = struct.pack(fmt, v).ljust(8, b"\0")
                values.append(int.from_bytes(b, "little"))
                sizes.append(_SIZES[fmt])
        info = param_info(int(ck.function))
        if info is None or [s for _, s in info] != sizes:
            raise _Refuse(f"{ck.src.fn.__name__}: the driver reports parameters {info}, the recording {sizes}")
        g = tuple(grid) + (1,) * (3 - len(grid))
        out.append((int(ck.function), g, 32 * ck.metadata.num_warps, int(ck.metadata.shared), values, ptrs))
    return out


def _geometry(t: torch.Tensor, align: int) -> tuple:
    return (list(t.shape), list(t.stride()), _DT[t.dtype], align)


class _Dtypes(dict):
    def __missing__(self, dtype):  # (the C++ side reads a dtype off an empty example tensor)
        self[dtype] = torch.empty(0, dtype=dtype)
        return self[dtype]


_DT = _Dtypes()


def _result(t: Optional[torch.Tensor], slots: _Slots, remap) -> tuple:
    """(slot, view, sizes, strides, element offset) of a tensor handed out, -1 slot for None."""
    if t is None:
        return (-1, False, [], [], 0)
    slot, off = slots.find(t.data_ptr()) if t.numel() else _exact(t, slots)
    base = slots.tensors[slot]
    same = off == 0 and t.shape == base.shape and t.stride() == base.stride() and t.dtype == base.dtype
    if not same and t.dtype != base.dtype:
        raise _Refuse("a result reinterprets an allocation's dtype")
    return (remap(slot), not same, list(t.shape), list(t.stride()), off // t.element_size())


def _exact(t, slots):
    for i, s in enumerate(slots.tensors):
        if s is t:
            return i, 0
    raise _Refuse("an empty result that is not an allocation")


def record(fuser, plan, inputs: list, n_extra: int):
    """Record one call of ``plan`` on ``inputs`` (x, the extra inputs, the parameters) and build
    its recipe; None when it cannot be replayed, :data:`RETRY` when a later call may be (the reason
    in ``record.last_failure``)."""
    from .fuser import _RAW_APPLY, _FuserFunction  # (fuser imports this module)

    ext = extension()
    if ext is None:
        return None
    try:
        return _build(ext, fuser, plan, inputs, n_extra, _RAW_APPLY, _FuserFunction)
    except _Refuse as e:
        record.last_failure = str(e)
        return RETRY if e.transient else None


record.last_failure = None


def _build(ext, fuser, plan, inputs, n_extra, raw_apply, fn):
    spans = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in inputs)
    if any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise _Refuse("inputs share memory")
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    rec = _Recorder()
    with rec:
        y = raw_apply(leaves[0], fuser, plan, n_extra, *leaves[1:])[0]
    if rec.failure:
        raise _Refuse(rec.failure, rec.transient)
    fwd = _Slots(inputs)
    fwd.add_allocs(rec.allocs)
    fwd_launches = rec.launches
    if y.grad_fn is None:
        raise _Refuse("the forward made no autograd node")
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    rec2 = _Recorder()
    with rec2:
        grads = fn.backward(y.grad_fn, dy)
    if rec2.failure:
        raise _Refuse(rec2.failure, rec2.transient)
    input_grads = [grads[0], *grads[4:]]
    if len(input_grads) != len(inputs):
        raise _Refuse("the backward's gradients do not match the inputs")
    # Backward slots: the gradient, the forward slots it reads (saved), its allocations.
    bwd_given = [dy]
    saved: list = []
    fwd_of = {}  # forward slot -> backward slot

    class _Bwd(_Slots):
        def find(self, ptr):
            try:
                return _Slots.find(self, ptr)
            except _Refuse:
                s, off = fwd.find(ptr)
                if s not in fwd_of:
                    fwd_of[s] = len(self.tensors)
                    saved.append(s)
                    self.tensors.append(fwd.tensors[s])
                return fwd_of[s], off

    bwd = _Bwd(bwd_given)
    bwd.add_allocs(rec2.allocs)
    n_bwd_allocs = len(rec2.allocs)
    bwd_launches = _launches(rec2.launches, bwd, ext.param_info)
    grad_results = [_result(g, bwd, lambda s: s) for g in input_grads]
    fwd_launches = _launches(fwd_launches, fwd, ext.param_info)
    out = _result(y, fwd, lambda s: s)
    if out[0] < len(inputs):
        raise _Refuse("the output is an input")
    # Renumber: keep only referenced allocations; backward slots become [dy, saved..., allocs...].
    f_used = sorted({q[1] for l in fwd_launches for q in l[5]} | {out[0]} | set(saved))
    f_alloc = [s for s in f_used if s >= len(inputs)]
    f_map = {s: s for s in range(len(inputs))}
    f_map.update({s: len(inputs) + k for k, s in enumerate(f_alloc)})
    b_alloc_slots = list(range(1, 1 + n_bwd_allocs))  # (in bwd.tensors: after dy, before the saved)
    b_used = sorted({q[1] for l in bwd_launches for q in l[5]} | {g[0] for g in grad_results if g[0] >= 0})
    b_alloc = [s for s in b_alloc_slots if s in b_used]
    b_map = {0: 0}
    b_map.update({fwd_of[s]: 1 + k for k, s in enumerate(saved)})
    b_map.update({s: 1 + len(saved) + k for k, s in enumerate(b_alloc)})

    def relaunch(launches, m):
        return [(f, g, th, sh, vals, [(k, m[s], off) for k, s, off in ptrs]) for f, g, th, sh, vals, ptrs in launches]

    def regrad(g):
        return g if g[0] < 0 else (b_map[g[0]],) + g[1:]

    used_inputs = {q[1] for l in fwd_launches for q in l[5]} | {s for s in saved if s < len(inputs)}
    in_geo = [_geometry(t, t.data_ptr() % 16 if i in used_inputs else -1) for i, t in enumerate(inputs)]
    out_res = (f_map[out[0]],) + out[1:]
    if out_res[1] and out[0] in saved:
        raise _Refuse("the backward reads an output that is a view")
    return ext.make_recipe(
        y.device.index, in_geo, [_geometry(fwd.tensors[s], 0) for s in f_alloc], relaunch(fwd_launches, f_map),
        [out_res], [f_map[s] for s in saved], [_geometry(dy, 0)],
        [_geometry(bwd.tensors[s], 0) for s in b_alloc], relaunch(bwd_launches, b_map), [regrad(g) for g in grad_results])


_MAX_TRIES = 3  # recordings per geometry that compile or autotune before it stays Python-only


class Replayer:
    """A plan's recipes, per input geometry (see the module docstring). :meth:`run` returns the
    call's output, or None when the call must take the Python path."""

    def __init__(self, fuser, plan, n_extra: int) -> None:
        self.fuser, self.plan, self.n_extra = fuser, plan, n_extra
        self.recipes = _launch.geometry_cache()  # (emptied with the launch geometries: tiling may change)
        self.run_recipe = None
        self.replayed = 0  # calls served (tests read it)

    def run(self, x: torch.Tensor, extra: tuple, params: list) -> Optional[torch.Tensor]:
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
        return self._new_geometry(mode, inputs)

    def _new_geometry(self, mode: str, inputs: list) -> Optional[torch.Tensor]:
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
            if r is RETRY:  # (a kernel compiled during the recording: e.g. the first call ran no backward)
                tries = _launch.remember(self.recipes, ("tries", key), self.recipes.get(("tries", key), 0) + 1)
                if tries < _MAX_TRIES:
                    return None
                r = None
            r = _launch.remember(self.recipes, key, r or False)
            if r is not False and self.run_recipe is None:
                self.run_recipe = extension().run
        if r is False:
            return None
        outs = self.run_recipe(r, inputs)
        if not outs:
            return None
        self.recipes[mode] = r
        self.replayed += 1
        return outs[0]


__all__ = ["ENABLED", "RETRY", "Replayer", "extension", "record"]
