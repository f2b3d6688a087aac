"""fsdpx saves PyTorch Distributed Checkpoint (CTest: checkpoint_dcp_save_python).

fsdpx_checkpoint_job trains a sharded model for two steps at 2 and 3 ranks (3: shard boundaries inside
rows, so tensors are saved as several boxes, partial rows among them) and at 4 (HybridShard: the
replicas write nothing), saves it with fsdpx::dcp::save_model and its AdamW state with save_optimizer
(read back by fsdpx, equal; here in get_optimizer_state_dict's layout, with torch.optim.AdamW's keys), and
writes its full parameters with torch.save. Here torch's own dcp.load, with no process group, reads the
checkpoint into a plain state dict equal to them bit for bit, and format_utils.dcp_to_torch_save converts
it; and fsdpx reads it back at another world size (fsdpx_dcp_load_program, dcp/state_dict_loader.hpp), bit
for bit, and fsdpx-merge turns the DCP folder into model.safetensors holding them; fsdpx-inspect --verify
reads every chunk, and names the one a damaged data file spoils. A rank whose disk is full fails the save on
every rank, and no .metadata is written. And CheckpointCoordinator with CheckpointFormat::dcp saves DCP in the
background, committed as fsdpx commits, which torch reads and fsdpx resumes at another world size.

    python -m pytest python_dcp_save_test.py --job <fsdpx_checkpoint_job> --tool <fsdpx_dcp_load_program>
        --merge <fsdpx-merge> [--inspect <fsdpx-inspect>] --mpiexec "<mpiexec> [flags]"
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys, load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def run_job(mpiexec: list[str], ranks: int, job: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*mpiexec, "-n", str(ranks), job, *map(str, args)], check=False, capture_output=True,
                          text=True, timeout=240)


def test_boxes_cover_every_range(job: str) -> None:
    done = subprocess.run([job, "dcp-cover"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all exact" in done.stdout


def check_optimizer_save(root: Path, params: dict[str, torch.Tensor], done: subprocess.CompletedProcess[str],
                         mesh: list[str]) -> None:
    """The AdamW state fsdpx saved (fsdpx::dcp::save_optimizer) in the layout of get_optimizer_state_dict: per
    parameter its moments in its shape and its step count, the two param groups of make_adamw with every key
    torch.optim.AdamW holds, their params naming every parameter once. fsdpx read it back equal (checkpoint_job)."""
    assert done.stdout.count("AdamW states read back from DCP equal") >= 2, done.stdout
    assert "swapped param groups refused" in done.stdout, done.stdout
    files = {p.name for p in root.iterdir()}
    assert ".metadata" in files and not any(name.endswith(".tmp") for name in files)
    if mesh:
        assert "__2_0.distcp" not in files and "__3_0.distcp" not in files
    state = _load_state_dict_from_keys(checkpoint_id=str(root))
    assert set(state["state"]) == set(params)
    for fqn, p in params.items():
        s = state["state"][fqn]
        assert set(s) == {"exp_avg", "exp_avg_sq", "step"}, (fqn, set(s))
        assert s["exp_avg"].shape == p.shape and s["exp_avg_sq"].shape == p.shape and s["exp_avg_sq"].min() >= 0
        assert s["step"].dtype == torch.float32 and s["step"].shape == () and s["step"].item() == 2
    python_keys = set(torch.optim.AdamW([torch.zeros(1)]).param_groups[0])
    groups = state["param_groups"]
    assert [set(g) for g in groups] == [python_keys, python_keys]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all(g["decoupled_weight_decay"] for g in groups)
    assert all(g["lr"] == 1e-2 and g["eps"] == 1e-6 and g["betas"] == (0.9, 0.999) for g in groups), groups
    assert sorted(groups[0]["params"] + groups[1]["params"]) == sorted(params)
    assert all(params[n].dim() >= 2 for n in groups[0]["params"])
    assert all(params[n].dim() < 2 for n in groups[1]["params"])
    # each bytes entry is a torch.save archive of plain values, which torch's weights_only unpickler reads too
    md = FileSystemReader(str(root)).read_metadata()
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            with open(root / info.relative_path, "rb") as f:
                f.seek(info.offset)
                value = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            _, g, key = md.planner_data[index.fqn]
            assert value == groups[g][key], (index.fqn, value)


@pytest.mark.parametrize(("ranks", "mesh"), [(2, []), (3, []), (4, ["--hybrid"])])
def test_torch_and_fsdpx_load_what_fsdpx_saved(job: str, tool: str, merge: str, mpiexec: list[str], work: Path,
                                               ranks: int, mesh: list[str]) -> None:
    root, reference = work / f"dcp_np{ranks}", work / f"reference_np{ranks}.pt"
    done_save = run_job(mpiexec, ranks, job, "dcp-save", "--root", root, "--steps", 2, "--out", reference, *mesh)
    assert done_save.returncode == 0, done_save.stdout + done_save.stderr
    expected: dict[str, torch.Tensor] = torch.load(reference, weights_only=True)
    assert expected

    md = FileSystemReader(str(root)).read_metadata()
    assert set(md.state_dict_metadata) == set(expected)
    boxes = 0
    for fqn, entry in md.state_dict_metadata.items():
        assert isinstance(entry, TensorStorageMetadata)
        assert list(entry.size) == list(expected[fqn].shape)
        assert entry.properties.dtype == expected[fqn].dtype
        boxes += len(entry.chunks)
    if ranks == 3:  # shard boundaries fall inside rows: some tensors are cut into several boxes
        assert boxes > len(expected)
    files = sorted(p.name for p in root.iterdir())
    assert ".metadata" in files and not any(name.endswith(".tmp") for name in files)
    if mesh:  # HybridShard<2> at 4 ranks: replica ranks 2 and 3 hold copies and write nothing
        assert "__2_0.distcp" not in files and "__3_0.distcp" not in files

    loaded = {fqn: torch.full_like(t, float("nan")) for fqn, t in expected.items()}
    load(loaded, checkpoint_id=str(root), no_dist=True)
    for fqn, t in expected.items():
        assert torch.equal(loaded[fqn], t), fqn

    converted = work / f"converted_np{ranks}.pt"
    dcp_to_torch_save(str(root), str(converted))
    whole: dict[str, torch.Tensor] = torch.load(converted, weights_only=True)
    assert set(whole) == set(expected)
    for fqn, t in expected.items():
        assert torch.equal(whole[fqn], t), fqn

    other = 3 if ranks == 2 else 2  # fsdpx reads it back at another world size, each rank its own boxes
    done = run_job(mpiexec, other, tool, "model", root, reference)
    assert done.returncode == 0, done.stdout + done.stderr

    check_optimizer_save(root / "optim_states", expected, done_save, mesh)

    merged = work / f"merged_np{ranks}"
    done = subprocess.run([merge, str(root), "--out", str(merged)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    tensors = load_file(merged / "model.safetensors")
    assert set(tensors) == set(expected)
    for fqn, t in expected.items():
        assert torch.equal(tensors[fqn], t), fqn


def test_a_full_disk_on_one_rank_fails_every_rank_and_writes_no_metadata(job: str, mpiexec: list[str],
                                                                          work: Path) -> None:
    root = work / "dcp_full_disk"
    done = run_job(mpiexec, 2, job, "dcp-save", "--root", root, "--steps", 1, "--out", work / "unused.pt",
                   "--fail-rank", "1")
    assert done.returncode != 0, done.stdout
    assert done.stderr.count("DCP save failed") == 2, done.stderr
    assert "the DCP save's data files in" in done.stderr and "(no .metadata is written) failed on rank 1" in done.stderr
    assert "No space left on device" in done.stderr or "ENOSPC" in done.stderr or "full" in done.stderr, done.stderr
    assert not (root / ".metadata").exists()
    assert not any(p.name.endswith(".tmp") for p in root.iterdir())


def test_inspect_verifies_a_dcp_folder_and_names_a_damaged_chunk(job: str, inspect: str, mpiexec: list[str],
                                                                  work: Path) -> None:
    root = work / "dcp_inspect"
    done = run_job(mpiexec, 3, job, "dcp-save", "--root", root, "--steps", 1, "--out", work / "inspect_ref.pt")
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([inspect, str(root), "--tensors", "--verify"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PyTorch Distributed Checkpoint" in done.stdout
    assert "verify: every chunk and bytes entry reads" in done.stdout
    data = root / "__1_0.distcp"
    with data.open("r+b") as f:  # the first chunk's archive is no longer a zip
        f.write(b"XXXXXXXX")
    done = subprocess.run([inspect, str(root), "--verify"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "__1_0.distcp" in done.stderr and "is not a torch.save archive" in done.stderr, done.stderr


def test_the_coordinator_saves_dcp_in_the_background_and_resumes_it(job: str, mpiexec: list[str], work: Path) -> None:
    """CheckpointCoordinator with CheckpointFormat::dcp at 3 ranks: the step folder is a DCP checkpoint (the model's,
    optim_states/ the optimizer's) that torch reads as it is, committed as fsdpx commits (fsdp_config.json lists
    every data file and each .metadata, the iteration files name the step); a job of 2 ranks resumes it to the
    saved state bit for bit."""
    root, saved, resumed = work / "coordinator_dcp", work / "coordinator_saved.pt", work / "coordinator_resumed.pt"
    done = run_job(mpiexec, 3, job, "train", "--steps", 4, "--save-every", 2, "--keep", 1, "--root", root, "--out",
                   saved, "--dcp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (root / "global_step_2").exists()  # rotated away: --keep 1
    step = root / "global_step_4" / "actor"
    record = json.loads((step / "fsdp_config.json").read_text())
    assert record["files_format"] == "dcp" and record["complete"], record
    data_files = {p.name for p in step.glob("__*_0.distcp")}
    assert data_files == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    assert set(record["files"]) >= {*data_files, ".metadata", "optim_states/.metadata",
                                    *(f"optim_states/{name}" for name in data_files)}, record["files"]
    for name, f in record["files"].items():
        assert (step / name).stat().st_size == f["bytes"], name

    full = torch.load(saved, weights_only=True)  # fsdpx's full state dict file: {"entries": {name: {"data", ...}}}
    expected = {fqn: e["data"].reshape(e["shape"]) for fqn, e in full["entries"].items()}
    loaded = {fqn: torch.full_like(t, float("nan")) for fqn, t in expected.items()}
    load(loaded, checkpoint_id=str(step), no_dist=True)
    for fqn, t in expected.items():
        assert torch.equal(loaded[fqn], t), fqn
    optim = _load_state_dict_from_keys(checkpoint_id=str(step / "optim_states"))
    assert set(optim["state"]) == set(expected)
    assert all(s["step"].item() == 4 for s in optim["state"].values())
    assert len(optim["param_groups"]) == 2

    done = run_job(mpiexec, 2, job, "train", "--steps", 4, "--resume", "--root", root, "--out", resumed, "--dcp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed" in done.stdout, done.stdout
    done = subprocess.run([job, "compare", str(saved), str(resumed), "--tol", "0"], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
