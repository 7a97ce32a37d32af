"""Test configuration shared by the whole suite.

* Without CUDA, Triton's interpreter is switched on *before* triton is imported, so
  ``fusible_ops.kernels.use("triton")`` can run every kernel on CPU tensors.
* Tests marked ``gpu`` are skipped without CUDA; on a GPU every direct kernel launch is checked
  against Triton's own specialization (``FUSIBLE_OPS_CHECK_DIRECT``), and small training calls
  take the fused kernels too (``FUSIBLE_OPS_NATIVE_MAX_NUMEL=0``).
* With CUDA, Triton's interpreter is off (it would run the GPU tests' kernels too): a test that
  runs kernels on CPU tensors through ``kernels.use("triton")`` is skipped there, with the reason,
  when it reaches :class:`fusible_ops.kernels.InterpreterRequired` (it runs in CPU CI; the
  ``gpu`` tests cover the same kernels on the device).
* Launch-geometry caches are emptied around each test (tests change tiling constants).
* CPU threads: each xdist worker takes its share of the cores (``torch.set_num_threads``), so
  that workers times threads never exceeds the cores (oversubscribed OpenMP threads spin against
  each other: on 2 cores, 2 workers of 2 threads ran the bench tests 5x slower). An explicit
  ``OMP_NUM_THREADS`` is kept.
* torch.compile's on-disk cache is private to the run (``TORCHINDUCTOR_CACHE_DIR``, set before the
  workers start, so they share it): kernels compiled by an earlier run under other CPU settings
  (e.g. ``ATEN_CPU_CAPABILITY``) were loaded by later runs and corrupted the heap.
* Hypothesis runs a fixed, derandomized profile (``ci``) with bounded examples
  (``HYPOTHESIS_PROFILE=dev`` for more). Users' projects have no such profile: the README recipe
  uses ``fusible_ops.testing.fusion_settings()`` instead (tests/test_testing_helpers.py runs it
  without this file).
"""

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# every direct kernel launch is checked against Triton's own specialization (GPU runs)
os.environ.setdefault("FUSIBLE_OPS_CHECK_DIRECT", "1")
# small CUDA training calls would run torch's own ops (fusible_ops.fuser.NATIVE_MAX_NUMEL): the GPU
# tests' small shapes must exercise the fused kernels; tests of that path turn it on themselves
os.environ.setdefault("FUSIBLE_OPS_NATIVE_MAX_NUMEL", "0")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _fused_plans(request):
    """The rules' cost hints (speed choices measured on one GPU) are off unless a test is marked
    ``cost_hints``: the other tests exercise the fused ops whatever the hints prefer."""
    if request.node.get_closest_marker("cost_hints") is not None:
        yield
        return
    import fusible_ops as fo

    with fo.fusion_rules.disabled("cost hints"):
        yield


@pytest.fixture(autouse=True)
def _fresh_launch_geometry():
    """Tests change tiling constants (monkeypatch): no launch geometry outlives a test."""
    from fusible_ops.kernels.launch import clear_geometry_caches

    clear_geometry_caches()
    yield
    clear_geometry_caches()


def _needs_interpreter(exc: BaseException) -> bool:
    from fusible_ops.kernels import InterpreterRequired

    seen = set()
    while exc is not None and id(exc) not in seen:  # (hypothesis may chain or group it)
        seen.add(id(exc))
        if isinstance(exc, InterpreterRequired):
            return True
        group = getattr(exc, "exceptions", None)
        if group and any(_needs_interpreter(e) for e in group):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    excinfo = outcome.excinfo
    if excinfo is not None and _needs_interpreter(excinfo[1]):
        why = ("runs Triton kernels on CPU tensors: needs Triton's interpreter (TRITON_INTERPRET=1, off when "
               "CUDA is present); the gpu tests run these kernels on the device")
        try:  # (reported at the test's location, not the hook's, where pytest supports it)
            skipped = pytest.skip.Exception(why, _use_item_location=True)
        except TypeError:
            skipped = pytest.skip.Exception(why)
        outcome.force_exception(skipped)


_OWN_INDUCTOR_CACHE = None


def pytest_configure(config):
    """In the main process, before xdist's workers start: a private torch.compile cache for the
    run (see the module docstring); GPU runs: build the C++ replay extension once, so the workers
    do not all compile it at once on a fresh machine."""
    global _OWN_INDUCTOR_CACHE
    if hasattr(config, "workerinput"):
        return
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _OWN_INDUCTOR_CACHE = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusible-ops-inductor-")
    if torch.cuda.is_available():
        from fusible_ops import replay

        replay.extension()


def pytest_unconfigure(config):
    if _OWN_INDUCTOR_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_OWN_INDUCTOR_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    from fusible_ops.kernels import interpreter_enabled

    if not interpreter_enabled():
        skip = pytest.mark.skip(reason="launches Triton kernels on CPU tensors: needs Triton's interpreter "
                                       "(TRITON_INTERPRET=1, off when CUDA is present)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
