"""Following an fsdpx checkpoint root from Python: the newest committed weights, merged into whole
tensors, every file checked against the commit record. No connection to the trainer: the file system.

    from fsdpx_sync import CheckpointWatcher
    watcher = CheckpointWatcher("/ckpt")
    weights = watcher.wait_newer(have=-1, timeout=600)   # a WeightVersion: (name, tensor) pairs, .step
    weights.load_into(hf_model)                          # or vLLM's load_weights(iter(weights))

The reading protocol is fsdpx's C++ CheckpointWatcher's (fsdpx/sync/watcher.hpp; the format is
docs/checkpoint.md), for every attempt:
  1. read latest_state_dict_iteration.txt (the trainer advances it only once a step's weights are
     committed); a step not newer than the last one returned is ignored;
  2. lease the step (<root>/global_step_<N>/.leases/<host>-<pid>-<n>: "<host> <pid>"), so that the
     trainer's rotation does not delete it mid-read; a step already gone cannot be leased;
  3. read its commit record (actor/fsdp_config.json): it must commit the model;
  4. read every rank's model file, check its size and CRC-32C against the record on the bytes read,
     load them with torch.load(weights_only=True), and merge the slices into whole tensors, checking
     that every element of every tensor is covered.
When 2-4 fail (a file replaced or rotated away meanwhile) and the iteration file has moved on, the
newer step is tried at once; otherwise the attempt returns nothing and wait_newer keeps waiting (the
failure is in its timeout error).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import socket
import stat
import time
from typing import Any

import torch

from .checksum import crc32c
from .client import WeightVersion
from .errors import SyncError
from .wire import (
    CHECKPOINT_FORMAT_VERSION as FORMAT_VERSION,
    COMMIT_RECORD,
    MAX_RECORD_FILE_BYTES,
    MAX_WORLD_SIZE,
    STATE_DICT_ITERATION_FILE,
)

_lease_counter = itertools.count()


def _read_regular_file(path: str, what: str, max_bytes: int) -> bytes:
    """The whole file, if it is a regular file of at most `max_bytes`: opened without blocking (a FIFO
    would hang open() or read()), its size checked before it is read. FileNotFoundError passes through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # a directory, no permission, a dangling link loop: named, as fsdpx's own error
        raise SyncError(f"fsdpx: {what} '{path}' cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SyncError(f"fsdpx: {what} '{path}' is not a regular file")
        if st.st_size > max_bytes:
            raise SyncError(f"fsdpx: {what} '{path}' has {st.st_size} bytes; it may have at most {max_bytes}")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}", "actor")


