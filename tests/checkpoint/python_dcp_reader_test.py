"""fsdpx loads PyTorch Distributed Checkpoints that torch saved (CTest: checkpoint_dcp_reader_python).

torch saves the checkpoint tests' ResMlp (tests/core/models.hpp, mirrored here): from one process
(dcp.save(model.state_dict(), no_dist=True)), nested under "model" beside plain values, and from 3 gloo
ranks under FSDP2, whose tensors are saved in a chunk per rank. fsdpx_dcp_load_program loads each into an
Fsdp model at 2 and 4 ranks, each rank reading the chunks over its own shards only, and its full state dict
must equal, bit for bit, what Python saved beside it (a torch.save'd dict). Then crafted checkpoints: a range
past its data file's end, a data file name with a '/', a chunk of the wrong dtype or shape, a missing chunk,
a transformed (compressed) record, a bytes entry that names a class; each refused, naming the cause.

    python -m pytest python_dcp_reader_test.py --tool <fsdpx_dcp_load_program> --mpiexec 'mpiexec [flags]'
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import run_gloo_ranks
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class ResBlock(nn.Module):
    """tests/core/models.hpp's ResBlockImpl: the same parameters, by the same names."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.a = nn.Linear(dim, 2 * dim)
        self.b = nn.Linear(2 * dim, dim)
        self.unused = nn.LayerNorm(dim)


