"""The finetune example end to end (CTest: example_finetune_resume_export):

    finetune_test.py <finetune> <fsdpx-merge> <fixtures dir> <work dir> <mpiexec> [mpiexec flags...]

(a) 2 ranks fine-tune tests/models' llama_gqa for 12 steps on a learnable token file, saving every 4
    steps; the loss falls, and the exported folder loads in transformers with no missing, unexpected or
    mismatched tensors, its tokenizer too;
(b) another run stops after step 8 and resumes at 3 ranks with --activation-checkpointing and a loss
    of 5-token chunks (--chunk-logits): its step-9 loss, from the weights saved at step 8, equals the
    first run's within the rounding bound of the decoder's loss (tests/support/rounding.py: another world
    size and the chunks only reorder float sums; the recomputation changes nothing) and the log's 4
    decimals; its schedule goes on as the first run's (the same LRs), and its loss goes on falling. The
    steps after 9 are not compared: AdamW turns rounding into weight differences that no bound derives
    once the runs part (tests/core/test_trainer.cpp compares resumed training step by step instead);
(d) the checkpoint of step 8 (2 ranks, no sequence parallelism) resumes with --sequence-parallel 2 (each
    window split over the 2 ranks, Ulysses): its step-9 loss equals the first run's within the same bound;
    the checkpoint it saves at step 9 resumes without sequence parallelism at 3 ranks;
(e) every checkpoint step carries the model's config and tokenizer files, never its weights, and
    fsdpx-merge turns step 12 into a folder (config.json included) whose tensors equal the export's;
(f) --memory-tier: a run keeps every step in memory (a folder of the test's standing for /dev/shm) and
    every 4th on disk, and stops after step 6; the relaunch at 3 ranks resumes step 6 from the memory tier,
    resharded (the disk holds step 4), its step-7 loss equals the first run's within the bound, and its
    clean end, with step 12 on disk, removes the memory folder.
"""
import glob
import array
import os
import re
import shutil
import subprocess
import sys

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import rounding  # noqa: E402


