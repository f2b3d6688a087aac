#!/usr/bin/env python3
"""Memory soak of the RL loop: examples/rl_hf (2 trainers + 1 rollout rank) for many steps, with every rank's
resident memory sampled, to show that host memory stays flat after warm-up (issue 50).

    python3 benchmarks/rl_soak.py [--steps 1000] [--save-every 10] [--csv docs/data/rl_soak.csv]

Each step generates, computes packed log-probs, trains, sends the weights to the rollout rank (as deltas
when rl_hf has --delta) and, every --save-every steps, checkpoints into a temporary folder that keeps two
(rotation). About once a second it reads VmRSS of every rl_hf process under mpiexec (its rank from
OMPI_COMM_WORLD_RANK) and the last "trainer: step N" line printed, and writes one CSV row per sample.
The summary gives, per process, the RSS at the end of warm-up, the most after it and the difference.
Python 3 standard library only. Exits non-zero when rl_hf fails (or grows beyond --max-growth-mib).
"""
import argparse
import collections
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from soak_support import ROOT, commit, machine, rss_mib  # benchmarks/ is on the path: run as benchmarks/rl_soak.py

RANKS = 3
STEP_LINE = re.compile(r"^trainer: step (\d+) ")
DELTA_LINE = re.compile(r"^rollout: version \d+ .*\(delta\)")


def children_by_parent():
    tree = collections.defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces: split after it
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        tree[ppid].append(int(pid))
    return tree


