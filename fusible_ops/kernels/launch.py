"""Launch utilities shared by every kernel family (the one home for them).

* :data:`TRITON_DTYPES`, :func:`compute_dtype`, :func:`dot_precision`: dtype rules.
* :func:`num_sms`: multiprocessors of a tensor's own device (cached).
* :func:`kernel_op`: a launcher registered as a ``torch.library`` custom op for tracing, called
  directly in eager mode.
* :func:`as_rows`, :func:`elementwise_config`, :func:`needs_int64`, :data:`MIN_BLOCK_C`: row views
  and tiling of memory-bound elementwise passes.
* :class:`TunedKernel`: one kernel with its autotuned configs, its fixed (untuned) configs and its
  interpreter config; ``launch`` picks one (the fixed-or-tuned config runner).
* :class:`DirectKernel`: launches a kernel through its compiled binary once Triton has compiled
  it for a specialization (Triton's per-call Python launch path costs more host time than the
  launch itself).

Nothing here launches work by itself; nothing here syncs with the host.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional, Sequence

import torch

try:
    import triton
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the Triton kernels serve (float64, the reference precision, always runs the ``*_ref``)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The math dtype of every kernel and ``*_ref``: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: IEEE for fp32 (tests compare
    against float64), tf32 otherwise (ignored by Triton for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device, interpreter_programs: int = 2) -> int:
    """Multiprocessors of ``device`` (the tensor's own device; the current device when it has no
    index), cached per device. On CPU (Triton's interpreter) ``interpreter_programs``: a few
    programs, so persistent loops really loop on tiny test shapes."""
    if device.type != "cuda":
        return interpreter_programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


SM_RESERVE = [0]
"""Multiprocessors the persistent kernels leave free, process-wide (:func:`reserve_sms`)."""


@contextlib.contextmanager
def reserve_sms(n: int):
    """Inside the block, persistent kernels (the grouped GEMMs) launch one program per SM for all
    but ``n`` SMs, so that communication kernels running beside them (an all-to-all on another
    stream) do not hold back programs that a persistent grid assigned its tiles to statically.
    Launches are specialized per reserve (part of their signature and launch records)."""
    previous, SM_RESERVE[0] = SM_RESERVE[0], max(0, int(n))
    try:
        yield
    finally:
        SM_RESERVE[0] = previous


def kernel_op(name: str, *, mutates_args=(), eager: Optional[Callable] = None):
    """Register a launcher as the ``torch.library`` custom op ``name`` (so ``torch.compile``
    traces it through its fake implementation), and return a callable that runs the launcher
    DIRECTLY in eager mode: eager calls skip the custom-op dispatch (its Python wrapper costs
    far more host time than a Triton launch), traced calls go through the op.

    ``eager``: what eager calls run instead of the op's body (same arguments and results, except
    that it may return None where the op, which cannot return None, returns a fresh empty
    placeholder: eager calls then allocate no dummies).
    The returned callable has ``register_fake`` (decorator, as on the op) and ``op``.
    """

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        is_compiling = torch.compiler.is_compiling
        direct = eager if eager is not None else fn

        def call(*args):
            return op(*args) if is_compiling() else direct(*args)

        call.op = op
        call.register_fake = op.register_fake
        call.__name__ = fn.__name__
        call.__doc__ = fn.__doc__
        return call

    return wrap


def placeholder(t: Optional[torch.Tensor], like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t``, or for None a fresh empty [0] tensor on ``like``'s device (``dtype``, default
    ``like``'s): what a :func:`kernel_op` custom op returns for an output not computed (custom
    ops return no None, and no output may alias another); eager calls return None instead."""
    return t if t is not None else like.new_empty(0, dtype=dtype)


_CACHES: list = []


def geometry_cache() -> dict:
    """A new per-shape launch-geometry cache (a dict bounded by :func:`remember`), registered so
    that :func:`clear_geometry_caches` empties it."""
    cache: dict = {}
    _CACHES.append(cache)
    return cache


