"""fsdpx reads and writes PyTorch Distributed Checkpoint's .metadata (CTest: checkpoint_dcp_metadata_python).

Real DCP checkpoints, saved here by torch (one process with no_dist; two gloo ranks under FSDP2, whose
tensors are saved in a chunk per rank): what fsdpx reads of each .metadata (fsdpx_dcp_metadata_tool dump)
is what torch's FileSystemReader reads, field by field; the .metadata fsdpx writes from that
(fsdpx_dcp_metadata_tool write) unpickles to a Metadata equal to torch's own, also through torch's
restricted unpickler, and dcp.load reads the checkpoint with it to the same tensors and values. And
.metadata files that name other classes or say impossible things are refused, naming the cause.

    python -m pytest python_dcp_metadata_test.py --tool <fsdpx_dcp_metadata_tool> [--work <dir>]
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import run_gloo_ranks
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

# no_dist saves and loads warn that torch.distributed is not initialized: intended here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
StateDict = dict[str, Any]
MEMORY_FORMATS = {torch.contiguous_format: 0, torch.channels_last: 1, torch.preserve_format: 2}


def run_tool(tool: str, *args: object, expect_rc: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == expect_rc, f"{tool} {args}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    return done


def expected_json(md: Metadata, load_id: str | None) -> dict[str, Any]:
    """What fsdpx_dcp_metadata_tool dump should print for `md`, in its JSON (dcp_metadata_tool.cpp)."""
    entries: dict[str, Any] = {}
    for fqn, e in md.state_dict_metadata.items():
        if isinstance(e, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
            continue
        p = e.properties
        assert p.layout == torch.strided
        entries[fqn] = {"type": "tensor", "dtype": str(p.dtype).removeprefix("torch."), "size": list(e.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in e.chunks],
                        "requires_grad": p.requires_grad, "pin_memory": p.pin_memory,
                        "memory_format": MEMORY_FORMATS[p.memory_format]}
    storage = [{"fqn": k.fqn, "offsets": None if k.offset is None else list(k.offset), "index": k.index,
                "relative_path": v.relative_path, "offset": v.offset, "length": v.length,
                "transform_descriptors": None if v.transform_descriptors is None else list(v.transform_descriptors)}
               for k, v in md.storage_data.items()]
    meta = md.storage_meta
    assert meta is not None
    return {"entries": entries, "storage": sorted(storage, key=storage_key),
            "planner_data": {k: list(v) for k, v in md.planner_data.items()},
            "storage_meta": {"checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                             "checkpoint_id_is_path": isinstance(meta.checkpoint_id, os.PathLike),
                             "save_id": meta.save_id, "load_id": load_id, "modules": list(meta.modules)},
            "version": md.version}


def storage_key(record: dict[str, Any]) -> tuple[str, list[int]]:
    return record["fqn"], record["offsets"] or []


def check_round_trip(tool: str, ckpt: Path, copy: Path) -> None:
    """fsdpx reads ckpt/.metadata as torch does, writes it again into `copy` (with ckpt's data files), and
    the file it writes unpickles (also restricted) to a Metadata equal to torch's."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    with open(ckpt / ".metadata", "rb") as f:
        original = pickle.load(f)
    assert isinstance(original, Metadata)
    load_id = original.storage_meta.load_id if original.storage_meta is not None else None
    dumped = json.loads(run_tool(tool, "dump", ckpt / ".metadata").stdout)
    dumped["storage"] = sorted(dumped["storage"], key=storage_key)
    assert dumped == expected_json(md, load_id)

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ckpt, copy, ignore=shutil.ignore_patterns(".metadata"))
    (copy / "dumped.json").write_text(json.dumps(dumped))
    run_tool(tool, "write", copy / "dumped.json", copy / ".metadata")
    written = (copy / ".metadata").read_bytes()
    assert pickle.loads(written) == original
    assert restricted_load(written) == original
    # and fsdpx reads what it wrote as it read torch's
    again = json.loads(run_tool(tool, "dump", copy / ".metadata").stdout)
    again["storage"] = sorted(again["storage"], key=storage_key)
    assert again == dumped


def restricted_load(data: bytes) -> Any:
    """torch's weights_only unpickler, admitting DCP's classes: it reads no FRAME opcode, which Python's
    pickler writes and fsdpx does not."""
    from torch import _weights_only_unpickler
    from torch.distributed.checkpoint import metadata

    classes: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex,
        StorageMeta, metadata._MEM_FORMAT_ENCODING, _StorageInfo, type(Path())]
    with torch.serialization.safe_globals(classes):
        return _weights_only_unpickler.load(io.BytesIO(data), encoding="utf-8")


