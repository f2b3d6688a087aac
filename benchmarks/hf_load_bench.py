"""Loading a Hugging Face checkpoint: fsdpx (sharded, 2 ranks) vs transformers' from_pretrained vs
reading the files once, side by side, several rounds (the spread shows).

    .venv/bin/python benchmarks/hf_load_bench.py build/benchmarks/bench_hf_load [--dir DIR] [--rounds 3] [--np 2]

The model: a Qwen2.5-0.5B-shaped Qwen2ForCausalLM (494M parameters, tied embeddings) with random weights in
bfloat16, generated once into --dir (default build/hf_bench_qwen2_0.5b). Each round, in this order:
  read           cat every safetensors file > /dev/null (the bytes once, from the page cache)
  fsdpx          mpiexec -n NP bench_hf_load DIR: from_pretrained into float32 masters sharded over NP ranks
  transformers   AutoModelForCausalLM.from_pretrained(DIR) in bfloat16 (its default here: the files' dtype)
  transformers32 the same with dtype=torch.float32 (the masters a trainer needs, as fsdpx loads them)
Two cache states, each contender in each: warm (the files in the page cache: read first) and cold (the
page cache dropped before each contender: echo 3 > /proc/sys/vm/drop_caches, which needs root; without
it only warm runs). Peak RSS is per process (fsdpx: the largest rank's), in MiB. FSDPX_HUGE_PAGES is
passed through (see docs/models.md on what the first touch of fresh huge pages costs in a VM).
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import torch

CONFIG = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6)


def generate(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    print(f"generating a {CONFIG['num_hidden_layers']}-layer Qwen2 model in bfloat16 into {path} ...", flush=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(path)


TRANSFORMERS = """
import resource, sys, time, torch
from transformers import AutoModelForCausalLM
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
dt = time.perf_counter() - t0
print(f"RESULT seconds={dt:.3f} peak_rss_mib={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
"""


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT"))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.e+]+)", line)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("--dir", default="build/hf_bench_qwen2_0.5b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--mpiexec", default="mpiexec")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        generate(args.dir)
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    mpi = [args.mpiexec, "-n", str(args.np), "--oversubscribe"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.np)), TRANSFORMERS_VERBOSITY="error")
    contenders = ("read", "fsdpx", "transformers", "transformers32")
    caches = ["warm"] + (["cold"] if drop_caches() else [])
    rows = {(c, k): [] for c in caches for k in contenders}
    params = None
    for r in range(args.rounds):
        for cache in caches:
            for k in contenders:
                if cache == "cold":
                    drop_caches()
                else:
                    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
                if k == "read":
                    t0 = time.perf_counter()
                    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
                    rows[(cache, k)].append({"seconds": time.perf_counter() - t0, "peak_rss_mib": float("nan")})
                elif k == "fsdpx":
                    f = run(mpi + [args.program, args.dir], env)
                    params = f["params"]
                    rows[(cache, k)].append(f)
                else:
                    rows[(cache, k)].append(run([sys.executable, "-c", TRANSFORMERS, args.dir,
                                                 "bfloat16" if k == "transformers" else "float32"], env))
            print(f"round {r + 1}, {cache}: " + ", ".join(f"{k} {rows[(cache, k)][-1]['seconds']:.2f} s" for k in contenders),
                  flush=True)
    fp32_mib = params * 4 / 2**20
    print(f"\n{params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB of bfloat16 files ({len(files)}), "
          f"{fp32_mib:.0f} MiB in float32; fsdpx at {args.np} ranks; FSDPX_HUGE_PAGES={os.environ.get('FSDPX_HUGE_PAGES', '1')}; "
          f"{args.rounds} rounds (median, min-max)\n")
    print("| page cache | contender | seconds | GB/s of files | peak RSS per process (MiB) | RSS / float32 model |")
    print("|---|---|---:|---:|---:|---:|")
    for (cache, k), v in rows.items():
        sec = [x["seconds"] for x in v]
        rss = statistics.median(x["peak_rss_mib"] for x in v)
        print(f"| {cache} | {k} | {statistics.median(sec):.2f} ({min(sec):.2f}-{max(sec):.2f}) | "
              f"{size / statistics.median(sec) / 1e9:.2f} | {'-' if k == 'read' else f'{rss:.0f}'} | "
              f"{'-' if k == 'read' else f'{rss / fp32_mib:.2f}'} |")
    print()
    for cache in caches:
        med = {k: statistics.median(x["seconds"] for x in rows[(cache, k)]) for k in contenders}
        per_round = [t["seconds"] / f["seconds"] for t, f in zip(rows[(cache, "transformers")], rows[(cache, "fsdpx")])]
        print(f"{cache}: fsdpx is {med['transformers'] / med['fsdpx']:.2f}x as fast as transformers (bf16; per round "
              + ", ".join(f"{x:.2f}" for x in per_round) + f"), {med['transformers32'] / med['fsdpx']:.2f}x (float32), "
              f"and runs at {med['read'] / med['fsdpx']:.0%} of the plain read's speed")

if __name__ == "__main__":
    main()