def rank_processes(root_pid, known):
    """{rank: pid} of the rl_hf processes below root_pid; `known` caches each pid's rank."""
    tree, stack, found = children_by_parent(), [root_pid], {}
    while stack:
        for pid in tree.get(stack.pop(), []):
            stack.append(pid)
            if pid not in known:
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        if f.read().strip() != "rl_hf":
                            continue
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                    known[pid] = int(env[b"OMPI_COMM_WORLD_RANK"])
                except (OSError, KeyError, ValueError):
                    continue
            found[known[pid]] = pid
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rl-hf", default=os.path.join(ROOT, "build", "examples", "rl_hf"))
    p.add_argument("--model", default=os.path.join(ROOT, "build", "tests", "models", "hf_models", "llama_gqa"),
                   help="a Hugging Face model folder (default: the tests' tiny Llama)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=10)
    # Small enough that each step changes only part of the bfloat16 weights, so versions travel as deltas (at
    # 1e-3 every weight changes every step, and the broadcaster rightly sends each whole); large enough that
    # the reward rises, which rl_hf checks.
    p.add_argument("--lr", default="3e-5")
    p.add_argument("--warmup", type=int, help="steps before memory must stay flat "
                   "(default: the first 10%%, at least 50, at most half the run)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--csv", default=os.path.join(ROOT, "docs", "data", "rl_soak.csv"))
    p.add_argument("--max-growth-mib", type=float, help="fail when a process grows more after warm-up")
    p.add_argument("--mpiexec", default="mpiexec")
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else min(max(50, args.steps // 10), args.steps // 2)

    usage = subprocess.run([args.rl_hf, "--help"], capture_output=True, text=True).stdout
    delta = "--delta" in usage  # older builds send every version whole
    launcher = [args.mpiexec, "-n", str(RANKS), "--oversubscribe"]
    launcher += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    ckpt_dir = tempfile.mkdtemp(prefix="rl_soak_")
    program = [args.rl_hf, "--model", args.model, "--eos", "3", "--lr", args.lr, "--steps", str(args.steps),
               "--save-every", str(args.save_every), "--ckpt-dir", ckpt_dir] + (["--delta"] if delta else [])
    command = launcher + program
    print("rl_soak:", " ".join(command), flush=True)

    # rl_hf's output on a thread, so that sampling keeps its pace; the latest step is what a sample records.
    latest = {"step": 0, "first": None, "last": None, "deltas": 0}  # first, last: (time, step) of step lines
    tail = collections.deque(maxlen=40)
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))

    def read_output():
        for line in proc.stdout:
            tail.append(line)
            latest["deltas"] += bool(DELTA_LINE.match(line))
            m = STEP_LINE.match(line)
            if m:
                step, now = int(m.group(1)), time.monotonic() - start
                latest["step"], latest["last"] = step, (now, step)
                latest["first"] = latest["first"] or (now, step)
                if step % max(1, args.steps // 10) == 0:
                    print(f"rl_soak: step {step} at {now:.0f} s", flush=True)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    samples, ranks_of = [], {}  # samples: (seconds, step, {rank: MiB})
    try:
        while proc.poll() is None:
            rss = {rank: rss_mib(pid) for rank, pid in rank_processes(proc.pid, ranks_of).items()}
            rss = {rank: mib for rank, mib in rss.items() if mib is not None}
            if rss:
                samples.append((time.monotonic() - start, latest["step"], rss))
            time.sleep(args.interval)
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        reader.join(timeout=10)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0 or latest["step"] != args.steps:
        sys.stdout.write("".join(tail))
        print(f"rl_soak: FAILED: rl_hf exited with {proc.returncode} at step {latest['step']} of {args.steps}")
        return 1

    with open(args.csv, "w") as f:
        shown = " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT + os.sep) else a for a in command)
        header = [
            "Memory soak of the RL loop (issue 50): VmRSS of each rl_hf process, sampled every "
            f"{args.interval:g} s, with the last step the trainers printed. Ranks 0 and 1 train, rank 2 rolls out.",
            f"Command (from the repository root; the checkpoint folder was temporary): OMP_NUM_THREADS=1 {shown}",
            f"Run by: python3 benchmarks/rl_soak.py {' '.join(sys.argv[1:])}",
            f"Warm-up: {warmup} steps. Machine: {machine()}.",
            f"Build: {commit()}. Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{seconds:.0f} s.",
        ]
        f.write("".join(f"# {line}\n" for line in header))
        f.write("seconds,step," + ",".join(f"rank{r}_mib" for r in range(RANKS)) + "\n")
        for t, step, rss in samples:
            f.write(f"{t:.1f},{step}," + ",".join(f"{rss[r]:.1f}" if r in rss else "" for r in range(RANKS)) + "\n")
    print(f"rl_soak: wrote {os.path.relpath(args.csv)} ({len(samples)} samples); plot: python3 tools/plots.py")

    (t0, s0), (t1, s1) = latest["first"], latest["last"]
    rate = (s1 - s0) / max(t1 - t0, 1e-9)
    print(f"rl_soak: {args.steps} steps in {seconds:.0f} s; {rate:.2f} steps/s from step {s0} to {s1} "
          f"({latest['deltas']} of {args.steps} versions sent as deltas, a checkpoint every {args.save_every} steps)")
    print(f"rl_soak: warm-up: the first {warmup} steps. RSS in MiB:")
    print(f"{'rank':>4} {'role':>8} {'first':>8} {'warm-up':>8} {'max after':>10} {'last':>8} {'growth':>8} "
          f"{'growth %':>9}")
    worst = 0.0
    for r in range(RANKS):
        series = [(step, rss[r]) for _, step, rss in samples if r in rss]
        warm = [mib for step, mib in series if step <= warmup]
        after = [mib for step, mib in series if step > warmup]
        if not warm or not after:
            print(f"rl_soak: rank {r}: too few samples around the end of warm-up")
            return 1
        growth = max(after) - warm[-1]
        worst = max(worst, growth)
        print(f"{r:>4} {'rollout' if r == RANKS - 1 else 'trainer':>8} {series[0][1]:8.1f} {warm[-1]:8.1f} "
              f"{max(after):10.1f} {series[-1][1]:8.1f} {growth:8.1f} {100 * growth / warm[-1]:8.1f}%")
    if args.max_growth_mib is not None and worst > args.max_growth_mib:
        print(f"rl_soak: FAILED: a process grew {worst:.1f} MiB after warm-up, more than {args.max_growth_mib:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
