"""Our ops inside torch's data-parallel wrappers, and the main_grad reduction pattern: 5 SGD steps
on each rank's slice of a batch equal 5 steps of a single process on the whole batch.

* DDP and FSDP2 (``fully_shard``): plain ``.grad`` mode, gradients reduced by the wrapper.
* ``accumulate_into_main_grad=True`` (no wrapper: it would never see the gradients, and our ops
  refuse to run inside one, see tests/test_module_protocol.py): the trainer sums ``main_grad``
  over the data-parallel group after ``backward()``, or from ``register_wgrad_hook`` with delayed
  weight gradients (``backward_dw()``), and the remaining ``.grad`` (biases, norm weights).
* FP8 delayed-scaling amax reduction over a data-parallel group:
  tests/test_fp8.py::test_delayed_amax_reduced_over_a_process_group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, run_ranks

import fusible_ops as fo
from fusible_ops.testing import assert_close_scaled

H, F, ROWS, STEPS, LR = 8, 12, 3, 5, 0.5


def _model(device, dtype, **flags):
    torch.manual_seed(3)  # the same weights on every rank
    factory = dict(device=device, dtype=dtype)
    return fo.Sequential(fo.RMSNorm(H, **factory), fo.Linear(H, F, **factory, **flags), fo.GELU(),
                         fo.Linear(F, H, **factory, **flags))


def _batches(world, device, dtype):
    g = torch.Generator().manual_seed(11)  # the same data on every rank
    return [(torch.randn(world * ROWS, H, generator=g).to(device, dtype),
             torch.randn(world * ROWS, H, generator=g).to(device, dtype)) for _ in range(STEPS)]


def _loss(model, x, t):
    return torch.nn.functional.mse_loss(model(x), t)  # a mean over this process's rows


def _single_process(world, device, dtype) -> list:
    """Parameters after each SGD step of one process on the whole batch."""
    model = _model(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for x, t in _batches(world, device, dtype):
        opt.zero_grad()
        _loss(model, x, t).backward()
        opt.step()
        history.append({k: p.detach().clone() for k, p in model.named_parameters()})
    return history


def _compare(got: dict, want: dict, dtype, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        assert_close_scaled(got[k], want[k], dtype, f"{k} ({what})")


def _local(x, rank):
    return x[rank * ROWS:(rank + 1) * ROWS]


def _dtype(device):
    return torch.float64 if device.type == "cpu" else torch.float32


def body_ddp_and_main_grad(rank, world, device):
    dtype = _dtype(device)
    want = _single_process(world, device, dtype)
    # DDP: plain .grad mode, the wrapper averages the gradients
    ddp = torch.nn.parallel.DistributedDataParallel(_model(device, dtype))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step, (x, t) in enumerate(_batches(world, device, dtype)):
        opt.zero_grad()
        _loss(ddp, _local(x, rank), _local(t, rank)).backward()
        opt.step()
        _compare({k: p for k, p in ddp.module.named_parameters()}, want[step], dtype, f"DDP step {step}")
    # main_grad, reduced after backward (immediate) or from the wgrad hooks (delayed)
    for delayed in (False, True):
        model = _model(device, dtype, accumulate_into_main_grad=True, delay_wgrad_compute=delayed)
        linears = [model[1], model[3]]
        for lin in linears:
            lin.weight.main_grad = torch.zeros_like(lin.weight)
            if delayed:  # the supported pattern: sum each main_grad as soon as backward_dw() wrote it
                lin.register_wgrad_hook(lambda lin=lin: dist.all_reduce(lin.weight.main_grad))
        for step, (x, t) in enumerate(_batches(world, device, dtype)):
            for p in model.parameters():
                p.grad = None
            for lin in linears:
                lin.weight.main_grad.zero_()
            _loss(model, _local(x, rank), _local(t, rank)).backward()
            if delayed:
                for lin in linears:
                    lin.backward_dw()
            with torch.no_grad():
                for p in model.parameters():
                    if any(p is lin.weight for lin in linears):
                        if not delayed:
                            dist.all_reduce(p.main_grad)
                        grad = p.main_grad
                        assert p.grad is None  # the weight gradient went only to main_grad
                    else:
                        dist.all_reduce(p.grad)
                        grad = p.grad
                    p -= LR * grad / world
            _compare(dict(model.named_parameters()), want[step], dtype, f"main_grad delayed={delayed} step {step}")


def body_fsdp2(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dtype = _dtype(device)
    want = _single_process(world, device, dtype)
    model = _model(device, dtype)
    mesh = init_device_mesh(device.type, (world,))
    for m in (model[1], model[3]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, t) in enumerate(_batches(world, device, dtype)):
        opt.zero_grad()
        _loss(model, _local(x, rank), _local(t, rank)).backward()
        opt.step()
        got = {k: p.full_tensor() for k, p in model.named_parameters()}
        _compare(got, want[step], dtype, f"FSDP2 step {step}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_and_main_grad_reduction_equal_single_process(backend, world):
    run_ranks(body_ddp_and_main_grad, world, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_equals_single_process(backend):
    run_ranks(body_fsdp2, 2, backend)