def remember(cache: dict, key, value):
    """``cache[key] = value`` (the cache is emptied first when it holds 4096 entries: bounded under
    dynamic shapes); returns ``value``."""
    if len(cache) >= 4096:
        cache.clear()
    cache[key] = value
    return value


def clear_geometry_caches() -> None:
    """Forget every cached launch geometry (after changing a tiling constant, e.g. in tests)."""
    for c in _CACHES:
        c.clear()


_TUNED: list = []  # every TunedKernel (module-level kernels: never freed)


def forget_tuning() -> None:
    """Forget every autotuning choice, as in a fresh process (tests of first-call behaviour)."""
    clear_geometry_caches()
    for k in _TUNED:
        k._chosen.clear()
        k.tuned.cache.clear()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids, in plain Python (``triton.cdiv`` is a constexpr function
    whose host-side call costs microseconds)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for n == 0, as ``triton.next_power_of_2``), in plain
    Python."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- elementwise tiling
MIN_BLOCK_C = 8
"""Smallest column tile of elementwise passes (dropout masks draw 8 columns per Philox call)."""
EW_MAX_BLOCK_C = 1024  # tile caps of elementwise passes (tests shrink them to get many programs)
EW_TILE = 4096
INT64_MIN_COUNTERS = 2**31  # counters >= this need int64 (tests lower it to run the int64 path)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D ``[rows, cols]`` view of ``x`` (row-major order kept) with column stride 1.

    Views when the strides allow it; otherwise copies (``reshape`` / ``contiguous``). Zero
    columns keep the rows (``[n, 0]``).
    """
    if x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1):  # already rows (no reshape: host time)
        return x
    if x.dim() == 0:
        x2 = x.reshape(1, -1)
    else:
        x2 = x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.reshape(x.shape[:-1].numel(), 0)
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def row_align(n: int, *tensors: Optional[torch.Tensor], most: int = 16) -> int:
    """The largest power of two, at most ``most``, that divides ``n`` and every stride but the last
    of each tensor (None skipped): whatever rows :func:`as_rows` makes of them (a view, or a
    contiguous copy of row stride ``n``) start a multiple of it apart. Kernels that know it (see
    ``norm_jit.aligned``) can use 16-byte accesses on rows whose length is a multiple of 8 but not
    of 16, which Triton's own specialization (multiples of 16) leaves scalar."""
    a = most
    for v in (n, *[s for t in tensors if t is not None for s in t.stride()[:-1]]):
        while a > 1 and v % a:
            a //= 2
    return a


def cast_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, or ``t`` itself when it has that dtype (a no-op ``.to`` still costs host
    time)."""
    return t if t.dtype == dtype else t.to(dtype)


def contiguous_or(t: Optional[torch.Tensor], dummy: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous (itself when it is already: ``.contiguous()`` still costs host time), or
    ``dummy`` (a pointer for an absent kernel argument) when ``t`` is None."""
    return dummy if t is None else t if t.is_contiguous() else t.contiguous()


