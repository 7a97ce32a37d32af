"""fusible_ops.testing.count_host_reads: the host's reads of tensor data (each a sync on a GPU),
counted on any device, with where each happened; and the MoE layer held to its count."""

import pytest
import torch

import fusible_ops as fo
from fusible_ops.testing.host_reads import count_host_reads


def test_counts_each_kind_of_read_and_where_it_happened():
    x = torch.arange(6)
    with count_host_reads() as reads:
        x.tolist()
        x.sum().item()
        bool(x.any())
        x.nonzero()
        torch.repeat_interleave(x[:3], torch.tensor([1, 2, 0]))  # output size from the data
    assert reads.count == 5, reads.where
    assert all("test_host_reads.py" in w for w in reads.where), reads.where
    assert reads.where[0].startswith("Tensor.tolist")


def test_device_side_work_is_not_counted():
    x = torch.arange(6)
    with count_host_reads() as reads:
        y = torch.cumsum(x, 0) * 2
        torch.repeat_interleave(x[:3], torch.tensor([1, 2, 0]), output_size=3)  # size given: no read
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 2]), torch.ones(2))
        y.sort(stable=True)
    assert reads.count == 0, reads.where
    assert torch.Tensor.tolist(torch.arange(2)) == [0, 1]  # (the patch is gone after the block)


@pytest.mark.gpu
def test_gpu_moe_layer_forward_and_backward_read_nothing_on_the_host():
    """The MoE layer's claim: no host sync in training (routing, counts and sort on the device)."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    moe = fo.Sequential(fo.Router(64, 8, top_k=2, **kw), fo.Dispatch(), fo.GroupedLinear(8, 64, 256, bias=False, **kw),
                        fo.SwiGLU(), fo.GroupedLinear(8, 128, 64, bias=False, **kw), fo.Combine())
    x = torch.randn(300, 64, **kw, requires_grad=True)
    for _ in range(2):  # (the first call builds the plan and compiles kernels)
        y, aux = moe(x)
        (y.float().square().mean() + aux).backward()
    torch.cuda.synchronize()
    with count_host_reads() as reads:
        y, aux = moe(x)
        (y.float().square().mean() + aux).backward()
    assert reads.count == 0, reads.where
