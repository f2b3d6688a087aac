"""Interop of fsdpx checkpoints with Python (CTest: checkpoint_merge_interop).

    merge_interop.py --fixture <fsdpx_merge_fixture> --merge <fsdpx-merge> --work <dir>

(a) Python's torch.load(weights_only=True) reads a model shard written by fsdpx;
(b) Python's safetensors reads what fsdpx-merge writes (one file, and sharded with an index), and it
    equals the original tensors (written by the C++ side without merging), as does the torch format;
(c) fsdpx reads a safetensors file written by Python's safetensors;
(d) fsdpx-merge fails with exit code 1 and names the file for a missing or corrupted shard.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings

warnings.filterwarnings("ignore")  # torch without numpy warns on import
import torch  # noqa: E402
import safetensors  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

failures = []


def check(cond, what):
    print(("ok      " if cond else "FAILED  ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(*cmd, expect_rc=0):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    print("$ " + " ".join(str(c) for c in cmd) + f"   -> exit {p.returncode}")
    for line in (p.stdout + p.stderr).strip().splitlines():
        print("    " + line)
    if p.returncode != expect_rc:
        raise SystemExit(f"expected exit code {expect_rc}, got {p.returncode}")
    return p


def same(got, want, what, dtype=None):
    ok = list(sorted(got)) == list(sorted(want))
    for name, t in want.items():
        t = t.to(dtype) if dtype is not None else t
        g = got.get(name)
        if g is None or g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            print(f"    differs: {name}")
            ok = False
    check(ok, what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--merge", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    work = args.work
    run(args.fixture, "write", work)
    root = os.path.join(work, "ckpt")
    step_dir = os.path.join(root, "global_step_12", "actor")
    expected = torch.load(os.path.join(work, "expected.pt"), weights_only=True)
    check(isinstance(expected, dict) and len(expected) == 6, "torch.load reads the C++ dict of expected tensors")

    # (a) a shard, in Python
    shard = torch.load(os.path.join(step_dir, "model_world_size_3_rank_1.pt"), weights_only=True)
    check(shard["format"] == "fsdpx" and shard["format_version"] == 1, "shard: format fsdpx, version 1")
    check(shard["kind"] == "sharded" and shard["component"] == "model", "shard: kind sharded, component model")
    check(shard["world_size"] == 3 and shard["rank"] == 1, "shard: world_size 3, rank 1")
    check(isinstance(shard["param_groups"], list), "shard: param_groups is a list")
    entries = shard["entries"]
    check(len(entries) > 0, f"shard: rank 1 holds {len(entries)} slices")
    ok = True
    for name, e in entries.items():
        full = expected[name].reshape(-1)
        check_shape = list(e["shape"]) == list(expected[name].shape)
        data = e["data"].reshape(-1)
        ok = ok and check_shape and data.numel() == e["end"] - e["begin"]
        ok = ok and torch.equal(data, full[e["begin"]:e["end"]])
    check(ok, "shard: every entry's shape, [begin, end) and data match the original tensor")
    config = json.load(open(os.path.join(step_dir, "fsdp_config.json")))
    check(config["world_size"] == 3 and config["files"]["model_world_size_3_rank_1.pt"]["bytes"]
          == os.path.getsize(os.path.join(step_dir, "model_world_size_3_rank_1.pt")), "fsdp_config.json records the size")

    # (b) merged: one safetensors file, from the root (latest step)
    out = os.path.join(work, "merged")
    p = run(args.merge, root, "--out", out)
    check("world size 3" in p.stdout and "step 12" in p.stdout and "checksums verified" in p.stdout,
          "fsdpx-merge picks step 12 (world size 3) from latest_checkpointed_iteration.txt")
    single = os.path.join(out, "model.safetensors")
    check(os.path.exists(single) and not os.path.exists(single + ".index.json"), "one file: model.safetensors, no index")
    same(load_file(single), expected, "safetensors.torch.load_file(model.safetensors) equals the full state dict")
    with safe_open(single, framework="pt") as f:
        check(f.metadata().get("format") == "pt", "__metadata__ format is pt")
        check(list(f.keys()) == sorted(expected), "safe_open lists every tensor")
    # The fixture's config names no model family whose tensors these are: writing it beside them would
    # make from_pretrained start from random weights, so it is left out, with a warning.
    check(not os.path.exists(os.path.join(out, "config.json")) and "config.json is not written" in p.stderr
          and 'model_type "fsdpx-test"' in p.stderr, "a config.json that does not describe these tensors is not written")

    # sharded with an index
    out_sharded = os.path.join(work, "merged_sharded")
    run(args.merge, root, "--out", out_sharded, "--max-shard-size", "300B")
    index = json.load(open(os.path.join(out_sharded, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    check(n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)],
          f"sharded: {n} files named model-0000i-of-{n:05d}.safetensors")
    merged = {}
    for fname in files:
        part = load_file(os.path.join(out_sharded, fname))
        check(all(index["weight_map"][k] == fname for k in part), f"index maps every tensor of {fname} to it")
        merged.update(part)
    same(merged, expected, "the sharded files, read through the index, equal the full state dict")
    check(index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values()),
          "index total_size is the bytes of all tensors")

    # torch format, bfloat16, and an explicit --step of the older world-size-2 checkpoint
    out_torch = os.path.join(work, "merged_torch")
    run(args.merge, os.path.join(root, "global_step_12"), "--out", out_torch, "--format", "torch")
    same(torch.load(os.path.join(out_torch, "model.pt"), weights_only=True), expected,
         "torch.load(model.pt, weights_only=True) equals the full state dict")
    out_bf16 = os.path.join(work, "merged_bf16")
    p = run(args.merge, root, "--step", "5", "--out", out_bf16, "--dtype", "bfloat16")
    check("world size 2" in p.stdout and "step 5" in p.stdout, "--step 5 merges the world-size-2 checkpoint")
    same(load_file(os.path.join(out_bf16, "model.safetensors")), expected,
         "--dtype bfloat16: safetensors holds BF16 tensors equal to the originals cast", dtype=torch.bfloat16)

    # (c) Python-written safetensors, read by fsdpx (needs no numpy: TensorSpec over torch's pointers)
    py_file = os.path.join(work, "python.safetensors")
    tensors = {k: v.contiguous() for k, v in expected.items()}
    if hasattr(safetensors, "TensorSpec"):
        spec = {k: safetensors.TensorSpec(dtype=str(v.dtype).split(".")[-1], shape=list(v.shape),
                                          data_ptr=v.data_ptr(), data_len=v.numel() * v.element_size())
                for k, v in tensors.items()}
    else:  # older safetensors: raw bytes
        spec = {k: {"dtype": str(v.dtype).split(".")[-1], "shape": list(v.shape),
                    "data": bytes(v.reshape(-1).view(torch.uint8).tolist())} for k, v in tensors.items()}
    safetensors.serialize_file(spec, py_file, metadata={"format": "pt"})
    p = run(args.fixture, "compare", py_file, os.path.join(work, "expected.pt"))
    check("equal" in p.stdout, "fsdpx's load_safetensors reads a file written by Python's safetensors")

    # (d) broken checkpoints: exit code 1, the file named
    broken = os.path.join(work, "broken")
    shutil.copytree(step_dir, broken)
    victim = os.path.join(broken, "model_world_size_3_rank_2.pt")
    os.remove(victim)
    p = run(args.merge, broken, "--out", os.path.join(work, "none"), expect_rc=1)
    check(victim in p.stderr and "missing" in p.stderr, "a missing rank file: exit 1, the file named")
    shutil.rmtree(broken)
    shutil.copytree(step_dir, broken)
    victim = os.path.join(broken, "model_world_size_3_rank_0.pt")
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    p = run(args.merge, broken, "--out", os.path.join(work, "none"), expect_rc=1)
    check(victim in p.stderr and "CRC-32C" in p.stderr, "a corrupted file: exit 1, the file named, CRC mismatch")
    shutil.rmtree(broken)
    shutil.copytree(step_dir, broken)
    victim = os.path.join(broken, "model_world_size_3_rank_1.pt")
    os.truncate(victim, os.path.getsize(victim) // 2)
    p = run(args.merge, broken, "--out", os.path.join(work, "none"), expect_rc=1)
    check(victim in p.stderr and "truncated" in p.stderr, "a truncated file: exit 1, the file named (size check)")
    p = run(args.merge, broken, "--out", os.path.join(work, "none"), "--no-verify", expect_rc=1)
    check(victim in p.stderr and "truncated or corrupt" in p.stderr, "a truncated file, --no-verify: exit 1, the file named")
    shutil.rmtree(broken)
    shutil.copytree(step_dir, broken)
    stale = os.path.join(broken, "model_world_size_2_rank_0.pt")
    shutil.copy(os.path.join(root, "global_step_5", "actor", "model_world_size_2_rank_0.pt"), stale)
    p = run(args.merge, broken, "--out", os.path.join(work, "none"), expect_rc=1)
    check(stale in p.stderr and "world size 2, not 3" in p.stderr, "a file of another world size: exit 1, the file named")
    run(args.merge, broken, expect_rc=1)  # no --out: a usage error is exit 1 too
    check(not os.path.exists(os.path.join(work, "none", "model.safetensors")), "nothing written on failure")

    if failures:
        print(f"{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
        return 1
    print("all interop checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
