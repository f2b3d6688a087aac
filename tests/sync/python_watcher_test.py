"""The Python checkpoint watcher (fsdpx_sync.CheckpointWatcher) against a C++ trainer (label "sync"):
2 fsdpx ranks save every step's weights with the CheckpointCoordinator, keeping 2 steps (rotation
deletes older ones while Python may be reading them; every fourth step is saved again with the
optimizer, rewriting its commit record). Python follows the root: every version it returns is newer
than the last, equals the trainer's side file of that step bit for bit, loads into a module by name
(strict), and it reaches the last step. Then, on copies of the last committed step: a corrupted model
file, a missing one and an uncommitted step are refused with errors naming them, and so are the files a
hostile or unlucky writer leaves.

    python -m pytest python_watcher_test.py --package <python/> --program <python_peer_program>
           --mpiexec <mpiexec> --work <dir> [--mpiexec-flag=<flag> ...]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fsdpx_sync import CheckpointWatcher, SyncError
from fsdpx_sync.checkpoint import read_iteration_file, read_step
from fsdpx_sync.checksum import crc32c
from fsdpx_sync.wire import COMMIT_RECORD, STATE_DICT_ITERATION_FILE
from peer_support import Peer, build_module

STEPS = 24
StateDict = dict[str, Any]


@pytest.fixture(scope="module")
def followed(peer: Peer) -> tuple[str, list[int]]:
    """The trainer saves STEPS steps while the watcher follows its root: (the root, the steps returned).
    Each step returned is newer than the last, bit-exact against the trainer's side file, and loads into a
    module by name."""
    root = os.path.join(peer.work, "ckpt")
    trainer = subprocess.Popen(peer.command(STEPS, "--checkpoints"))
    watcher = CheckpointWatcher(root, poll_interval=0.01)
    seen: list[int] = []
    module = None
    try:
        have = -1
        while have < STEPS:
            if trainer.poll() not in (None, 0):
                raise RuntimeError(f"the trainer exited with {trainer.returncode}")
            w = watcher.wait_newer(have, timeout=120)
            assert w.version > have, (w.version, have)
            side = load_file(os.path.join(peer.work, f"side_{w.version}.safetensors"))
            got = w.named()
            assert sorted(got) == sorted(side), (sorted(got), sorted(side))
            for name, t in side.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"step {w.version}: {name} differs"
            if module is None:
                module = build_module(side, fill=0.0)
            w.load_into(module)
            assert all(torch.equal(t, side[n]) for n, t in module.state_dict().items())
            seen.append(w.version)
            have = w.version
        assert trainer.wait(timeout=120) == 0, "the trainer failed"
    except BaseException:
        trainer.kill()
        raise
    return root, seen


def test_follows_the_trainer(followed: tuple[str, list[int]]) -> None:
    _, seen = followed
    assert len(seen) >= 2 and seen[-1] == STEPS, seen
    print(f"python watcher: {len(seen)} of {STEPS} committed steps read while the trainer saved and rotated "
          f"({seen[:6]}{' ...' if len(seen) > 6 else ''}), each bit-exact")


@pytest.fixture
def fresh(followed: tuple[str, list[int]], peer: Peer, request: pytest.FixtureRequest) -> tuple[str, str]:
    """A copy of the last committed step in a root of its own (<work>/bad/<test>): (the root, the step's
    actor folder)."""
    root = os.path.join(peer.work, "bad", re.sub(r"\W+", "_", request.node.name))
    shutil.rmtree(root, ignore_errors=True)
    step = os.path.join(root, f"global_step_{STEPS}")
    shutil.copytree(os.path.join(followed[0], f"global_step_{STEPS}"), step, ignore=shutil.ignore_patterns(".leases"))
    return root, os.path.join(step, "actor")


def test_load_newer_into(fresh: tuple[str, str], peer: Peer) -> None:
    """The verb every receiver shares: the newest step into a module, then verify() against what was read."""
    root, _ = fresh
    Path(root, STATE_DICT_ITERATION_FILE).write_text(f"{STEPS}\n")
    side = load_file(os.path.join(peer.work, f"side_{STEPS}.safetensors"))
    module = build_module(side, fill=0.0)
    watcher = CheckpointWatcher(root)
    with pytest.raises(SyncError, match="no step was loaded"):
        watcher.verify(module)
    assert watcher.load_newer_into(module, timeout=10) == STEPS
    assert watcher.last_version() == STEPS and not watcher.last_was_delta()
    assert all(torch.equal(t, side[n]) for n, t in module.state_dict().items())
    assert watcher.verify(module)
    with torch.no_grad():
        next(iter(module.parameters())).view(-1)[0] += 1
    with pytest.raises(SyncError, match="differ"):
        watcher.verify(module)
    refused(lambda: watcher.load_newer_into(module, timeout=0.2), f"no committed step newer than {STEPS}")


def refused(fn: Callable[[], object], fragment: str) -> None:
    """fn() raises a SyncError naming `fragment`, at once (no hang)."""
    start = time.monotonic()
    with pytest.raises(SyncError) as error:
        fn()
    assert fragment in str(error.value), (fragment, str(error.value))
    assert time.monotonic() - start < 10, "refused, but slowly"


def test_corrupt_missing_uncommitted(fresh: tuple[str, str]) -> None:
    """A corrupted model file, then a missing one, then an uncommitted step: each refused, naming the cause."""
    root, actor = fresh
    victim = os.path.join(actor, "model_world_size_2_rank_1.pt")
    data = bytearray(Path(victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(victim).write_bytes(bytes(data))
    refused(lambda: read_step(root, STEPS), f"'{victim}' does not match the CRC-32C")
    os.remove(victim)
    refused(lambda: read_step(root, STEPS), f"'{victim}' is missing")
    os.remove(os.path.join(actor, COMMIT_RECORD))
    refused(lambda: read_step(root, STEPS), f"step {STEPS} of '{root}' is not committed")
    Path(root, STATE_DICT_ITERATION_FILE).write_text(f"{STEPS}\n")
    refused(lambda: CheckpointWatcher(root).wait_newer(-1, timeout=0.3), "not (or no longer) committed")


def test_fifos(fresh: tuple[str, str]) -> None:
    """A FIFO as the iteration file or the commit record: refused at once, never opened for a blocking read."""
    root, actor = fresh
    os.mkfifo(os.path.join(root, STATE_DICT_ITERATION_FILE))
    refused(lambda: read_iteration_file(root), "is not a regular file")
    refused(lambda: CheckpointWatcher(root).poll(), "is not a regular file")
    os.remove(os.path.join(actor, COMMIT_RECORD))
    os.mkfifo(os.path.join(actor, COMMIT_RECORD))
    refused(lambda: read_step(root, STEPS), "is not a regular file")


def test_huge_commit_record(fresh: tuple[str, str]) -> None:
    """A 2 GiB commit record (NUL-padded, sparse): refused by its size, not read."""
    root, actor = fresh
    os.truncate(os.path.join(actor, COMMIT_RECORD), 2 << 30)
    refused(lambda: read_step(root, STEPS), "has 2147483648 bytes; it may have at most 16777216")


def overlap(sd0: StateDict, sd1: StateDict) -> None:  # rank 1 also holds rank 0's first slice of a tensor
    name = next(k for k, e in sd0["entries"].items() if e["end"] > e["begin"])
    sd1["entries"][name] = sd0["entries"][name]


def malformed(sd0: StateDict, sd1: StateDict) -> None:
    name = next(iter(sd1["entries"]))
    del sd1["entries"][name]["data"]


def huge(sd0: StateDict, sd1: StateDict) -> None:  # a tensor of 2^40 elements that no file holds: never allocated
    sd1["entries"]["crafted.weight"] = {"shape": [1 << 20, 1 << 20], "begin": 0, "end": 0, "data": torch.zeros(0)}


@pytest.mark.parametrize(("edit", "fragment"), [
    (overlap, "some of which another rank's file holds too"),
    (malformed, "is malformed"),
    (huge, "elements [0, 1099511627776) of 'crafted.weight' are in no rank's file"),
], ids=["overlapping slices", "a malformed slice", "a slice of a tensor no file holds"])
def test_crafted_rank_file(fresh: tuple[str, str], edit: Callable[[StateDict, StateDict], None],
                           fragment: str) -> None:
    """Rank 1's file rewritten by `edit(state dict of rank 0, state dict of rank 1)`, with a commit record
    that matches it: refused, naming the cause, without allocating what the files claim."""
    root, actor = fresh
    files = [os.path.join(actor, f"model_world_size_2_rank_{r}.pt") for r in range(2)]
    sds = [torch.load(f, weights_only=True) for f in files]
    edit(sds[0], sds[1])
    torch.save(sds[1], files[1])
    record_path = Path(actor, COMMIT_RECORD)
    record = json.loads(record_path.read_text())
    data = Path(files[1]).read_bytes()
    record["files"][os.path.basename(files[1])] = {"bytes": len(data), "crc32c": crc32c(data)}
    record_path.write_text(json.dumps(record))
    refused(lambda: read_step(root, STEPS), fragment)