def needs_int64(n_rows: int, n_cols: int) -> bool:
    """Whether the dropout-mask counters of an ``[n_rows, n_cols]`` view need int64."""
    return n_rows * ((n_cols + 7) // 8) >= INT64_MIN_COUNTERS


def elementwise_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for a memory-bound elementwise pass: ~``EW_TILE``-element
    tiles; BLOCK_C is a power of two >= :data:`MIN_BLOCK_C`."""
    block_c = max(MIN_BLOCK_C, min(next_pow2(max(n_cols, 1)), EW_MAX_BLOCK_C))
    block_r = max(1, min(next_pow2(max(n_rows, 1)), EW_TILE // block_c))
    num_warps = 8 if block_r * block_c >= 4096 else 4
    return block_r, block_c, num_warps


# ----------------------------------------------------------------------------- direct launches
DIRECT = os.environ.get("FUSIBLE_OPS_DIRECT_LAUNCH", "1") != "0"
"""Launch compiled kernels directly (see :class:`DirectKernel`). ``FUSIBLE_OPS_DIRECT_LAUNCH=0``
(or setting this to False) sends every launch through Triton's own launch path, e.g. to let a
profiler's Triton launch hooks see each launch."""

CHECK_DIRECT = os.environ.get("FUSIBLE_OPS_CHECK_DIRECT", "0") == "1"
"""Verify every direct launch: Triton's own binder must give the specialization the cached binary
was compiled for (the GPU tests turn this on)."""


class DirectKernel:
    """A ``@triton.jit`` kernel launched through the compiled binary of its specialization.

    The first call with a given ``key`` goes through Triton (``kernel[grid](...)``:
    specialization, compilation, launch) and keeps the compiled kernel; later calls hand the
    arguments straight to its launcher, on the current stream of the device the binary was
    loaded on (switched to for the launch when it is not the current one). A call with a tensor
    whose address is not 16-byte aligned always goes through Triton (it specializes on that).

    What must hold: ``key`` fixes every other specialization Triton makes, i.e. which arguments
    are tensors (their positions are kept with the binary: later calls read only those
    arguments' data pointers), each tensor's dtype, the device, the value class of each integer
    argument (1, a multiple of 16, 32 or 64 bit), each ``None`` and every constexpr in ``meta``:
    callers key on the device, shapes, strides, dtypes and flags the arguments are computed
    from, or use :func:`generic_key`.
    :data:`CHECK_DIRECT` verifies this against Triton's binder on every launch. The constexprs
    must be the kernel's trailing parameters (checked when the binary is cached).
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._bins = geometry_cache()  # (emptied with the geometry caches: keys depend on tiling)

    def __call__(self, grid: tuple, key, args: tuple, meta: dict) -> None:
        """Launch on ``grid`` (a tuple of 1 to 3 ints) with positional ``args`` (every runtime
        argument, in order; the first is a tensor) and ``meta`` (constexprs and launch options
        such as ``num_warps``)."""
        entry = self._bins.get(key) if DIRECT else None
        if entry is not None:  # the key fixes which arguments are tensors: swap in their pointers
            raw, ptrs = list(args), 0
            for i in entry[3]:
                p = raw[i] = args[i].data_ptr()
                ptrs |= p
            if not ptrs & 15:
                if CHECK_DIRECT:
                    self._check(args, meta, entry[1], entry[2])
                _run_binary(entry, grid, raw)
                return
        self._first(grid, key, args, meta, all(a.data_ptr() & 15 == 0 for a in args if isinstance(a, torch.Tensor)))

    def launch_keyed(self, grid: tuple, key, args: tuple, meta: dict, ptrs: int, raw: Sequence) -> None:
        """:meth:`__call__` for a caller that has OR-ed the tensors' data pointers into ``ptrs``
        and made ``raw``: ``args`` with each tensor replaced by its data pointer (an int).

        The binary gets ``raw``: Triton's C launcher takes an int pointer as it is, where a
        tensor costs a ``data_ptr()`` call and a driver query (``cuPointerGetAttribute``) per
        argument. That query translates host-mapped pointers; a CUDA tensor's data pointer is
        already its device address, and only CUDA tensors reach a binary."""
        entry = self._bins.get(key) if DIRECT and not ptrs & 15 else None
        if entry is None:
            self._first(grid, key, args, meta, not ptrs & 15)
            return
        if CHECK_DIRECT:
            self._check(args, meta, entry[1], entry[2])
        _run_binary(entry, grid, raw)

    def launch_raw(self, grid: tuple, key, raw: Sequence) -> bool:
        """Launch the binary cached under ``key`` with ``raw`` (every runtime argument, tensors as
        int data pointers, all 16-byte aligned); False, launching nothing, when no binary is
        cached under ``key`` (then the caller takes the full path)."""
        entry = self._bins.get(key) if DIRECT else None
        if entry is None:
            return False
        _run_binary(entry, grid, raw)
        return True

    def _first(self, grid, key, args, meta, aligned) -> None:
        """Through Triton; keeps the compiled kernel (CUDA, aligned tensors)."""
        if RECORDER[0] is not None:
            RECORDER[0].fail(f"{self.kernel.__name__} launched through Triton (compile or unaligned pointer)", True)
        dev = args[0].get_device()  # -1 on CPU (Triton's interpreter)
        if dev >= 0 and dev != torch._C._cuda_getDevice():  # launch on the tensors' device
            with torch.cuda.device(dev):
                return self._first(grid, key, args, meta, aligned)
        ck = self.kernel[grid](*args, **meta)
        if DIRECT and aligned and ck is not None:
            remember(self._bins, key, (self._launcher(ck, args, meta, dev), dev,
                                       self._spec(args, meta, dev) if CHECK_DIRECT else None,
                                       tuple([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]), ck))

    def _launcher(self, ck, args, meta, dev: int):
        """``go(grid, stream, args)``: the compiled kernel's launch with the constexprs appended.

        A binary that needs global scratch memory (TMA descriptors made on the device) gets a
        buffer sized as Triton sizes it (grid x CTAs x per-CTA bytes): on the device's default
        stream the one buffer :func:`_default_stream_scratch` keeps, else (side streams, graph
        capture) a fresh one per launch from torch's caching allocator, as Triton's own launch path
        does through the allocator :func:`~fusible_ops.kernels.persistent.tma_ok` installs."""
        tail = []
        for p in self.kernel.params[len(args):]:
            if not p.is_constexpr:
                raise TypeError(f"{self.kernel.__name__}: DirectKernel needs the constexprs last; "
                                f"{p.name} is a runtime argument after them")
            tail.append(meta[p.name] if p.name in meta else p.default)
        tail = tuple(tail)
        run, fn, md = ck.run, ck.function, ck.packed_metadata
        raw = getattr(run, "launch", None)
        scratch = getattr(run, "global_scratch_size", 0)
        scratch_ok = not scratch or (getattr(run, "num_ctas", None) and getattr(run, "global_scratch_align", 1 << 30) <= 256
                                     and dev >= 0)
        if (raw is not None and not hasattr(run, "arg_annotations") and not getattr(run, "gsan_enabled", False)
                and scratch_ok and not run.profile_scratch_size):
            # Triton 3.6's launcher object: its C launch directly
            coop, pdl = run.launch_cooperative_grid, run.launch_pdl
            if scratch:
                per_program = run.num_ctas * scratch  # bytes (torch's blocks are 512-byte aligned)

                def go(grid, stream, args):
                    g1, g2 = grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
                    size = grid[0] * g1 * g2 * per_program
                    buf = (_default_stream_scratch(dev, size) if stream == 0 and not pdl else
                           torch.empty(size, dtype=torch.int8, device=dev))
                    raw(grid[0], g1, g2, stream, fn, coop, pdl, buf, None, md, None, None, None, *args, *tail)
            else:
                def go(grid, stream, args):
                    raw(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, fn,
                        coop, pdl, None, None, md, None, None, None, *args, *tail)
        else:
            def go(grid, stream, args):
                run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, fn, md,
                    None, None, None, *args, *tail)
        return go

    def _spec(self, args, meta, dev):
        binder = self.kernel.device_caches[dev][4]
        return repr(binder(*args, **meta)[1])

    def _check(self, args, meta, dev, spec) -> None:
        now = self._spec(args, meta, dev)
        if now != spec:
            raise AssertionError(f"{self.kernel.__name__}: direct launch with specialization {now}, "
                                 f"binary compiled for {spec}: its cache key misses an argument")


def generic_key(args: tuple, meta: dict) -> tuple:
    """A :class:`DirectKernel` key for call sites whose integer arguments are not computed from a
    cached shape: the device, each tensor's dtype, :func:`arg_classes` and the ``meta`` values."""
    return (args[0].device, *[a.dtype for a in args if isinstance(a, torch.Tensor)], arg_classes(args),
            *meta.values())


def arg_classes(args: tuple) -> tuple:
    """What Triton specializes a launch on in the non-tensor arguments ``args``: for an integer,
    whether it is 1, a multiple of 16, and 32-bit; for anything else, the value (None, bools,
    floats are few per call site). A :class:`DirectKernel` key for call sites whose integer
    arguments are not computed from a cached shape."""
    return tuple([(a == 1, a % 16 == 0, -2**31 <= a < 2**31) if type(a) is int else a
                  for a in args if not isinstance(a, torch.Tensor)])


def _raw_stream(dev: int) -> int:
    return torch._C._cuda_getCurrentRawStream(dev)


RECORDER: list = [None]
"""``[recorder]`` while :mod:`fusible_ops.replay` records a call (it sees every launch of a cached
binary, and hears of any other Triton launch), else ``[None]``."""


def _run_binary(entry: tuple, grid: tuple, raw: Sequence) -> None:
    """Launch a cached binary (``entry``: ``(go, device, spec, tensor positions, compiled kernel)``)
    on the current stream of its device, switching to that device for the launch when it is not
    the current one."""
    go, dev = entry[0], entry[1]
    if RECORDER[0] is not None:
        RECORDER[0].launch(entry, grid, raw)
    if _MULTI_GPU and dev != torch._C._cuda_getDevice():
        with torch.cuda.device(dev):
            go(grid, _raw_stream(dev), raw)
        return
    go(grid, _raw_stream(dev), raw)


_SCRATCH: dict[int, torch.Tensor] = {}


def _default_stream_scratch(dev: int, size: int) -> torch.Tensor:
    """The global-scratch buffer of launches on device ``dev``'s default stream (raw handle 0):
    one per device, grown when a launch needs more (from torch's caching allocator).

    Why one buffer is enough there: launches on one stream run one after another (no
    programmatic dependent launch: callers pass only non-PDL launches), and each program writes
    its scratch before it reads it. The default stream is never destroyed, so no other stream
    ever gets its handle: a buffer keyed by any other raw handle could be shared by a new stream
    created after an old one's destruction while the old one's work still runs. Side streams
    and graph capture (never on the default stream) take a fresh buffer per launch instead."""
    buf = _SCRATCH.get(dev)
    if buf is None or buf.numel() < size:
        # (the old buffer goes back to the allocator, stream-ordered: reused after the launches queued on it)
        buf = _SCRATCH[dev] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device=dev)
    return buf


