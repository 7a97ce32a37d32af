"""CPU smoke tests of the ``hf_models`` harness case (transformers' own Llama and Qwen3-MoE at tiny
sizes): the variants that run on CPU pass the float32 loss and gradient checks and carry the
fields the results page reads; a wrong gradient is caught; the page renders the rows; the targets
read them. No timing is asserted."""

import glob
import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

from fusible_ops.bench import CASES, main  # noqa: E402
from fusible_ops.bench import cases_hf  # noqa: E402
from fusible_ops.bench import targets as tg  # noqa: E402
from fusible_ops.bench.cases import FP8_REL_ERR  # noqa: E402
from fusible_ops.bench.harness import REL_ERR_TOL  # noqa: E402

QUICK = ["--quick", "--no-compile", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "5"]


def _rows(out_dir: str) -> list[dict]:
    (path,) = glob.glob(os.path.join(out_dir, "bench_*.jsonl"))
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r["case"] == "hf_models"]


def test_quick_rows_pass_the_float32_checks_and_render(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (no plots: faster, and not what is tested)
    out, page = str(tmp_path / "res"), str(tmp_path / "BENCHMARKS.md")
    assert main(["hf_models", "--out", out, "--report", page, *QUICK]) == 0
    rows = _rows(out)
    assert {(r["config"], r["variant"]) for r in rows} == {
        (c, v) for c in cases_hf.HF_QUICK for v in ("eager", "fused", "fp8_current")}  # (CPU, --no-compile)
    for r in rows:
        fp8 = r["variant"] == "fp8_current"
        assert r["status"] == "ok", r
        assert 0 < r["rel_err"] < (FP8_REL_ERR if fp8 else REL_ERR_TOL), r
        assert r["rel_err"] == pytest.approx(abs(r["loss"] - r["loss_ref"]) / r["loss_ref"], rel=1e-4)
        assert math.isfinite(r["loss"]) and r["loss_ref"] > 0
        assert 0 < r["grad_rel_err"] < (cases_hf.fp8_grad_tolerance(2) if fp8 else cases_hf.GRAD_TOL), r
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["median_ms"] * 1e-3))
        assert r["metric"] == "flops" and r["flops"] == cases_hf.step_flops(cases_hf.HF_QUICK[r["config"]])
        assert r["step_peak_mib"] is None  # (CUDA only)
        assert "worst gradient model." in r["note"], r["note"]
    eager = next(r for r in rows if r["variant"] == "eager")
    assert "liger needs CUDA" in eager["note"] and "torchao" in eager["note"]
    fused = next(r for r in rows if (r["config"], r["variant"]) == ("llama_quick", "fused"))
    assert "fo.convert: LlamaMLP x2, LlamaRMSNorm x5" in fused["note"] and "0 left alone" in fused["note"]
    text = open(page).read()
    assert "## Hugging Face models (training step)" in text
    section = text.split("## Hugging Face models (training step)")[1].split("\n## ")[0]
    for r in rows:
        assert f"| {r['config']} | {r['variant']} | {r['median_ms']:.1f} |" in section
    assert "1.00x (eager)" in section  # (the fastest bf16 peer: eager alone on CPU)
    assert "| 64 | HF Llama-3-8B-shaped" in text and "not in this run" in text  # (the targets name the GPU configs)


def test_a_wrong_gradient_is_a_mismatch(tmp_path, monkeypatch):
    """A variant whose gradients are all doubled passes the loss check but not the gradient one:
    it gets no time."""
    real = cases_hf._variants

    def with_broken(ctx, run):
        variants, notes = real(ctx, run)

        def doubled(model):
            for p in model.parameters():
                p.register_hook(lambda g: 2 * g)
            return model
        variants["broken"] = run.variant("broken", doubled)
        return variants, notes

    monkeypatch.setattr(cases_hf, "_variants", with_broken)
    out = str(tmp_path / "res")
    main(["hf_models:llama_quick", "--variants", "broken", "--out", out, *QUICK])
    by = {r["variant"]: r for r in _rows(out)}
    assert set(by) == {"eager", "broken"} and by["eager"]["status"] == "ok"
    assert by["broken"]["status"].startswith("mismatch: gradients vs float32: global rel norm err 1.0")
    assert by["broken"]["median_ms"] is None and by["broken"]["grad_rel_err"] == pytest.approx(1.0, rel=2e-2)


def test_gradients_are_matched_through_the_state_dict_keys():
    """grads_by_key gives a converted model's gradients under the original model's keys (the fused
    gate/up weight as its two halves), equal to fusible_ops.convert.to_original_names'."""
    import transformers

    import fusible_ops as fo
    from fusible_ops.convert import to_original_names

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cases_hf.hf_config(cases_hf.HF_QUICK["llama_quick"]))
    keys = list(model.state_dict())
    fo.convert(model)
    ids = torch.randint(0, 256, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    got = cases_hf.grads_by_key(model)
    assert list(got) == keys
    want = to_original_names(model, {n: p.grad for n, p in model.named_parameters()})
    assert set(want) == set(keys)
    for k in keys:
        assert torch.equal(got[k], want[k]), k
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)


def test_liger_patches_are_undone():
    """_Undo puts back what a monkey patch of a module and a class replaced, added or removed."""
    import types

    mod = types.ModuleType("m")
    mod.f, mod.g = 1, 2

    class C:
        def forward(self):
            return "hf"

    undo = cases_hf._Undo(mod, C)
    mod.f, mod.h = 10, 3
    del mod.g
    C.forward = lambda self: "liger"
    undo.restore()
    assert (mod.f, mod.g, hasattr(mod, "h"), C().forward()) == (1, 2, False, "hf")


def test_without_transformers_the_case_is_left_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = str(tmp_path / "res")
    assert main(["hf_models", "--out", out, *QUICK]) == 0
    assert _rows(out) == [] and "transformers is not importable" in capsys.readouterr().err
    assert "hf_models" in CASES


def test_targets_compare_the_fastest_of_ours_with_the_fastest_peer():
    row = lambda ms, mib: {"median_ms": ms, "step_peak_mib": mib}  # noqa: E731
    g = {("hf_models", "x"): {"eager": row(30.0, 40960), "compile": row(24.0, 30720), "liger": row(22.0, 20480),
                              "fused": row(21.0, 18432), "fused_compile": row(20.0, 22528)}}
    measured, met = tg.fastest("hf_models", "x", tg.HF_OURS_BF16, tg.HF_BF16_PEERS, 1.05)(g)
    assert measured == "1.10x (fused_compile 20.0 vs liger 22.0 ms)" and met
    assert tg.fastest("hf_models", "x", tg.HF_OURS_BF16, tg.HF_BF16_PEERS, 1.2)(g)[1] is False
    measured, met = tg.step_peak("hf_models", "x", tg.HF_OURS_BF16, "liger", 1.0)(g)  # (of fused_compile)
    assert measured == "1.10x (fused_compile 22.0 vs liger 20.0 GiB)" and not met
    assert tg.step_peak("hf_models", "x", tg.HF_OURS_BF16, "eager", 0.7)(g)[1] is True
    del g[("hf_models", "x")]["liger"]
    assert tg.step_peak("hf_models", "x", tg.HF_OURS_BF16, "liger", 1.0)(g) is None
    assert tg.fastest("hf_models", "y", tg.HF_OURS_BF16, tg.HF_BF16_PEERS, 1.0)(g) is None
