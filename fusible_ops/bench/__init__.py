"""Benchmark harness: ``python -m fusible_ops.bench [CASE ...] [--list] [--out DIR] [--warmup-ms N]
[--rep-ms N] [--quick] [--no-compile] [--variants a,b] [--device DEV]``.

Times each case's fused ``fusible_ops.Sequential`` against the same ops in eager PyTorch and
under ``torch.compile`` (plus case-specific baselines), with copy-bandwidth and bf16-matmul
ceilings measured in the same run. See :mod:`fusible_ops.bench.harness` and
:mod:`fusible_ops.bench.cases` (and :mod:`fusible_ops.bench.timing` for the timer).
``python -m fusible_ops.bench convergence`` trains instead of timing: :mod:`fusible_ops.bench.convergence`.
"""

from .cases import CASES, Bench, BenchContext, routing_splits
from . import cases_moe, cases_dist  # noqa: F401,E402  (register the moe_layer and distributed cases)
from . import cases_model, cases_lm, cases_grouped  # noqa: F401,E402  (register dense_layers, moe_layers, lm_head, grouped_gemm)
from . import cases_hf  # noqa: F401,E402  (register hf_models)
from . import cases_fsdp  # noqa: F401,E402  (register fsdp_layers)
from .harness import FIELDS, main, measure_ceilings
from .timing import Timer, Timing, percentile

__all__ = ["CASES", "FIELDS", "Bench", "BenchContext", "Timer", "Timing", "main", "measure_ceilings", "percentile",
           "routing_splits"]
