"""FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)`` over float32 weights swaps each parameter
between the float32 sharded ``DTensor`` and the bf16 unsharded tensor at every unshard and
reshard. Those swaps are no op state change: after the first unshard (the dtype calls see moved
from float32 to bf16: one replan) the ops' ``state_version`` and the fuser's plans stay put, step
after step (each swap bumped it before: a new plan per call, the plan cache growing by one per
step, and a compiled layer recompiling every step). One process, a gloo group of one."""

import pytest
import torch
import torch.distributed as dist

import fusible_ops as fo


@pytest.fixture
def group():
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = fo.Sequential(fo.RMSNorm(32), fo.Linear(32, 128, bias=False), fo.SwiGLU(),
                                 fo.Linear(64, 32, bias=False))

    def forward(self, x):
        return self.seq(x)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("recipe", [None, fo.Float8CurrentScaling()], ids=["high-precision", "fp8"])
def test_fsdp2_swaps_replan_only_when_the_call_dtype_moves(group, param_dtype, recipe):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Block()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    ops = list(model.seq)
    sharded = [op.state_version for op in ops]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for _ in range(4):
        with fo.autocast(recipe=recipe) if recipe is not None else torch.autograd.set_grad_enabled(True):
            y = model(torch.randn(16, 32))
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        fuser = model.seq._get_stages()[0][0]
        seen.append(([op.state_version for op in ops], fuser.num_plans_made, len(fuser._plans)))
    assert all(s == seen[0] for s in seen), seen  # steps 2-4: no replan, no new state
    moved = [a != b for a, b in zip(sharded, seen[0][0])]
    # the weights' owners (RMSNorm, the Linears) replan once where the dtype calls see moved
    assert moved == [param_dtype is not None, param_dtype is not None, False, param_dtype is not None], moved
    assert seen[0][2] == 1
    if recipe is not None:  # each step's unshard casts the weight afresh (the swap drops its FP8 form)
        assert [ops[1].fp8_weight_casts, ops[3].fp8_weight_casts] == [4, 4]
