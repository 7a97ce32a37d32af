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
        assert torch.equal(want[k], got[k]), f"rank {rank}: {k} differs"
    assert want["1.fp8_amax_history"][:, 0].gt(0).sum() == RECIPE.amax_history_len  # (the state was there)
    ow, og = _state(model, opt)["optim"]["state"], _state(fresh, fresh_opt)["optim"]["state"]
    for name in ow:
        for k in ow[name]:
            assert torch.equal(torch.as_tensor(ow[name][k]), torch.as_tensor(og[name][k])), f"rank {rank}: {name}.{k}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_save_and_load_resumes_exactly(backend, tmp_path):
    run_ranks(body_dcp_resume, 2, backend, str(tmp_path))
