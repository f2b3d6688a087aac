"""Runs a function on N gloo ranks, each a spawned process, for the Python tests that need torch's own FSDP2
(tests/checkpoint/python_dcp_*_test.py, tests/models/dcp_interop_test.py).

Each rank runs `body(rank, *args)`, then a barrier, then says it is done (a file), then destroy_process_group,
then leaves with os._exit. A rank failed when it did not say it was done: its exit code is printed. A rank that
did its work and then died in torch's teardown (gloo's threads can abort the process, "terminate called
without an active exception", once a peer has left: pytorch/pytorch#190489, #179291) is reported as such, not
as a failure of the work, whose results the calling test checks.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist


def _rank_main(body: Callable[..., None], rank: int, world: int, store: str, args: tuple[Any, ...]) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        body(rank, *args)
        dist.barrier()
        Path(f"{store}.done.{rank}").touch()
    except BaseException:  # noqa: BLE001 - any failure of the rank is its exit code, with its traceback
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no destroy_process_group: the peers may be inside a collective (it would hang)
    sys.stdout.flush()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo_ranks(body: Callable[..., None], world: int, work: Path, *args: Any, timeout_s: float = 120) -> None:
    """Runs body(rank, *args) on `world` gloo ranks (a file store under `work`); fails naming each rank that did
    not finish its work. `body` must be a module-level function (spawn pickles it by name)."""
    store = work / f"gloo_store_{os.getpid()}_{id(body)}"
    for stale in [store, *work.glob(f"{store.name}.done.*")]:
        stale.unlink(missing_ok=True)
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_rank_main, args=(body, r, world, str(store), args)) for r in range(world)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in ranks:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    done = {r for r in range(world) if Path(f"{store}.done.{r}").exists()}
    failed = {r: p.exitcode for r, p in enumerate(ranks) if r not in done}
    assert not failed, (f"{body.__name__} on {world} gloo ranks: rank(s) {failed} (rank: exit code) did not finish "
                        "(-9: killed after the timeout)")
    for r, p in enumerate(ranks):
        if p.exitcode != 0:
            print(f"gloo_ranks: rank {r} of {body.__name__} finished its work, then exited {p.exitcode} in torch's "
                  "process-group teardown", flush=True)