_MULTI_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 1


# ----------------------------------------------------------------------------- config runner
AUTOTUNE = os.environ.get("FUSIBLE_OPS_GGEMM_AUTOTUNE", "1") != "0"
"""Autotune GEMM kernels on the GPU (keyed on feature sizes, dtype and flags only).
``FUSIBLE_OPS_GGEMM_AUTOTUNE=0`` (or setting this to False) uses each kernel's fixed configs:
no tuning pass, e.g. for tests. So does ``torch.use_deterministic_algorithms(True)``
(:func:`autotuning`)."""


def autotuning() -> bool:
    """Whether GEMM kernels autotune now: :data:`AUTOTUNE`, and not under
    ``torch.use_deterministic_algorithms(True)``. The autotuner picks a config by timing, so two
    processes may pick differently (e.g. under load) and sum in another order: a run resumed in a
    fresh process, or a rerun, would not be bit-exact. The fixed configs depend on the dtype alone."""
    return AUTOTUNE and not torch.are_deterministic_algorithms_enabled()


def fit_configs(configs: Sequence, fit: dict, sizes: dict) -> list:
    """The configs whose tiles fit the problem: for each ``size name -> tile meta-parameter`` of
    ``fit``, the tile is at most ``max(next_pow2(size), the smallest such tile in configs)``.
    Never empty (the smallest tiles always fit)."""
    limits = {meta: max(next_pow2(int(sizes[arg])), min(c.kwargs[meta] for c in configs))
              for arg, meta in fit.items()}
    return [c for c in configs if all(c.kwargs[m] <= lim for m, lim in limits.items())]


