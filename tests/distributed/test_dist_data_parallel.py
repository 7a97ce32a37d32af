"""The gradient contract under torch's data-parallel wrappers (fusible_ops.data_parallel): FSDP2
(``fully_shard`` per Linear + root) and DDP, each against one process on the whole batch, over 3
AdamW steps of 2 micro-batches each (gradient accumulation: ``set_requires_gradient_sync(False)``
/ ``no_sync()`` on the first), in float64 on gloo at 2 and 4 ranks:

* plain ``.grad``, ``accumulate_into_main_grad``, ``delay_wgrad_compute`` (``backward_dw()`` after
  each micro-batch, or once after the last), both flags, ``fo.delayed_wgrad()`` + ``flush_wgrad()``,
  the ops' own backward (``cpu_autograd(False)``), frozen weights;
* every mode equals plain ``.grad`` under the same wrapper bit for bit (FSDP2: the same
  reduce-scatters, counted; DDP: at 2 ranks, where a two-term sum has one order), and one process
  on the whole batch within the float64 table;
* FSDP2 with a MixedPrecisionPolicy (float32 compute, float64 reduce over float64 parameters) and
  one or two micro-batches (a float64 accumulator beside float32 bias gradients);
* frozen weights: no gradient, no reduce-scatter bytes;
* ``optimizer.step()`` with delayed work pending raises, naming the op.

The single-GPU FSDP2 variant (world 1, NCCL, the fused kernels) is marked ``gpu``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_launch import run_ranks

import fusible_ops as fo
from fusible_ops.fuser import cpu_autograd
from fusible_ops.testing import assert_close_scaled

H, F, ROWS, MICRO, STEPS, LR = 8, 12, 2, 2, 3, 0.05

FLAGS = {
    "plain": {},
    "main_grad": dict(accumulate_into_main_grad=True),
    "delayed": dict(delay_wgrad_compute=True),
    "main_grad+delayed": dict(accumulate_into_main_grad=True, delay_wgrad_compute=True),
    "delayed, backward_dw once": dict(delay_wgrad_compute=True),
    "delayed_wgrad()": {},
    "own backward, plain": {},
    "own backward, main_grad+delayed": dict(accumulate_into_main_grad=True, delay_wgrad_compute=True),
}
"""Modes (the flags of both Linears). "own backward": under ``cpu_autograd(False)`` the ops run their
own backward (CPU: the ``*_ref`` kernels; CUDA: the fused kernels), which GEMMs into main_grad
itself; compared bit for bit with the plain run of the same path."""


def _dtype(device):
    return torch.float64 if device.type == "cpu" else torch.float32


def _model(device, dtype, frozen=False, **flags):
    torch.manual_seed(3)  # the same weights on every rank
    factory = dict(device=device, dtype=dtype)
    model = fo.Sequential(fo.RMSNorm(H, **factory), fo.Linear(H, F, **factory, **flags), fo.GELU(),
                          fo.Linear(F, H, **factory, **flags))
    if frozen:
        model[1].weight.requires_grad_(False)
    return model


def _batches(world, device, dtype, micro=MICRO):
    g = torch.Generator().manual_seed(11)  # the same data on every rank
    return [[(torch.randn(world * ROWS, H, generator=g).to(device, dtype),
              torch.randn(world * ROWS, H, generator=g).to(device, dtype)) for _ in range(micro)]
            for _ in range(STEPS)]


def _local(x, rank):
    return x[rank * ROWS:(rank + 1) * ROWS]


def _loss(model, x, t, micro):
    return torch.nn.functional.mse_loss(model(x), t) / micro  # a mean over this process's rows


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def _single_process(world, device, dtype, frozen=False, micro=MICRO) -> list:
    """Parameters after each AdamW step of one process on the whole batch."""
    model = _model(device, dtype, frozen)
    opt = _optimizer(model)
    history = []
    for batch in _batches(world, device, dtype, micro):
        opt.zero_grad()
        for x, t in batch:
            _loss(model, x, t, micro).backward()
        opt.step()
        history.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return history


@contextlib.contextmanager
def _reduce_scatters():
    """Records each reduce-scatter's input numel (FSDP2 calls ``dist.reduce_scatter_single`` in
    torch 2.13, ``dist.reduce_scatter_tensor`` before)."""
    calls, saved = [], {}
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, fn=fn, **kwargs):
            inp = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            calls.append(inp.numel())
            return fn(*args, **kwargs)

        saved[name] = fn
        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _train(rank, world, device, dtype, mode, wrap, *, frozen=False, micro=MICRO, mp_policy=None):
    """Parameters after each step under ``wrap`` ("fsdp2" or "ddp"), and the reduce-scatter input
    sizes of each step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(device, dtype, frozen, **FLAGS[mode])
    if wrap == "fsdp2":
        kw = dict(mesh=init_device_mesh(device.type, (world,)))
        if mp_policy is not None:
            kw["mp_policy"] = mp_policy
        for m in (model[1], model[3], model):
            fully_shard(m, **kw)
        runner = model
    else:
        runner = torch.nn.parallel.DistributedDataParallel(model)
    opt = _optimizer(model)
    delayed = FLAGS[mode].get("delay_wgrad_compute", False) or mode == "delayed_wgrad()"
    own = cpu_autograd(False) if mode.startswith("own backward") else contextlib.nullcontext()
    history, scatters = [], []
    with own:
        for batch in _batches(world, device, dtype, micro):
            opt.zero_grad()
            with _reduce_scatters() as calls:
                for i, (x, t) in enumerate(batch):
                    last = i == micro - 1
                    if wrap == "fsdp2":
                        model.set_requires_gradient_sync(last)
                        sync = contextlib.nullcontext()
                    else:
                        sync = contextlib.nullcontext() if last else runner.no_sync()
                    with sync:
                        loss = _loss(runner, _local(x, rank), _local(t, rank), micro)
                        with fo.delayed_wgrad() if mode == "delayed_wgrad()" else contextlib.nullcontext():
                            loss.backward()
                    if delayed and (last or mode != "delayed, backward_dw once"):
                        assert model[3].basic_ops[0].has_pending_wgrad(), mode  # really delayed
                        if wrap == "fsdp2" and last:
                            assert model[3].weight.grad is None, mode  # not reduced before backward_dw()
                        fo.flush_wgrad() if mode == "delayed_wgrad()" else model.backward_dw()
            if delayed and wrap == "fsdp2":
                assert model[1].weight.grad is not None or frozen
            for lin in (model[1], model[3]):
                assert getattr(lin.weight, "main_grad", None) is None  # the wrapper's accumulator, not one attached
            opt.step()
            scatters.append(calls)
            got = {k: (p.full_tensor() if wrap == "fsdp2" else p).detach().clone() for k, p in model.named_parameters()}
            history.append(got)
    return history, scatters


