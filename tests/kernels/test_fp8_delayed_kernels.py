"""The batched delayed-scaling update (fusible_ops.kernels.fp8_delayed): the Triton kernel equals
its ``*_ref`` twin bit for bit, each listed owner's column is what the one-owner step
(``fp8_cast.delayed_update_ref``) gives, the other owners and columns are untouched, and the undo
restores the state. Unmarked tests run Triton's interpreter on CPU; ``gpu`` tests compile it."""

from __future__ import annotations

import pytest
import torch

from fusible_ops import kernels
from fusible_ops.kernels import fp8_cast as C
from fusible_ops.kernels import fp8_delayed as FD

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cpu: the interpreter


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_algo", [True, False], ids=["max", "most_recent"])
@pytest.mark.parametrize("L", [1, 5, 16, 1024])
def test_update_many_matches_ref_and_the_one_owner_step(L, max_algo, device):
    g = torch.Generator().manual_seed(L)
    n = 6
    hist = (torch.rand(n, L + 2, 3, generator=g) * 10 * (torch.rand(n, L + 2, 3, generator=g) > 0.3)).to(device)
    hist[3] = 0.0  # an owner whose history is all zeros: its scale stays
    scale = (torch.rand(n, 3, generator=g) + 0.5).to(device)
    idx = torch.tensor([5, 0, 3, 2], dtype=torch.int32, device=device)
    fmax = 448.0 / 2
    for r in (0, 2):
        h1, s1, h2, s2 = hist.clone(), scale.clone(), hist.clone(), scale.clone()
        with kernels.use("triton"):
            FD.delayed_update_many(h1, s1, idx, r, fmax, max_algo)
        FD.delayed_update_many_ref(h2, s2, idx, r, fmax, max_algo)
        assert torch.equal(h1, h2) and torch.equal(s1, s2)
        for e in range(n):
            if e in idx.tolist():
                h3, s3 = hist[e, :L].clone(), scale[e].clone()
                C.delayed_update_ref(h3, s3, r, fmax, max_algo)
                assert torch.equal(h1[e, :L], h3) and torch.equal(s1[e], s3), e
                assert h1[e, L, r] == hist[e, L - 1, r] and h1[e, L + 1, r] == scale[e, r]  # (kept for an undo)
                others = [c for c in range(3) if c != r]
                assert torch.equal(h1[e][:, others], hist[e][:, others])
                FD.delayed_undo_ref(h1, s1, e, r)
            else:
                assert torch.equal(h1[e], hist[e]) and torch.equal(s1[e], scale[e]), e
        assert torch.equal(h1[:, :L], hist[:, :L]) and torch.equal(s1, scale)


def test_update_many_with_nothing_listed_launches_nothing():
    hist, scale = torch.rand(2, 6, 3), torch.rand(2, 3)
    h, s = hist.clone(), scale.clone()
    with kernels.use("triton"):
        FD.delayed_update_many(h, s, torch.empty(0, dtype=torch.int32), 0, 448.0, True)
    assert torch.equal(h, hist) and torch.equal(s, scale)
