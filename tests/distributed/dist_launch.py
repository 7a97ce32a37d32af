"""Runs a test body on N ranks: N spawned CPU processes on gloo (CI), N spawned GPU processes on
NCCL, or, under ``torchrun``, the processes torchrun started.

``run_ranks(body, world, backend, *args)`` calls ``body(rank, world, device, *args)`` on every rank
with ``torch.distributed`` initialized (``device``: ``cpu`` for gloo, ``cuda:<local rank>`` for
NCCL). ``body`` must be a module-level function (spawned processes import it).

* gloo: a pool of ``world`` CPU processes per world size, started on first use and kept for the
  session (each start costs seconds: torch and fusible_ops are imported per process), with one
  process group; every body runs on it in turn, as under torchrun (so a body must not leave state
  that changes another's result). An exception on any rank fails the test with that rank's
  traceback and ends the pool (the next test starts a fresh one); a run longer than ``timeout``
  seconds does the same.
* NCCL: spawned per test, on a free localhost port; an exception on any rank fails the test with
  that rank's traceback (``torch.multiprocessing`` ends the other ranks); a run longer than
  ``timeout`` seconds kills every rank and fails.
* Collectives time out after ``COLLECTIVE_TIMEOUT_S``, so a rank left waiting by a dead peer
  raises instead of hanging.
* Under ``torchrun --nproc-per-node N -m pytest tests/distributed -m gpu``: each process runs the
  body itself (bodies for another world size are skipped); the backend is NCCL when this process
  has a GPU.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import queue
import socket
import time
import traceback
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
RUN_TIMEOUT_S = 120

BACKENDS = [pytest.param("gloo", id="gloo"), pytest.param("nccl", id="nccl", marks=pytest.mark.gpu)]
"""Parametrize a test with this: the gloo variant runs in CI, the NCCL variant on 2+ GPUs."""
WORLDS = [pytest.param("gloo", 2, id="gloo-2"), pytest.param("gloo", 4, id="gloo-4"),
          pytest.param("nccl", 2, id="nccl-2", marks=pytest.mark.gpu), pytest.param("nccl", 4, id="nccl-4", marks=pytest.mark.gpu)]
"""Parametrize ``backend, world`` with this: gloo at 2 and 4 ranks in CI, NCCL at 2 and 4 on GPUs."""


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _entry(rank: int, world: int, backend: str, port: int, body, args: tuple) -> None:
    device = _device(backend, rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        body(rank, world, device, *args)
        dist.barrier()
    finally:
        # release what the body built first: FSDP2 state outliving destroy_process_group aborts gloo
        # processes at exit now and then ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


def _pool_worker(rank: int, world: int, port: int, tasks, results) -> None:
    """A gloo pool process: one process group for the pool's life; runs the bodies it is sent.
    One CPU thread: the pool's ranks share the machine's few cores (more would spin against each
    other)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    device = torch.device("cpu")
    while True:
        job = tasks.get()
        if job is None:
            break
        body, args = job
        try:
            body(rank, world, device, *args)
            dist.barrier()
            results.put((rank, None))
        except BaseException:
            results.put((rank, traceback.format_exc()))
            raise
        finally:
            gc.collect()


class _GlooPool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, body, args: tuple, timeout: float) -> Optional[str]:
        """None when every rank finished ``body``; else why not (the pool is then ended)."""
        for q in self.tasks:
            q.put((body, args))
        deadline, done = time.monotonic() + timeout, 0
        while done < self.world:
            try:
                rank, err = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.end()
                    return (f"rank(s) {dead} of the gloo pool died" if dead else
                            f"did not finish within {timeout:.0f} s")
                continue
            if err is not None:
                self.end()
                return f"rank {rank} raised:\n{err}"
            done += 1
        return None

    def end(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        _POOLS.pop(self.world, None)


_POOLS: dict = {}


def run_ranks(body, world: int, backend: str, *args, timeout: float = RUN_TIMEOUT_S) -> None:
    """Run ``body(rank, world, device, *args)`` on ``world`` ranks with ``backend`` (see the module doc)."""
    if under_torchrun():
        return _run_in_torchrun(body, world, backend, args)
    if backend == "gloo":
        pool = _POOLS.get(world) or _POOLS.setdefault(world, _GlooPool(world))
        why = pool.run(body, args, timeout)
        if why is not None:
            pytest.fail(f"{body.__name__} on {world} ranks (gloo): {why}", pytrace=False)
        return
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs for NCCL, found {torch.cuda.device_count()}")
    ctx = mp.start_processes(_entry, args=(world, backend, _free_port(), body, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{body.__name__} on {world} ranks ({backend}) did not finish within {timeout:.0f} s")


_TORCHRUN_GROUP = []


def _run_in_torchrun(body, world: int, backend: str, args: tuple) -> None:
    if int(os.environ["WORLD_SIZE"]) != world:
        pytest.skip(f"torchrun runs {os.environ['WORLD_SIZE']} ranks; this test needs {world}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    have_gpu = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
    actual = "nccl" if have_gpu else "gloo"
    if backend != actual:
        pytest.skip(f"the {backend} variant; this torchrun process uses {actual}")
    if not _TORCHRUN_GROUP:
        dist.init_process_group(actual, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        _TORCHRUN_GROUP.append(actual)
        atexit.register(lambda: (gc.collect(), dist.destroy_process_group()))
    body(dist.get_rank(), world, _device(actual, local_rank), *args)
    dist.barrier()
    gc.collect()
