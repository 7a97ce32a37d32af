"""torch.distributed.checkpoint (DCP) on 2 ranks: a run saved after 2 steps and loaded into fresh
models and optimizers continues exactly as the run that never stopped (bit for bit: losses,
parameters, optimizer state, FP8 delayed-scaling state, a router's balancing buffers).

Every rank trains on the same batches, so the state is replicated, as DCP assumes for plain
tensors. DCP loads into the tensors of the state dict it is given: the fresh model first gets its
delayed-scaling buffers (``fo.quantization.init_delayed_state``); the optimizer's state comes
through ``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_launch import BACKENDS, run_ranks

import fusible_ops as fo

D, E, TOKENS, STEPS, SPLIT = 32, 4, 32, 4, 2
RECIPE = fo.Float8DelayedScaling(amax_history_len=4)


def _model(device, seed: int):
    torch.manual_seed(seed)
    f = dict(device=device)
    return fo.Sequential(
        fo.RMSNorm(D, **f), fo.Linear(D, 2 * D, bias=False, **f), fo.SwiGLU(), fo.Linear(D, D, **f),
        fo.Router(D, E, top_k=2, score="sigmoid", expert_bias=True, **f), fo.Dispatch(),
        fo.GroupedLinear(E, D, D, bias=False, **f), fo.Combine(),
    )


def _step(model, opt, t: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(t)  # the same batch on every rank
    x = torch.randn(TOKENS, D, generator=g).to(device)
    with fo.autocast(recipe=RECIPE):
        y, aux = model(x)
    loss = y.square().mean() + aux
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model[4].update_expert_bias(1e-2)
    return loss.detach()


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def body_dcp_resume(rank, world, device, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(root, f"ckpt_{device.type}")
    model = _model(device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_step(model, opt, t, device) for t in range(SPLIT)]
    dcp.save(_state(model, opt), checkpoint_id=path)
    losses += [_step(model, opt, t, device) for t in range(SPLIT, STEPS)]

    fresh = _model(device, seed=1 + rank)  # (other weights: the checkpoint must overwrite them)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fo.quantization.init_delayed_state(fresh, RECIPE)
    state = _state(fresh, fresh_opt)
    assert "1.fp8_amax_history" in state["model"] and "4._fusible_ops_format" in state["model"]
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = [_step(fresh, fresh_opt, t, device) for t in range(SPLIT, STEPS)]

    for t, (a, b) in enumerate(zip(losses[SPLIT:], resumed)):
        assert torch.equal(a, b), f"rank {rank}: step {SPLIT + t}: loss {a.item()} != {b.item()}"
    want, got = model.state_dict(), fresh.state_dict()
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), f"rank {rank}: {k} differs {want[k]} {got[k]}"
    assert want["1.fp8_amax_history"][:, 0].gt(0).sum() == RECIPE.amax_history_len  # (the state was there)
    ow, og = _state(model, opt)["optim"]["state"], _state(fresh, fresh_opt)["optim"]["state"]
    for name in ow:
        for k in ow[name]:
            assert torch.equal(torch.as_tensor(ow[name][k]), torch.as_tensor(og[name][k])), f"rank {rank}: {name}.{k}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_save_and_load_resumes_exactly(backend, tmp_path):
    run_ranks(body_dcp_resume, 2, backend, str(tmp_path))


# -- FSDP2: sharded parameters and optimizer state, FP8 state, FP8 all-gather ------------------------
def _fsdp_model(device, seed: int, world: int, all_gather: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    f = dict(device=device)
    model = fo.Sequential(fo.RMSNorm(D, **f), fo.Linear(D, 2 * D, bias=False, **f), fo.SwiGLU(),
                          fo.Linear(D, D, **f), fo.GroupedLinear(E, D, D, bias=False, **f))
    if all_gather:
        fo.quantization.enable_fp8_all_gather(model)
    mesh = init_device_mesh(device.type, (world,))
    for i in (1, 3, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_step(model, opt, t: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * t + rank)  # this rank's rows
    x = torch.randn(TOKENS, D, generator=g).to(device)
    splits = torch.tensor([TOKENS // 2, 0, TOKENS // 4, TOKENS // 4], device=device)
    with fo.autocast(recipe=RECIPE, amax_reduction_group=dist.group.WORLD):  # (replicated FP8 state)
        y = model(x, splits)
    loss = y.square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if hasattr(model[1].weight, "_local_tensor") and type(model[1].weight._local_tensor).__name__ == "Float8AllGatherWeight":
        fo.quantization.precompute_fp8_scales(model)
    return loss.detach()


def _full_state(model, opt) -> dict:
    msd, osd = _state(model, opt).values()
    out = {f"model.{k}": v for k, v in msd.items()}
    for name, st in osd["state"].items():
        out.update({f"optim.{name}.{k}": v for k, v in st.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else torch.as_tensor(v)) for k, v in out.items()}


def body_dcp_fsdp_resume(rank, world, device, root, all_gather):
    """A sharded (FSDP2) model with delayed-scaling state and AdamW state, each rank training on its
    own rows (the FP8 state the same on every rank: amaxes reduced over the group), saved after
    SPLIT steps with DCP and loaded into a fresh sharded model and optimizer (other weights): the
    run continues bit for bit, with FP8 all-gather or without (bit-equal to each other, so either
    continues the other's checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.join(root, f"fsdp_{device.type}_{all_gather}")
    model = _fsdp_model(device, 0, world, all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_fsdp_step(model, opt, t, rank, device) for t in range(SPLIT)]
    dcp.save(_state(model, opt), checkpoint_id=path)
    losses += [_fsdp_step(model, opt, t, rank, device) for t in range(SPLIT, STEPS)]

    want = _full_state(model, opt)
    assert any(k.startswith("optim.") for k in want)
    assert want["model.1.fp8_amax_history"][:, 0].gt(0).sum() == RECIPE.amax_history_len  # (the state was there)
    for gather in (all_gather, not all_gather):  # (the checkpoint holds plain tensors: either setting loads it)
        fresh = _fsdp_model(device, 1, world, gather)  # (other weights: the checkpoint must overwrite them)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fo.quantization.init_delayed_state(fresh, RECIPE)
        state = _state(fresh, fresh_opt)
        assert "1.fp8_amax_history" in state["model"] and type(state["model"]["1.weight"]._local_tensor) is torch.Tensor
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        resumed = [_fsdp_step(fresh, fresh_opt, t, rank, device) for t in range(SPLIT, STEPS)]
        what = f"rank {rank}, saved with FP8 all-gather {all_gather}, resumed with {gather}"
        for t, (a, b) in enumerate(zip(losses[SPLIT:], resumed)):
            assert torch.equal(a, b), f"{what}: step {SPLIT + t}: loss {a.item()} != {b.item()}"
        got = _full_state(fresh, fresh_opt)
        assert sorted(want) == sorted(got)
        for k in want:
            assert torch.equal(want[k], got[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("all_gather", [False, True], ids=["bf16-gather", "fp8-gather"])
def test_dcp_fsdp2_fp8_resumes_exactly(all_gather, tmp_path):
    run_ranks(body_dcp_fsdp_resume, 2, "gloo", str(tmp_path), all_gather)
