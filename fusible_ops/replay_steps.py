"""How a recorded call becomes the steps of a C++ replay recipe (:mod:`fusible_ops.replay`): the
tensors of each direction as numbered slots, each cached-binary launch as its function, grid and
raw parameter values (pointers as slot + offset), each ATen op as its schema name and arguments,
and the slots' lifetimes (made at first use, released after last use).

A recording that cannot be expressed so raises :class:`_Refuse` with the reason."""

from __future__ import annotations

import struct
from typing import Sequence

import torch


class _Refuse(Exception):
    """The recorded call cannot be replayed (the message says why); ``transient``: the next call
    of its geometry may be (this one compiled or autotuned a kernel)."""

    def __init__(self, why: str, transient: bool = False) -> None:
        super().__init__(why)
        self.transient = transient


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


def _lifetimes(steps, n_given: int, n_allocs: int, keep: set) -> tuple:
    """``(make, release, late)`` of a direction's (renumbered) steps: per step, the allocations it
    is the first to use (made just before it) and the slots past the given ones it is the last to
    use and that are not in ``keep`` (the output, saved tensors, gradients: released after it, as
    the Python path frees its temporaries); the allocations no step uses (made after the steps)."""
    first: dict = {}
    last: dict = {}
    n = n_given + n_allocs  # (op outputs are numbered after the allocations as the ops run)
    for k, s in enumerate(steps):
        used = [r[0] for _, r in s[4]] if s[0] == "op" else [q[1] for q in s[5]]
        for u in used:
            first.setdefault(u, k)
            last[u] = k
        if s[0] == "op":
            for new in s[5]:
                if new:
                    first[n] = last[n] = k
                    n += 1
    make: list = [[] for _ in steps]
    release: list = [[] for _ in steps]
    for slot, k in first.items():
        if n_given <= slot < n_given + n_allocs:
            make[k].append(slot)
    for slot, k in last.items():
        if slot >= n_given and slot not in keep:
            release[k].append(slot)
    late = [a for a in range(n_given, n_given + n_allocs) if a not in first]
    return make, release, late