def read_iteration_file(root: str) -> int | None:
    path = os.path.join(root, STATE_DICT_ITERATION_FILE)
    try:
        text = _read_regular_file(path, "iteration file", MAX_RECORD_FILE_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    try:
        step = int(text.strip())
    except ValueError:
        raise SyncError(f"fsdpx: iteration file '{path}' does not hold a step number: {text[:40]!r}") from None
    if step < 0:
        raise SyncError(f"fsdpx: iteration file '{path}' holds a negative step: {step}")
    return step


def read_commit_record(directory: str) -> dict[str, Any] | None:
    """The step's commit record, checked; None when the step is not committed."""
    path = os.path.join(directory, COMMIT_RECORD)
    try:
        record = json.loads(_read_regular_file(path, "commit record", MAX_RECORD_FILE_BYTES))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as e:
        raise SyncError(f"fsdpx: commit record '{path}' is not valid JSON: {e}") from None
    if not isinstance(record, dict) or record.get("format") != "fsdpx":
        raise SyncError(f"fsdpx: '{path}' is not an fsdpx commit record (no \"format\": \"fsdpx\")")
    version = record.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise SyncError(f"fsdpx: commit record '{path}': format version {version}; this reader knows up to "
                        f"{FORMAT_VERSION}")
    world = record.get("world_size")
    if not isinstance(world, int) or not 0 < world <= MAX_WORLD_SIZE:
        raise SyncError(f"fsdpx: commit record '{path}': world_size is {world!r}")
    if not isinstance(record.get("files", {}), dict):
        raise SyncError(f"fsdpx: commit record '{path}': \"files\" is not an object")
    components = record.get("components", [])
    if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
        raise SyncError(f"fsdpx: commit record '{path}': \"components\" is not a list of names")
    return record


class Lease:
    """Pins a committed step against the trainer's rotation while it is read (fsdpx's CheckpointLease)."""

    def __init__(self, root: str, step: int) -> None:
        if read_commit_record(step_dir(root, step)) is None:
            raise SyncError(f"fsdpx: cannot lease step {step}: it is not (or no longer) committed")
        host = socket.gethostname()
        leases = os.path.join(root, f"global_step_{step}", ".leases")
        self.path = os.path.join(leases, f"{host}-{os.getpid()}-py{next(_lease_counter)}")
        tmp = self.path + ".tmp"
        try:
            os.makedirs(leases, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)  # whatever is there (a crash's leftover, a FIFO) is replaced, never written through
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, f"{host} {os.getpid()}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as e:
            raise SyncError(f"fsdpx: cannot lease step {step}: writing '{self.path}' failed: {e}") from None
        if read_commit_record(step_dir(root, step)) is None:  # rotated away between the choice and the lease
            self.release()
            raise SyncError(f"fsdpx: cannot lease step {step}: it is not (or no longer) committed")

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _load_rank_file(path: str, info: object, rank: int, world: int) -> dict[str, Any]:
    """Rank `rank`'s model file, checked against its commit record's entry `info` on the bytes read."""
    if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or not isinstance(info.get("crc32c"), int):
        raise SyncError(f"fsdpx: '{path}' is not listed with its size and CRC-32C in {COMMIT_RECORD}")
    try:
        data = _read_regular_file(path, "checkpoint file", info["bytes"])
    except FileNotFoundError:
        raise SyncError(f"fsdpx: '{path}' is missing (rotated away while it was read?)") from None
    if len(data) != info["bytes"]:
        raise SyncError(f"fsdpx: '{path}' has {len(data)} bytes, its commit record says {info['bytes']}")
    if crc32c(data) != info["crc32c"]:
        raise SyncError(f"fsdpx: '{path}' does not match the CRC-32C of its commit record: corrupt or replaced")
    try:
        sd = torch.load(io.BytesIO(data), weights_only=True)  # checked bytes, never the file again
    except Exception as e:  # a crafted file whose record matches it: the unpickler's own error, named
        raise SyncError(f"fsdpx: '{path}' is not a readable torch.save file: {e}") from None
    if (not isinstance(sd, dict) or sd.get("component") != "model" or sd.get("world_size") != world
            or sd.get("rank") != rank):
        raise SyncError(f"fsdpx: '{path}' does not hold rank {rank}'s model state dict of world size {world}")
    if not isinstance(sd.get("entries", {}), dict):
        raise SyncError(f"fsdpx: '{path}': \"entries\" is not a dict")
    return sd


def read_step(root: str, step: int, dtype: torch.dtype | None = None) -> WeightVersion:
    """The committed weights of `step`, merged (the caller holds a Lease); SyncError naming what is wrong.
    Every element of every tensor must be in exactly one rank's file; nothing is allocated beyond what
    the files hold."""
    directory = step_dir(root, step)
    record = read_commit_record(directory)
    if record is None:
        raise SyncError(f"fsdpx: step {step} of '{root}' is not committed")
    if "model" not in record.get("components", []):
        raise SyncError(f"fsdpx: step {step}: its commit record does not commit the model")
    if record.get("state_dict_kind") == "local":
        raise SyncError(f"fsdpx: step {step} holds \"local\" state dicts, which only the model that saved them can "
                        "read")
    world = record["world_size"]
    files = record.get("files", {})
    # name -> (shape, dtype, [(begin, end, flat slice, path)]): the slices first, the whole tensors after
    # their coverage is checked, so a crafted shape cannot make this allocate what no file holds.
    pieces: dict[str, tuple[list[int], torch.dtype, list[tuple[int, int, torch.Tensor, str]]]] = {}
    for rank in range(world):
        name = f"model_world_size_{world}_rank_{rank}.pt"
        path = os.path.join(directory, name)
        sd = _load_rank_file(path, files.get(name), rank, world)
        for tname, e in sd.get("entries", {}).items():
            try:
                if not isinstance(e, dict):
                    raise TypeError(f"{type(e).__name__}, not a dict")
                shape, begin, end, t = [int(d) for d in e["shape"]], int(e["begin"]), int(e["end"]), e["data"]
                if not isinstance(t, torch.Tensor) or any(d < 0 for d in shape):
                    raise TypeError("not a tensor slice")
            except (KeyError, TypeError, ValueError) as err:
                raise SyncError(f"fsdpx: '{path}': entry '{tname}' is malformed ({err})") from None
            numel = 1
            for d in shape:
                numel *= d
            if not 0 <= begin <= end <= numel or t.numel() != end - begin:
                raise SyncError(f"fsdpx: '{path}': entry '{tname}' holds {t.numel()} elements for [{begin}, {end}) "
                                f"of {numel}")
            known = pieces.setdefault(tname, (shape, t.dtype, []))
            if known[0] != shape or known[1] != t.dtype:
                raise SyncError(f"fsdpx: '{path}': '{tname}' is {t.dtype} {shape} here, {known[1]} {known[0]} in a "
                                "lower rank's file")
            known[2].append((begin, end, t.reshape(-1), path))
    tensors = []
    for tname in sorted(pieces):  # name order, as fsdpx's merge
        shape, tdtype, slices = pieces[tname]
        numel = 1
        for d in shape:
            numel *= d
        covered = 0
        for begin, end, _, path in sorted(slices, key=lambda p: (p[0], p[1])):
            if begin == end:
                continue  # a rank that holds none of this tensor
            if begin < covered:
                raise SyncError(f"fsdpx: step {step}: '{path}' holds elements [{begin}, {end}) of '{tname}', "
                                f"some of which another rank's file holds too")
            if begin > covered:
                break
            covered = end
        if covered < numel:
            raise SyncError(f"fsdpx: step {step}: elements [{covered}, {numel}) of '{tname}' are in no rank's file")
        flat = torch.empty(numel, dtype=tdtype)
        for begin, end, data, _ in slices:
            flat[begin:end] = data
        t = flat.view(shape)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors.append((tname, t))
    return WeightVersion(version=step, tensors=tensors)


class CheckpointWatcher:
    """Follows a checkpoint root: poll() returns the newest committed weights when they are newer than
    the last returned (else None, at once); wait_newer(have) blocks until a step newer than `have`."""

    def __init__(self, root: str, *, poll_interval: float = 0.2, timeout: float = 300.0,
                 dtype: torch.dtype | None = None):
        self.root = root
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.dtype = dtype
        self.last = -1
        self.last_failure: str | None = None
        self._loaded: WeightVersion | None = None  # the step load_newer_into loaded last

    def poll(self) -> WeightVersion | None:
        tried = set()
        while True:
            step = read_iteration_file(self.root)
            if step is None or step <= self.last or step in tried:
                return None
            tried.add(step)
            try:
                with Lease(self.root, step):
                    weights = read_step(self.root, step, self.dtype)
            except SyncError as e:
                self.last_failure = f"step {step}: {e}"
                continue  # the iteration file may have moved on: try the newer step at once
            self.last = step
            return weights

    def load_newer_into(self, module: torch.nn.Module, timeout: float | None = None) -> int:
        """The newest committed step newer than the one returned last, loaded into ``module`` by name
        (``WeightVersion.load_into``, strict: checked before anything is copied), waiting up to
        ``timeout``; returns the step. The verb every receiver shares (C++: sync::Receiver;
        SyncClient.load_newer_into)."""
        weights = self.wait_newer(self.last, timeout)
        weights.load_into(module)
        self._loaded = weights
        return weights.version

    def last_version(self) -> int:
        """The step returned last (-1 before the first)."""
        return self.last

    def last_was_delta(self) -> bool:
        """A checkpoint is read whole: never a delta."""
        return False

    def verify(self, module: torch.nn.Module) -> bool:
        """True when ``module`` holds the step load_newer_into loaded last, exactly (each tensor's CRC-32C
        as read); otherwise a SyncError naming the tensors that differ."""
        if self._loaded is None:
            raise SyncError("fsdpx: CheckpointWatcher.verify: no step was loaded into a module yet (load_newer_into)")
        return self._loaded.verify(module)

    def wait_newer(self, have: int = -1, timeout: float | None = None) -> WeightVersion:
        self.last = max(self.last, have)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            weights = self.poll()
            if weights is not None:
                return weights
            if time.monotonic() > deadline:
                why = f"; the last attempt failed: {self.last_failure}" if self.last_failure else ""
                raise SyncError(f"fsdpx: no committed step newer than {self.last} appeared in '{self.root}' "
                                f"within {self.timeout if timeout is None else timeout} s{why}")
            time.sleep(self.poll_interval)
