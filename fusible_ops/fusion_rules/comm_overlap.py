"""Communication overlapped with the GEMM of a tensor-parallel linear.

* ``all_gather_linear`` (forward) / ``all_gather_linear_backward``: ``AllGather -> BasicLinear``
  (column parallel, sequence parallel). Forward: a ring of point-to-point sends passes the
  sequence shards around the group while the GEMM of each shard already received runs (the
  gathered input is assembled in place for the weight gradient). Backward: the input gradient's
  reduce-scatter runs as a ring whose partial sums travel while the next block's GEMM runs, then
  the weight-gradient GEMM (through the gradient contract, as the linear's own backward).
* ``linear_reduce_scatter`` / ``linear_reduce_scatter_backward``: ``BasicLinear -> ReduceScatter``
  (row parallel, sequence parallel): the mirror images (GEMM of each destination's rows while the
  previous partial sum travels; backward all-gathers the output gradient around the ring under
  the input-gradient GEMMs).

Communication is torch's own (``torch.distributed.batch_isend_irecv``, async); on CUDA the NCCL
work runs on NCCL's stream and each ``wait()`` only orders the compute stream after it, so the
host never blocks. Each fused op fills each basic op's ctx exactly as that op's own forward would
(the comm ops keep nothing; the linear keeps its full input for the weight gradient), so forward
and backward rules are independent.

When the rules decline (the reason is in ``Sequential.explain()``): CPU tensors (gloo runs the
collectives on the host: nothing to overlap), a group whose backend is not NCCL, a single-rank
group (an identity), an active FP8 recipe (the ring runs high-precision GEMMs only), or the comm
op not opted in (``op.overlap = True``; off by default: the ring has run on gloo, never on GPUs). ``torch.ops.symm_mem.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter`` (symmetric memory) are not used yet: they need the group's
symmetric memory enabled by the user, and the choice between them and this ring is to be made by
measurement on a multi-GPU machine, which has not happened (the ring is untimed).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..op import FusedOperation
from ..ops.comm import AllGather, GroupRef, ReduceScatter, gather_rows
from ..ops.linear import BasicLinear
from ..rules import rule

Gemm = Callable[[torch.Tensor, torch.Tensor], object]  # gemm(a, out): out = a @ B


def _ring_step(send: torch.Tensor, recv: torch.Tensor, ref: GroupRef) -> list:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
    return dist.batch_isend_irecv([
        dist.P2POp(dist.isend, send, ref.next_global, ref.group),
        dist.P2POp(dist.irecv, recv, ref.prev_global, ref.group),
    ])


def _wait(reqs) -> None:
    for r in reqs or ():
        r.wait()


def ring_gather_gemm(shard: torch.Tensor, gathered: torch.Tensor, out: torch.Tensor, gemm: Gemm,
                     ref: GroupRef) -> None:
    """All-gather 2-D ``shard`` [m, k] of every rank into ``gathered`` [size*m, k] (rank blocks in
    group order) while ``gemm`` writes each block's product into the same rows of ``out``."""
    size, rank, m = ref.size, ref.rank, shard.shape[0]
    gathered[rank * m:(rank + 1) * m].copy_(shard)
    for s in range(size):
        c = (rank - s) % size  # the block this rank holds at step s
        reqs = None
        if s < size - 1:
            nxt = (rank - s - 1) % size
            reqs = _ring_step(gathered[c * m:(c + 1) * m], gathered[nxt * m:(nxt + 1) * m], ref)
        gemm(shard if s == 0 else gathered[c * m:(c + 1) * m], out[c * m:(c + 1) * m])
        _wait(reqs)


def ring_gemm_reduce_scatter(full: torch.Tensor, out: torch.Tensor, gemm: Gemm, ref: GroupRef) -> None:
    """``out`` [m, n] = this rank's block of the sum over ranks of ``gemm(full)`` (``full`` [size*m,
    k]): each step computes one destination block's partial product while the previous partial
    sum travels to the next rank, which adds its own."""
    size, rank = ref.size, ref.rank
    m = full.shape[0] // size
    reqs, incoming = None, None
    for s in range(size):
        c = (rank - s - 1) % size  # destination block of step s (the last step: this rank's)
        part = out if s == size - 1 else out.new_empty(out.shape)
        gemm(full[c * m:(c + 1) * m], part)
        if reqs is not None:
            _wait(reqs)
            part += incoming
        if s < size - 1:
            incoming = out.new_empty(out.shape)
            reqs = _ring_step(part, incoming, ref)


class _WgradOnly:
    """The linear's backward ctx with its input gradient switched off (the fused op computed it)."""

    input_requires_grad = False

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


def _mm(weight: torch.Tensor) -> Gemm:
    return lambda a, o: torch.mm(a, weight, out=o)


