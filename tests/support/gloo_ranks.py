"""Runs a function on N gloo ranks, each a spawned process, for the Python tests that need torch's own FSDP2
(tests/checkpoint/python_dcp_*_test.py, tests/models/dcp_interop_test.py).

Each rank runs `body(rank, *args)`, then a barrier, then destroy_process_group, then leaves with os._exit:
its exit code says whether `body` succeeded, not how the interpreter's teardown went. A rank that leaves
while a peer is still in DCP's last collective, or an interpreter finalized while gloo's threads hold
tensors, can abort with "terminate called without an active exception" (pytorch/pytorch#190489, #179291)
after the work is done and durable.
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
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure of the rank is its exit code, with its traceback
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no destroy_process_group: the peers may be inside a collective (it would hang)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo_ranks(body: Callable[..., None], world: int, work: Path, *args: Any, timeout_s: float = 120) -> None:
    """Runs body(rank, *args) on `world` gloo ranks (a file store under `work`); fails naming each rank that
    did not exit 0. `body` must be a module-level function (spawn pickles it by name)."""
    store = work / f"gloo_store_{os.getpid()}_{id(body)}"
    store.unlink(missing_ok=True)
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
    failed = {r: p.exitcode for r, p in enumerate(ranks) if p.exitcode != 0}
    assert not failed, (f"{body.__name__} on {world} gloo ranks: rank(s) {failed} (rank: exit code) failed "
                        "(-9: killed after the timeout)")
