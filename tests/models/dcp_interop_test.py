"""fsdpx and PyTorch FSDP2 resume each other's Distributed Checkpoints, in LightRFT's layout (the model's DCP in the
step folder, the optimizer's in optim_states/, scheduler_state.pt and client_state.pt beside them).

    python dcp_interop_test.py <fsdpx_dcp_interop_job> <fixtures dir> <work dir> <mpiexec> [mpiexec flags...]

A Qwen2-shaped Hugging Face model (tied head, q/k/v biases, a sliding-window layer) and three batches of 12 rows:
- fsdpx at 2 ranks takes AdamW steps 1 and 2 and saves DCP. FSDP2 at 3 gloo ranks loads the model and the optimizer
  as LightRFT does (get_*_state_dict, dcp.load, set_*_state_dict): what it holds is the checkpoint's, element for
  element; dcp_to_torch_save converts the checkpoint; FSDP2 takes step 3. fsdpx resumes at 2 ranks from its own
  checkpoint and takes step 3: it equals FSDP2's (loss, every gradient, every updated weight, within the bounds of
  tests/support/step_parity.hpp; the C++ side checks, from FSDP2's gradients and weights written here).
- FSDP2 at 3 gloo ranks takes steps 1 and 2 from the model folder's weights and saves in LightRFT's layout (and in
  torchtitan's: one DCP of "model", "optimizer" flattened by parameter, "lr_scheduler", "train_state"), then takes
  step 3. fsdpx resumes from LightRFT's at 2 ranks and at 4, and from torchtitan's at 2 (load_checkpoint both), and
  its step 3 equals FSDP2's.
"""
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from gloo_ranks import run_gloo_ranks  # noqa: E402

MODEL = "qwen2_tied"
FSDP2_RANKS = 3
ROWS, SEQ = 12, 12  # rank r of W trains on rows [12 r / W, 12 (r + 1) / W), as fsdpx_dcp_interop_job does
LR, WEIGHT_DECAY, EPS = 1e-2, 0.1, 1e-6  # fsdpx_dcp_interop_job's AdamW (make_adamw: matrices decay, the rest not)


def make_batches(model_dir: str, path: Path) -> None:
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(20261128)
    save_file({f"step{i}": torch.randint(1, vocab, (ROWS, SEQ), generator=g) for i in range(3)}, str(path))


def fsdp2_model(model_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model folder under FSDP2 (each decoder layer a unit, as fsdpx wraps it) and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
                              lr=LR, eps=EPS)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """Forward and backward of this rank's rows (a mean over them; FSDP2 averages the gradients over the ranks)."""
    per = ROWS // dist.get_world_size()
    ids = batch[dist.get_rank() * per:(dist.get_rank() + 1) * per]
    optim.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    detached: torch.Tensor = loss.detach()
    return detached


def step_and_write_reference(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor,
                             reference: str) -> None:
    """Step 3, written as fsdpx_dcp_interop_job's reference: the loss of the whole batch, every gradient before the
    optimizer's step and every weight after it, whole."""
    loss = train_step(model, optim, batch)
    dist.all_reduce(loss)
    out = {"loss": (loss / dist.get_world_size()).reshape(1)}
    sharded: list[tuple[str, Any]] = list(model.named_parameters())  # DTensors
    for name, p in sharded:
        out[f"grad.{name}"] = p.grad.full_tensor().contiguous()
    optim.step()
    for name, p in sharded:
        out[f"after.{name}"] = p.detach().full_tensor().contiguous()
    if dist.get_rank() == 0:
        save_file(out, reference)