class ResMlp(nn.Module):
    """tests/core/models.hpp's ResMlpImpl (stem, r0..r2, head), the model fsdpx_dcp_load_program builds."""

    def __init__(self, inputs: int = 20, dim: int = 24, blocks: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(inputs, dim)
        for i in range(blocks):
            self.add_module(f"r{i}", ResBlock(dim))
        self.head = nn.Linear(dim, classes)


def make_model() -> ResMlp:
    """Every parameter random (LayerNorm's ones and zeros would hide a mix-up), the same in every process."""
    torch.manual_seed(0)
    model = ResMlp()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def run(tool: str, *args: object, expect_rc: int = 0, launch: list[str] | None = None) -> str:
    done = subprocess.run([*(launch or []), tool, *map(str, args)], capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == expect_rc, f"{tool} {args}: exit {done.returncode}\n{output}"
    return output


def ranks(mpiexec: list[str], np: int) -> list[str]:
    """The launcher (--mpiexec: the command and its flags) starting `np` ranks."""
    return [mpiexec[0], "-n", str(np), *mpiexec[1:]]


def load_at(tool: str, mpiexec: list[str], np: int, ckpt: Path, reference: Path, *extra: str,
            mode: str = "model") -> str:
    """fsdpx_dcp_load_program model (or resume) at `np` ranks: loaded, and equal to the reference bit for bit."""
    launch = ranks(mpiexec, np)
    output = run(tool, mode, ckpt, reference, *extra, launch=launch)
    count = len(torch.load(reference, weights_only=True))
    assert f"equal: {count} of {count} tensors bit-equal to the reference" in output, output
    assert output.count(f"of {np} read") == np, output
    return output


def test_single_process_checkpoint(tool: str, mpiexec: list[str], work: Path) -> None:
    model = make_model()
    ckpt, reference = work / "global_step7", work / "single_reference.pt"  # named as LightRFT names a step
    save(model.state_dict(), checkpoint_id=ckpt, no_dist=True)
    torch.save(dict(model.state_dict()), reference)
    load_at(tool, mpiexec, 2, ckpt, reference)
    # load_checkpoint takes the folder too (its .metadata says what it is), and its name's step
    assert "resumed step 7" in load_at(tool, mpiexec, 2, ckpt, reference, mode="resume")

    # a range read straight from the chunk: elements [30, 47) of a [24, 20] weight
    got = json.loads(run(tool, "read", ckpt, "stem.weight", 30, 47))
    assert got == model.stem.weight.detach().reshape(-1)[30:47].double().tolist()


def test_nested_checkpoint_and_plain_values(tool: str, mpiexec: list[str], work: Path) -> None:
    """dcp.save({"model": ..., "extra": ...}): the model under a prefix; plain values read as they were."""
    model = make_model()
    ckpt, reference = work / "nested", work / "nested_reference.pt"
    extra = {"lr": 0.25, "steps": 7, "name": "run1", "flags": [True, None], "betas": (0.9, 0.95),
             "groups": [{"lr": 1e-3, "weight_decay": 0.1, "params": ["stem.weight", "head.bias"]}]}
    save({"model": model.state_dict(), "extra": extra}, checkpoint_id=ckpt, no_dist=True)
    torch.save(dict(model.state_dict()), reference)
    load_at(tool, mpiexec, 2, ckpt, reference, "--prefix", "model.")

    assert json.loads(run(tool, "bytes", ckpt, "extra.lr")) == 0.25
    assert json.loads(run(tool, "bytes", ckpt, "extra.name")) == "run1"
    assert json.loads(run(tool, "bytes", ckpt, "extra.flags")) == [True, None]
    assert json.loads(run(tool, "bytes", ckpt, "extra.betas")) == [0.9, 0.95]
    # DCP flattens a list of dicts (as an optimizer's param_groups) into an entry per value
    assert json.loads(run(tool, "bytes", ckpt, "extra.groups.0.params")) == ["stem.weight", "head.bias"]
    assert json.loads(run(tool, "bytes", ckpt, "extra.groups.0.lr")) == 1e-3
    # without the prefix, the model's names are not the checkpoint's
    launch = ranks(mpiexec, 1)
    message = run(tool, "model", ckpt, reference, launch=launch, expect_rc=1)
    assert "missing: " in message and "not in the model: " in message and "model.head.bias" in message, message


def fsdp_rank(rank: int, path: str, reference: str) -> None:
    """One of 3 gloo ranks: the model under FSDP2 (each block a unit, as fsdpx wraps it), saved with DCP."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for i in range(3):
        fully_shard(model.get_submodule(f"r{i}"))
    fully_shard(model)
    save(get_model_state_dict(model), checkpoint_id=path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(dict(full), reference)


def test_three_rank_fsdp2_checkpoint(tool: str, mpiexec: list[str], work: Path) -> None:
    ckpt, reference = work / "fsdp", work / "fsdp_reference.pt"
    run_gloo_ranks(fsdp_rank, 3, work, str(ckpt), str(reference))
    with open(ckpt / ".metadata", "rb") as f:
        md: Metadata = pickle.load(f)
    head = md.state_dict_metadata["head.weight"]  # [5, 24]: rows 2, 2 and 1
    assert isinstance(head, TensorStorageMetadata) and [c.sizes[0] for c in head.chunks] == [2, 2, 1]
    assert torch.equal(torch.load(reference, weights_only=True)["head.weight"], make_model().head.weight.detach())
    for np in (2, 4):
        load_at(tool, mpiexec, np, ckpt, reference)


# ---- crafted checkpoints -------------------------------------------------------------------------------


def crafted(work: Path, name: str, state: dict[str, Any]) -> tuple[Path, Metadata]:
    """A fresh no_dist checkpoint of `state`, and its metadata to change."""
    path = work / f"refused_{name}"
    shutil.rmtree(path, ignore_errors=True)
    save(state, checkpoint_id=path, no_dist=True)
    with open(path / ".metadata", "rb") as f:
        return path, pickle.load(f)


def rewrite(path: Path, md: Metadata) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def refused(tool: str, path: Path, args: list[object], *expected: str) -> None:
    message = run(tool, *args, expect_rc=1)
    for text in expected:
        assert text in message, f"{path.name}: {message!r} lacks {text!r}"


def test_refused(tool: str, work: Path) -> None:
    w = torch.arange(8, dtype=torch.float32).view(4, 2)

    path, md = crafted(work, "past_end", {"w": w})
    size = (path / "__0_0.distcp").stat().st_size
    md.storage_data = {k: dataclasses.replace(v, length=size + 1) for k, v in md.storage_data.items()}
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "entry 'w'", "__0_0.distcp", f"which has {size} bytes")

    path, md = crafted(work, "slash", {"w": w})
    md.storage_data = {k: dataclasses.replace(v, relative_path="sub/__0_0.distcp") for k, v in md.storage_data.items()}
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "'sub/__0_0.distcp'", "not a file name in the checkpoint directory")

    path, md = crafted(work, "dtype", {"w": w.double()})
    entry = md.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.properties = TensorProperties(dtype=torch.float32)
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "the chunk of 'w'", "dtype Double", "the metadata says Float")

    path, md = crafted(work, "shape", {"w": w})
    md.state_dict_metadata["w"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([2, 4]),
        [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4]))])
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "the chunk of 'w'", "sizes [4, 2]", "[2, 4]")

    # a tensor of 2 chunks (rows 0-1 and 2-3), the second one's record gone from the metadata
    path, md = crafted(work, "missing", {"w": w})
    (path / "__0_0.distcp").rename(path / "data.distcp")
    info = next(iter(md.storage_data.values()))
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 2]))]
    md.state_dict_metadata["w"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 2]),
                                                        chunks)
    md.storage_data = {MetadataIndex("w", torch.Size([0, 0])): dataclasses.replace(info, relative_path="data.distcp")}
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "entry 'w'", "a chunk is missing")

    path, md = crafted(work, "transformed", {"w": w})
    md.storage_data = {k: dataclasses.replace(v, transform_descriptors=["zstd"]) for k, v in md.storage_data.items()}
    rewrite(path, md)
    refused(tool, path, ["read", path, "w"], "entry 'w'", "transforms [zstd]", "cannot undo")

    # a bytes entry is read with no class admitted: a set pickles as a call of builtins' set
    path, md = crafted(work, "class", {"v": {1, 2}, "x": 2.5})
    refused(tool, path, ["bytes", path, "v"], "bytes entry 'v'", "set")
    assert json.loads(run(tool, "bytes", path, "x")) == 2.5

    # a chunk whose blob was cut short: the data file ends before the recorded range does
    path, md = crafted(work, "truncated", {"w": w})
    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    refused(tool, path, ["read", path, "w"], "entry 'w'", f"which has {len(data) // 2} bytes")
    assert os.path.exists(path / ".metadata")