class TunedKernel:
    """A ``@triton.jit`` kernel with three ways to pick its meta-parameters.

    * CPU tensors (Triton's interpreter): ``interp_meta``, tiny fixed tiles.
    * CUDA with :func:`autotuning` on: ``triton.autotune(configs, key)`` on the first call of a key;
      its choice is cached here, so later calls launch the kernel directly (the autotuner's
      per-call Python costs tens of microseconds of host time).
    * CUDA without (``FUSIBLE_OPS_GGEMM_AUTOTUNE=0``, or deterministic algorithms on): ``fixed`` =
      (config for 16-bit inputs, config for fp32 inputs).

    ``grid`` passed to :meth:`launch` is a function of the chosen meta-parameters. The tuning key
    is the values of the ``key`` arguments plus the dtypes of the tensor arguments (as Triton's).

    ``fit`` maps a size argument to the tile meta-parameter that spans it (e.g. ``{"N": "BN"}``):
    before tuning a key, configs whose tile exceeds that size's next power of two (and the
    smallest tile of the list) are dropped (:func:`fit_configs`). Their extra rows or columns are
    masked work, so they cannot win; where one config is left, Triton compiles only it and times
    nothing (tiny problems, e.g. the 8-feature experts of the distributed tests, tuned 6 configs
    per GEMM before).
    """

    def __init__(self, kernel, configs: Sequence, key: Sequence[str], fixed: tuple, interp_meta: dict,
                 restore_value: Optional[Sequence[str]] = None, fit: Optional[dict] = None) -> None:
        self.kernel = kernel
        self.configs = list(configs)
        prune = None
        if fit:
            def prune(configs, named_args, **kwargs):
                return fit_configs(configs, fit, {**named_args, **kwargs})
            prune = {"early_config_prune": prune}
        self.tuned = triton.autotune(self.configs, key=list(key), restore_value=list(restore_value or ()),
                                     prune_configs_by=prune)(kernel)
        self.direct = DirectKernel(kernel)
        self.fixed = fixed
        self.interp_meta = dict(interp_meta)
        names = list(kernel.arg_names)
        self._key_pos = [(names.index(k), k) for k in key]
        self._chosen: dict = {}
        _TUNED.append(self)
        self._ready = geometry_cache()  # launch signature -> (grid, meta)
        self._records = geometry_cache()  # (autotuning(), caller's key) -> (grid, signature, meta, int arguments)

    def _key(self, args: tuple, const: dict) -> tuple:
        key = tuple(args[i] if i < len(args) else const[k] for i, k in self._key_pos)
        return key + tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))

    def launch_cached(self, key: tuple, tensors: tuple, build: Callable[[], tuple], dtype: torch.dtype,
                      device: torch.device) -> None:
        """One launch whose arguments are the ``tensors`` (the kernel's leading arguments, in
        order) followed by integers, through a record kept per ``key``.

        ``build()`` returns ``(args, const, grid)`` as :meth:`launch` takes them (``args`` begins
        with ``tensors``). ``key`` is the caller's: it must fix everything ``build`` computes
        (shapes, strides, dtypes, flags, the device) given that every tensor's data pointer is
        16-byte aligned. The first call of a key builds and launches as :meth:`launch` does and
        keeps the launch (grid, signature, constexprs, integer arguments); later calls with
        aligned pointers hand ``(pointers..., integers...)`` to the compiled binary without
        calling ``build`` (its Python costs more host time than the launch). Unaligned pointers,
        CPU tensors and a binary not compiled yet take the full path. :data:`CHECK_DIRECT` (GPU
        tests) rebuilds on every call and checks the record against it."""
        if device.type == "cuda":
            rec = self._records.get((autotuning(), SM_RESERVE[0], key))
            if rec is not None:
                raw = [t.data_ptr() for t in tensors]
                ptrs = 0
                for p in raw:
                    ptrs |= p
                if not ptrs & 15:
                    if CHECK_DIRECT:
                        self._check_record(rec, tensors, build)
                    if self.direct.launch_raw(rec[0], rec[1], (*raw, *rec[3])):
                        return
        args, const, grid = build()
        self.launch(grid, args, const, dtype, device, record=(key, len(tensors)))

    def _check_record(self, rec, tensors, build) -> None:
        args, const, grid = build()
        n = len(tensors)
        sig = self._signature(args, const, args[0].device)
        got = (self._ready.get(sig), sig, args[n:])
        want = ((rec[0], rec[2]), rec[1], rec[3])
        if got != want or any(a is not t for a, t in zip(args, tensors)):
            raise AssertionError(f"{self.kernel.__name__}: launch record {want} but the arguments give {got}: the "
                                 f"caller's record key misses something its build() depends on")

    def _signature(self, args, const, device) -> tuple:
        sig = [autotuning(), SM_RESERVE[0], device, *const.items()]
        for a in args:
            sig.append(a.dtype if isinstance(a, torch.Tensor) else a)
        return tuple(sig)

    def launch(self, grid: Callable[[dict], tuple], args: tuple, const: dict, dtype: torch.dtype,
               device: torch.device, record: Optional[tuple] = None) -> None:
        """One launch of the kernel on ``args`` (positional, in the kernel's order) with the
        constexprs ``const``. ``grid`` must depend only on the non-tensor arguments, ``const`` and
        the device (it is evaluated once per such signature). ``record``: ``(key, n)`` from
        :meth:`launch_cached` (``args[:n]`` tensors, the rest integers)."""
        if device.type != "cuda":
            self.kernel[grid(self.interp_meta)](*args, **const, **self.interp_meta)
            return
        # Everything a launch decides (config, grid, constexprs, Triton's specialization) is a
        # function of this signature: computed once per signature, then the binary is launched.
        sig, ptrs, raw = [autotuning(), SM_RESERVE[0], device, *const.items()], 0, []
        for a in args:
            if isinstance(a, torch.Tensor):
                sig.append(a.dtype)
                p = a.data_ptr()
                ptrs |= p
                raw.append(p)
            else:
                sig.append(a)
                raw.append(a)
        sig = tuple(sig)
        ready = self._ready.get(sig)
        if ready is None:
            ready = self._prepare(sig, grid, args, const, dtype)
            if ready is None:  # the autotuner ran (and launched) this call
                return
        self.direct.launch_keyed(ready[0], sig, args, ready[1], ptrs, raw)
        if record is not None and not ptrs & 15:
            key, n = record
            tail = args[n:]
            if any(isinstance(a, torch.Tensor) for a in tail) or not all(isinstance(a, torch.Tensor) for a in args[:n]):
                raise TypeError(f"{self.kernel.__name__}: launch_cached needs the {n} tensors first, then no tensor")
            remember(self._records, (sig[0], SM_RESERVE[0], key), (ready[0], sig, ready[1], tail))

    def _prepare(self, sig, grid, args, const, dtype):
        """(grid, meta) of a new signature, or None after a tuning run launched the call itself."""
        if sig[0]:  # (autotuning() at this launch)
            key = self._key(args, const)
            cfg = self._chosen.get(key)
            if cfg is None:
                if RECORDER[0] is not None:
                    RECORDER[0].fail(f"{self.kernel.__name__} autotuned", True)
                if args[0].is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"{self.kernel.__name__}: first call of tuning key {key} inside a CUDA graph capture; "
                        f"autotuning synchronizes, which a capture refuses. Run the same call once before "
                        f"capturing (fusible_ops.make_graphed_callables warms up forward, backward and "
                        f"backward_dw), or set FUSIBLE_OPS_GGEMM_AUTOTUNE=0")
                self.tuned[grid](*args, **const)
                best = getattr(self.tuned, "best_config", None)
                if best is not None:
                    self._chosen[key] = best
                return None
        else:
            cfg = self.fixed[1 if dtype == torch.float32 else 0]
        meta = {**const, **cfg.all_kwargs()}
        return remember(self._ready, sig, (grid(cfg.kwargs), meta))


__all__ = ["AUTOTUNE", "autotuning", "CHECK_DIRECT", "DIRECT", "MIN_BLOCK_C", "RECORDER", "TRITON_DTYPES", "DirectKernel", "TunedKernel", "arg_classes", "as_rows",
           "cast_to", "cdiv", "clear_geometry_caches", "compute_dtype", "contiguous_or", "dot_precision", "elementwise_config",
           "fit_configs", "forget_tuning", "generic_key",
           "geometry_cache",
           "kernel_op", "needs_int64", "next_pow2", "num_sms", "placeholder", "reserve_sms", "remember", "row_align"]