def run(cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    print(p.stdout + p.stderr, flush=True)
    if p.returncode != 0:
        raise SystemExit(f"exit code {p.returncode}")
    return p.stdout + p.stderr


def losses(log):
    return {int(m[0]): float(m[1]) for m in re.findall(r"^step +(\d+)  loss ([0-9.]+)", log, re.M)}


def lrs(log):
    return {int(m[0]): m[1] for m in re.findall(r"^step +(\d+)  loss [0-9.]+  lr (\S+)", log, re.M)}


def load_all(folder):
    tensors = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
    return tensors


def main():
    finetune, merge, fixtures, work, *mpiexec = sys.argv[1:]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    source = os.path.join(fixtures, "llama_gqa")
    # A learnable stream: runs of consecutive ids (each token predicts the next) from random starts.
    g = torch.Generator().manual_seed(0)
    ids = []
    while len(ids) < 20000:
        start = int(torch.randint(2, 60, (1,), generator=g))
        ids.extend(range(start, start + 30))
    data = os.path.join(work, "tokens.bin")
    with open(data, "wb") as f:
        array.array("I", ids).tofile(f)
    common = ["--model", source, "--data", data, "--steps", "12", "--batch", "6", "--seq", "32", "--lr", "1e-2",
              "--warmup", "2", "--save-every", "4"]
    mpi = lambda n: [mpiexec[0], "-n", str(n), *mpiexec[1:], finetune]

    out_a, ck_a = os.path.join(work, "out_a"), os.path.join(work, "ck_a")
    log_a = run(mpi(2) + common + ["--out", out_a, "--ckpt-dir", ck_a])
    la = losses(log_a)
    assert sorted(la) == list(range(1, 13)), la
    assert la[12] < 0.8 * la[1], f"the loss did not fall: {la[1]} -> {la[12]}"

    model, info = AutoModelForCausalLM.from_pretrained(out_a, output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"transformers reports {key}: {info[key]}"
    assert AutoTokenizer.from_pretrained(out_a)("w3 w4")["input_ids"] == [3, 4]
    print(f"(a) loss {la[1]:.4f} -> {la[12]:.4f}; the export loads in transformers with its tokenizer")

    ck_b = os.path.join(work, "ck_b")
    run(mpi(2) + common + ["--out", os.path.join(work, "unused"), "--ckpt-dir", ck_b, "--stop-after", "8"])
    assert not os.path.exists(os.path.join(work, "unused")), "an interrupted run exported"
    ck_d = os.path.join(work, "ck_d")
    shutil.copytree(ck_b, ck_d)  # step 8 as the interrupted run left it
    log_b = run(mpi(3) + common + ["--out", os.path.join(work, "out_b"), "--ckpt-dir", ck_b, "--resume",
                                   "--activation-checkpointing", "--chunk-logits", "480"])
    assert "resumed from step 8" in log_b
    lb = losses(log_b)
    assert sorted(lb) == list(range(9, 13)), lb
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    seq, batch = 32, 6
    bound = rounding.loss_bound(config, seq, batch * (seq - 1)) * la[9] + 1e-4  # and the 4 printed decimals, twice
    assert abs(lb[9] - la[9]) <= bound, (lb[9], la[9], bound)
    lb_rates, la_rates = lrs(log_b), lrs(log_a)
    assert all(lb_rates[s] == la_rates[s] for s in range(9, 13)), (lb_rates, la_rates)
    assert lb[12] < lb[9], f"the resumed run's loss did not fall: {lb[9]} -> {lb[12]}"
    print(f"(b) resumed at 3 ranks from step 8, layers checkpointed, loss in chunks: step-9 loss {lb[9]:.4f} vs "
          f"{la[9]:.4f} uninterrupted (bound {bound:.2e}), the same LRs, step-12 loss {lb[12]:.4f}")

    every_step = [a if a != "4" or common[i - 1] != "--save-every" else "1" for i, a in enumerate(common)]
    log_d = run(mpi(2) + every_step + ["--out", os.path.join(work, "unused"), "--ckpt-dir", ck_d, "--resume",
                                       "--sequence-parallel", "2", "--stop-after", "9"])
    assert "resumed from step 8" in log_d
    assert "sequence groups of 2 ranks (Ulysses), 16 tokens of each window per rank" in log_d
    ld = losses(log_d)
    assert sorted(ld) == [9], ld
    assert abs(ld[9] - la[9]) <= bound, (ld[9], la[9], bound)
    log_e = run(mpi(3) + common + ["--out", os.path.join(work, "unused"), "--ckpt-dir", ck_d, "--resume",
                                   "--stop-after", "10"])
    assert "resumed from step 9" in log_e and sorted(losses(log_e)) == [10], log_e
    print(f"(d) resumed from step 8 with --sequence-parallel 2: step-9 loss {ld[9]:.4f} vs {la[9]:.4f} (bound "
          f"{bound:.2e}); its step-9 checkpoint resumed at 3 ranks without it")

    os.environ["FSDPX_MEMORY_DIR"] = os.path.join(work, "shm")  # the ranks inherit it
    ck_f = os.path.join(work, "ck_f")
    run(mpi(2) + common + ["--out", os.path.join(work, "unused"), "--ckpt-dir", ck_f, "--memory-tier",
                           "--stop-after", "6"])
    assert glob.glob(os.path.join(work, "shm", "fsdpx-memory-*", "global_step_6")), "step 6 is not in the memory tier"
    log_f = run(mpi(3) + common + ["--out", os.path.join(work, "out_f"), "--ckpt-dir", ck_f, "--resume",
                                   "--memory-tier"])
    assert "resumed from step 6" in log_f and "(the memory tier)" in log_f, log_f
    assert "on disk: step 4" in log_f, log_f
    lf = losses(log_f)
    assert sorted(lf) == list(range(7, 13)), lf
    bound_f = rounding.loss_bound(config, seq, batch * (seq - 1)) * la[7] + 1e-4
    assert abs(lf[7] - la[7]) <= bound_f, (lf[7], la[7], bound_f)
    assert not glob.glob(os.path.join(work, "shm", "fsdpx-memory-*")), "the clean end left the memory tier's folder"
    print(f"(f) --memory-tier: stopped after step 6 (disk: step 4), resumed step 6 from memory at 3 ranks: step-7 "
          f"loss {lf[7]:.4f} vs {la[7]:.4f} (bound {bound_f:.2e}); the clean end removed the memory folder")

    for step in (8, 12):
        hf = os.path.join(ck_a, f"global_step_{step}", "actor", "huggingface")
        files = sorted(os.listdir(hf))
        assert "config.json" in files and "tokenizer.json" in files, files
        assert not any(f.endswith(".safetensors") or f.endswith(".index.json") for f in files), files
    merged = os.path.join(work, "merged")
    log = run([merge, ck_a, "--out", merged])
    assert os.path.exists(os.path.join(merged, "config.json")), log
    model, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    a, m = load_all(out_a), load_all(merged)
    assert sorted(a) == sorted(m), (sorted(a), sorted(m))
    for k in a:
        assert torch.equal(a[k], m[k]), k
    print(f"(e) checkpoints carry config and tokenizer files only; fsdpx-merge of step 12 equals the export ({len(a)} tensors)")
    print("PASSED")


if __name__ == "__main__":
    main()