def _same(got: list, want: list, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for k in w:
            assert torch.equal(g[k], w[k]), f"{k} step {step} ({what}): not bit-equal to plain .grad"


def _close(got: list, want: list, dtype, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), what
        for k in w:
            assert_close_scaled(g[k], w[k], dtype, f"{k} step {step} ({what})")


def body_modes(rank, world, device, wrap):
    dtype = _dtype(device)
    want = _single_process(world, device, dtype)
    runs = {}
    for mode in FLAGS:
        got, scatters = runs[mode] = _train(rank, world, device, dtype, mode, wrap)
        _close(got, want, dtype, f"{wrap} {mode}")
        plain, plain_scatters = runs["own backward, plain" if mode.startswith("own") else "plain"]
        # (DDP at 4 ranks: its buckets may sum in another order; CUDA's own-backward GEMMs into
        # main_grad (addmm, beta=1) may take another cuBLAS kernel than the plain run's mm)
        if (wrap == "fsdp2" or world == 2) and not (device.type == "cuda" and mode.startswith("own")):
            _same(got, plain, f"{wrap} {mode}")
        # the same reduce-scatters (delayed: a group's comes when backward_dw() has computed its weights)
        assert [sorted(s) for s in scatters] == [sorted(s) for s in plain_scatters], (mode, scatters, plain_scatters)
    if wrap == "fsdp2" and world > 1:  # one reduce-scatter per group (3) per step, at the synced backward
        total = sum(p.numel() for p in _model(device, dtype).parameters())
        assert all(len(s) == 3 and sum(s) == total for s in runs["plain"][1]), runs["plain"][1]


def body_frozen(rank, world, device, wrap):
    dtype = _dtype(device)
    want = _single_process(world, device, dtype, frozen=True)
    trainable = sum(p.numel() for p in _model(device, dtype, frozen=True).parameters() if p.requires_grad)
    for mode in ("plain", "main_grad+delayed"):
        got, scatters = _train(rank, world, device, dtype, mode, wrap, frozen=True)
        _close(got, want, dtype, f"{wrap} frozen {mode}")
        assert torch.equal(got[-1]["1.weight"], want[0]["1.weight"])  # never moved
        if wrap == "fsdp2":  # the frozen weight adds nothing to the reduce-scatters
            assert all(sum(s) == trainable for s in scatters), (scatters, trainable)


def body_mixed_precision(rank, world, device):
    """FSDP2 with float32 compute and a float64 reduce dtype over float64 parameters: main_grad
    uses FSDP2's float64 accumulator; at one micro-batch the float32 bias gradient meets it at the
    reduce-scatter."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    for micro in (1, 2):
        want = _single_process(world, device, torch.float64, micro=micro)
        plain, _ = _train(rank, world, device, torch.float64, "plain", "fsdp2", micro=micro, mp_policy=policy)
        _close(plain, want, torch.float32, f"mixed precision plain, {micro} micro-batches")
        for mode in ("main_grad", "main_grad+delayed", "delayed"):
            got, _ = _train(rank, world, device, torch.float64, mode, "fsdp2", micro=micro, mp_policy=policy)
            _same(got, plain, f"mixed precision {mode}, {micro} micro-batches")


def body_forgotten_backward_dw(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dtype = _dtype(device)
    x, t = _batches(world, device, dtype)[0][0]
    for wrap in ("fsdp2", "ddp"):
        model = _model(device, dtype, delay_wgrad_compute=True)
        if wrap == "fsdp2":
            mesh = init_device_mesh(device.type, (world,))
            for m in (model[1], model[3], model):
                fully_shard(m, mesh=mesh)
            runner = model
        else:
            runner = torch.nn.parallel.DistributedDataParallel(model)
        opt = _optimizer(model)
        _loss(runner, _local(x, rank), _local(t, rank), 1).backward()
        with pytest.raises(RuntimeError, match=r"BasicLinear \(under .*\): delayed weight gradients are still "
                                               r"pending at optimizer.step\(\): call backward_dw\(\)"):
            opt.step()
        model.backward_dw()  # then the step goes on
        assert model[1].weight.grad is not None
        opt.step()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_modes_equal_plain_grad_and_single_process(wrap, world):
    run_ranks(body_modes, world, "gloo", wrap)


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_frozen_weights(wrap):
    run_ranks(body_frozen, 2, "gloo", wrap)


def test_fsdp2_mixed_precision_main_grad():
    run_ranks(body_mixed_precision, 2, "gloo")


def test_forgotten_backward_dw_raises_at_the_step():
    run_ranks(body_forgotten_backward_dw, 2, "gloo")


@pytest.mark.gpu
def test_fsdp2_single_gpu():
    run_ranks(body_modes, 1, "nccl", "fsdp2")
