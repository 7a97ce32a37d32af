"""Count the host's reads of tensor data: what would stall the host on a CUDA device (a sync).

A training step that never reads device data on the host can run ahead of the GPU and be
captured in a CUDA graph. :func:`count_host_reads` counts, inside its block, on any device:

* ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)`` (``aten._local_scalar_dense``);
* ``.tolist()`` (patched for the block: on CPU tensors it dispatches no op);
* copies from a CUDA tensor to the CPU (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor);
* ops whose output shape depends on the data: ``nonzero``, ``masked_select``, ``unique`` and
  ``repeat_interleave`` without ``output_size``.

On CPU these are no syncs, but each would be one on a GPU, so a CPU test can hold a layer to
"no host sync" (or to a known number: an expert-parallel exchange reads its split sizes once).
Collectives are not counted. Usage::

    with count_host_reads() as reads:
        y = layer(x); y.sum().backward()
    assert reads.count == 0, reads.where
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_DATA_SHAPED = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                _aten.unique_consecutive.default, _aten.unique_dim.default}
_REPEAT = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}


class HostReads:
    """What :func:`count_host_reads` saw: ``count`` and, per read, ``where`` (the op and the
    innermost frame outside torch)."""

    def __init__(self) -> None:
        self.count = 0
        self.where: list[str] = []
        self.quiet = False  # (inside a counted .tolist(): its own copy is not counted again)

    def add(self, what: str) -> None:
        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and f.filename != __file__]
        self.where.append(f"{what} at {frames[-1].filename}:{frames[-1].lineno}" if frames else what)


def _is_read(func, args, kwargs) -> bool:
    if func is _aten._local_scalar_dense.default or func in _DATA_SHAPED:
        return True
    if func in _REPEAT:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if func is _aten._to_copy.default:
        dev = kwargs.get("device")
        return args[0].is_cuda and dev is not None and torch.device(dev).type == "cpu"
    if func is _aten.copy_.default:
        return args[1].is_cuda and not args[0].is_cuda
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.reads.quiet and _is_read(func, args, kwargs):
            self.reads.add(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_reads():
    """Count the host's reads of tensor data inside the block (module doc); yields a
    :class:`HostReads`."""
    reads = HostReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        reads.add("Tensor.tolist")
        reads.quiet = True
        try:
            return tolist(self)
        finally:
            reads.quiet = False

    torch.Tensor.tolist = counted_tolist
    try:
        with _Mode(reads):
            yield reads
    finally:
        torch.Tensor.tolist = tolist


__all__ = ["HostReads", "count_host_reads"]