def whole_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this one process."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    state = {k: torch.empty(list(e.size), dtype=e.properties.dtype)
             for k, e in md.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def fsdp2_resume_rank(rank: int, model_dir: str, batches: str, ckpt: str, reference: str) -> None:
    """One FSDP2 rank: resumes fsdpx's checkpoint as LightRFT's load_ckpt does, checks what it holds, takes step 3."""
    model, optim = fsdp2_model(model_dir)
    msd = get_model_state_dict(model)
    dcp_load(msd, checkpoint_id=ckpt)
    set_model_state_dict(model, msd)
    osd = get_optimizer_state_dict(model, optim)
    dcp_load(osd, checkpoint_id=os.path.join(ckpt, "optim_states"))
    set_optimizer_state_dict(model, optim, osd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    held_model: dict[str, Any] = get_model_state_dict(model, options=full)
    held_optim: dict[str, Any] = dict(get_optimizer_state_dict(model, optim, options=full))
    if rank == 0:
        saved = whole_checkpoint(Path(ckpt))
        for name, t in held_model.items():
            assert torch.equal(t, saved[name]), f"FSDP2 holds '{name}' other than fsdpx saved it"
        saved = whole_checkpoint(Path(ckpt) / "optim_states")
        names = [n for n, _ in model.named_parameters()]
        assert sorted(held_optim["state"]) == sorted(names), (sorted(held_optim["state"]), names)
        for name, state in held_optim["state"].items():
            for key, t in state.items():
                assert torch.equal(t, saved[f"state.{name}.{key}"]), f"FSDP2 holds {key} of '{name}' other than saved"
            assert state["step"].item() == 2, (name, state["step"])
        for g, group in enumerate(held_optim["param_groups"]):
            assert group["lr"] == LR and group["eps"] == EPS and group["betas"] == (0.9, 0.999), group
            assert group["weight_decay"] == (WEIGHT_DECAY if g == 0 else 0.0), group
        print(f"FSDP2 at {FSDP2_RANKS} ranks holds fsdpx's checkpoint element for element: {len(held_model)} tensors, "
              f"the AdamW state of {len(held_optim['state'])} parameters at step 2, {len(held_optim['param_groups'])} "
              "param groups", flush=True)
    step_and_write_reference(model, optim, load_file(batches)["step2"], reference)


def fsdp2_train_rank(rank: int, model_dir: str, batches: str, ckpt: str, reference: str) -> None:
    """One FSDP2 rank: steps 1 and 2, saved in LightRFT's layout, then step 3."""
    model, optim = fsdp2_model(model_dir)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    data = load_file(batches)
    for step in ("step0", "step1"):
        train_step(model, optim, data[step])
        optim.step()
        scheduler.step()
    dcp_save(get_model_state_dict(model), checkpoint_id=ckpt)
    dcp_save(get_optimizer_state_dict(model, optim), checkpoint_id=os.path.join(ckpt, "optim_states"))
    if rank == 0:
        torch.save(scheduler.state_dict(), os.path.join(ckpt, "scheduler_state.pt"))
        torch.save({"global_step": 2, "consumed_samples": 2 * ROWS}, os.path.join(ckpt, "client_state.pt"))
    # torchtitan's step folder: one DCP of the model, the optimizer flattened by parameter, and the train state
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    dcp_save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim, options=flat),
              "lr_scheduler": scheduler.state_dict(), "train_state": {"step": torch.tensor(2, dtype=torch.int32)}},
             checkpoint_id=f"{ckpt}_titan")
    step_and_write_reference(model, optim, data["step2"], reference)


def fsdpx(mpiexec: list[str], ranks: int, *args: object) -> str:
    cmd = [mpiexec[0], "-n", str(ranks), *mpiexec[1:], *map(str, args)]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(done.stdout, done.stderr, sep="", flush=True)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}"
    return done.stdout


def main() -> None:
    job, fixtures, work, *mpiexec = sys.argv[1:]
    model_dir = os.path.join(fixtures, MODEL)
    root = Path(work)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    batches = root / "batches.safetensors"
    make_batches(model_dir, batches)

    # fsdpx -> FSDP2
    ckpt = root / "fsdpx_step2"
    fsdpx(mpiexec, 2, job, "train", model_dir, batches, ckpt)
    assert (ckpt / ".metadata").is_file() and (ckpt / "optim_states" / ".metadata").is_file()
    reference = root / "fsdp2_step3_from_fsdpx.safetensors"
    run_gloo_ranks(fsdp2_resume_rank, FSDP2_RANKS, root, model_dir, str(batches), str(ckpt), str(reference),
                   timeout_s=300)
    dcp_to_torch_save(str(ckpt), str(root / "fsdpx_step2.pt"))
    converted = torch.load(root / "fsdpx_step2.pt", weights_only=True)
    saved = whole_checkpoint(ckpt)
    assert set(converted) == set(saved) and all(torch.equal(converted[k], saved[k]) for k in saved)
    print(f"dcp_to_torch_save converts fsdpx's checkpoint: {len(converted)} tensors, equal", flush=True)
    out = fsdpx(mpiexec, 2, job, "resume", model_dir, batches, ckpt, reference)
    assert "PASSED" in out

    # FSDP2 -> fsdpx
    ckpt = root / "fsdp2_step2"
    reference = root / "fsdp2_step3.safetensors"
    run_gloo_ranks(fsdp2_train_rank, FSDP2_RANKS, root, model_dir, str(batches), str(ckpt), str(reference),
                   timeout_s=300)
    for ranks in (2, 4):
        out = fsdpx(mpiexec, ranks, job, "resume", model_dir, batches, ckpt, reference)
        assert "PASSED" in out
    out = fsdpx(mpiexec, 2, job, "resume", model_dir, batches, f"{ckpt}_titan", reference)
    assert "PASSED" in out and "torchtitan's layout: load_checkpoint" in out
    print("PASSED")


if __name__ == "__main__":
    main()