class AllGatherLinear(FusedOperation):
    """``AllGather -> BasicLinear`` with the gather (forward) and the input gradient's
    reduce-scatter (backward) overlapped with the GEMMs. See the module docstring."""

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        gather, linear = self.basic_ops
        gather.check_input(x)
        linear.check_input(x)
        ref, lctx = gather.group_ref, ctxs[1]
        x = x.contiguous()
        k, n = linear.in_features, linear.out_features
        full = x.new_empty((ref.size * x.shape[0], *x.shape[1:]))
        y = x.new_empty((*full.shape[:-1], n))
        if x.numel():
            ring_gather_gemm(x.view(-1, k), full.view(-1, k), y.view(-1, n), _mm(linear.weight.t()), ref)
        lctx.fp8 = None
        if lctx.requires_grad:
            linear.save_ctx(lctx, full)
        return y, [(), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        gather, linear = self.basic_ops
        gctx, lctx = ctxs
        ref = gather.group_ref
        dx = None
        if gctx.input_requires_grad and lctx.input_requires_grad:
            _, w = lctx.saved_tensors
            shape = lctx.input_shape
            dx = dy.new_empty((shape[0] // ref.size, *shape[1:]))
            dy2 = dy.reshape(-1, linear.out_features).contiguous()
            if dy2.numel():
                ring_gemm_reduce_scatter(dy2, dx.view(-1, linear.in_features), _mm(w), ref)
            else:
                dx.zero_()
        _, (dw,) = linear.op_backward(_WgradOnly(lctx), dy)
        return dx, [(), (dw,)], [(), ()]


class LinearReduceScatter(FusedOperation):
    """``BasicLinear -> ReduceScatter`` with the reduce-scatter (forward) and the output
    gradient's all-gather (backward) overlapped with the GEMMs. See the module docstring."""

    def fuser_forward(self, ctxs, x, *, extra_inputs, **kwargs):
        linear, scatter = self.basic_ops
        linear.check_input(x)
        n = linear.out_features
        scatter.check_input(x, shape=(*x.shape[:-1], n))
        ref, lctx = scatter.group_ref, ctxs[0]
        x = x.contiguous()
        y = x.new_empty((x.shape[0] // ref.size, *x.shape[1:-1], n))
        if x.numel():
            ring_gemm_reduce_scatter(x.view(-1, linear.in_features), y.view(-1, n), _mm(linear.weight.t()), ref)
        else:
            y.zero_()
        lctx.fp8 = None
        if lctx.requires_grad:
            linear.save_ctx(lctx, x)
        return y, [(), ()]

    def fuser_backward(self, ctxs, dy, *, grad_extra_outputs, **kwargs):
        linear, scatter = self.basic_ops
        lctx = ctxs[0]
        ref = scatter.group_ref
        n = linear.out_features
        dx = None
        if lctx.input_requires_grad and dy.numel():
            _, w = lctx.saved_tensors
            dy = dy.contiguous()
            dy_full = dy.new_empty((ref.size * dy.shape[0], *dy.shape[1:]))
            dx = dy.new_empty(lctx.input_shape)
            ring_gather_gemm(dy.view(-1, n), dy_full.view(-1, n), dx.view(-1, linear.in_features), _mm(w), ref)
        else:
            dy_full = gather_rows(dy, ref)
            if lctx.input_requires_grad:
                dx = dy.new_zeros(lctx.input_shape)
        _, (dw,) = linear.op_backward(_WgradOnly(lctx), dy_full)
        return dx, [(dw,), ()], [(), ()]


def check_overlap(ops, ctx) -> object:
    """Accept only where overlap can happen: CUDA tensors, an NCCL group of 2+ ranks, no FP8."""
    comm = next(op for op in ops if isinstance(op, (AllGather, ReduceScatter)))
    ref = comm.group_ref
    if ref.size == 1:
        return "single-rank group (or no group): the collective is an identity, nothing to overlap"
    if ctx.device is None or ctx.device.type != "cuda":
        return ("CPU tensors: gloo runs the collectives on the host, so they cannot overlap the GEMM "
                "(the ops run one after the other)")
    if ref.backend != "nccl":
        return f"process group backend {ref.backend!r}: the overlapped ring needs NCCL"
    if ctx.recipe is not None:
        return f"FP8 ({type(ctx.recipe).__name__}): the overlapped ring runs high-precision GEMMs only"
    if not comm.overlap:
        return (f"overlap not enabled on this {type(comm).__name__}: opt in with op.overlap = True (off by default "
                f"until the ring is measured on GPUs)")
    return None


__all__ = ["AllGatherLinear", "LinearReduceScatter", "RULES", "check_overlap", "ring_gather_gemm",
           "ring_gemm_reduce_scatter"]

RULES = [  # priority 1: the overlap wins over linear + bias epilogue fusions (bias + activation still fuse)
    rule("all_gather_linear", [AllGather, BasicLinear], pass_="forward", build=AllGatherLinear,
         check=check_overlap, priority=1),
    rule("all_gather_linear_backward", [AllGather, BasicLinear], pass_="backward", build=AllGatherLinear,
         check=check_overlap, priority=1),
    rule("linear_reduce_scatter", [BasicLinear, ReduceScatter], pass_="forward", build=LinearReduceScatter,
         check=check_overlap, priority=1),
    rule("linear_reduce_scatter_backward", [BasicLinear, ReduceScatter], pass_="backward",
         build=LinearReduceScatter, check=check_overlap, priority=1),
]