def equal_state(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(equal_state(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(equal_state(g, w) for g, w in zip(got, want))
    return bool(got == want)


def blank(state: Any) -> Any:
    """`state` with zeroed tensors and other values replaced, for dcp.load to fill in."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    return None if not isinstance(state, (int, float, str, bool)) else type(state)()


def test_single_process_checkpoint(tool: str, work: Path) -> None:
    """A model, its AdamW state (a tensor step, param_groups as bytes entries) and extra values, bf16 too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    state: StateDict = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim),
                        "extra": {"values": [1, 2.5, "x"], "bf16": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
                                  "step": torch.tensor(7)}}
    save(state, checkpoint_id=work / "single", no_dist=True)
    check_round_trip(tool, work / "single", work / "single_fsdpx")

    loaded = blank(state)
    load(loaded, checkpoint_id=work / "single_fsdpx", no_dist=True)
    assert equal_state(loaded["model"], state["model"])
    assert equal_state(loaded["extra"], state["extra"])
    assert equal_state(loaded["optim"]["state"], state["optim"]["state"])
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-3


def fsdp_rank(rank: int, path: str) -> None:
    """One of 2 gloo ranks: an FSDP2 model and its Adam state saved with DCP, each tensor in 2 chunks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path)


def full_tensors(ckpt: Path) -> StateDict:
    """The FSDP checkpoint's weights and Adam moments loaded whole, in one process."""
    shapes = {"0.weight": (3, 5), "0.bias": (3,), "1.weight": (2, 3), "1.bias": (2,)}
    state: StateDict = {"model": {k: torch.zeros(s) for k, s in shapes.items()},
                        "optim": {"state": {k: {"exp_avg": torch.zeros(s), "exp_avg_sq": torch.zeros(s),
                                                "step": torch.zeros(())} for k, s in shapes.items()}}}
    load(state, checkpoint_id=ckpt, no_dist=True)
    return state


def test_two_rank_fsdp_checkpoint(tool: str, work: Path) -> None:
    ckpt = work / "fsdp"
    run_gloo_ranks(fsdp_rank, 2, work, str(ckpt))
    md = FileSystemReader(str(ckpt)).read_metadata()
    weight = md.state_dict_metadata["model.0.weight"]
    assert isinstance(weight, TensorStorageMetadata) and len(weight.chunks) == 2
    assert {s.relative_path for s in md.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
    check_round_trip(tool, ckpt, work / "fsdp_fsdpx")

    want, got = full_tensors(ckpt), full_tensors(work / "fsdp_fsdpx")
    assert equal_state(got, want)
    assert float(want["model"]["0.weight"].abs().sum()) > 0  # loaded, not the zeros it started from


class Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, ("echo fsdpx ran it",)


def test_refused(tool: str, work: Path) -> None:
    """Files a careless or hostile writer leaves: each refused with an error naming the cause."""
    ok = work / "refused_base"
    save({"w": torch.ones(4, 2)}, checkpoint_id=ok, no_dist=True)
    with open(ok / ".metadata", "rb") as f:
        base: Metadata = pickle.load(f)

    def refused(name: str, value: object, *expected: str) -> None:
        path = work / f"refused_{name}.metadata"
        path.write_bytes(pickle.dumps(value, protocol=4))
        message = run_tool(tool, "dump", path, expect_rc=1).stderr
        for text in expected:
            assert text in message, f"{name}: {message!r} lacks {text!r}"

    refused("os_system", Evil(), "'posix.system'", "may not name")
    evil = Metadata(state_dict_metadata={"w": Evil()})  # type: ignore[dict-item]
    refused("os_system_inside", evil, "'posix.system'")

    chunk = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([3, 2]))
    tensor = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4, 2]), [chunk])
    outside = Metadata(state_dict_metadata={"w": tensor}, storage_data=base.storage_data)
    refused("chunk_outside", outside, "entry 'w'", "not within it")

    escape = {k: _StorageInfo("../../etc/passwd", v.offset, v.length) for k, v in base.storage_data.items()}
    refused("path_escape", Metadata(base.state_dict_metadata, storage_data=escape), "../../etc/passwd")

    quantized = Metadata({"w": TensorStorageMetadata(TensorProperties(torch.qint8), torch.Size([4, 2]),
                                                     base.state_dict_metadata["w"].chunks)},  # type: ignore[union-attr]
                         storage_data=base.storage_data)
    refused("qint8", quantized, "torch.qint8")

    missing = Metadata(base.state_dict_metadata, storage_data={})
    refused("no_storage", missing, "entry 'w' has no storage record")

    truncated = work / "refused_truncated.metadata"
    truncated.write_bytes((ok / ".metadata").read_bytes()[:-7])
    assert "truncated" in run_tool(tool, "dump", truncated, expect_rc=1).stderr
