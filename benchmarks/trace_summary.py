"""Where a training step's GPU time goes, from the Chrome traces benchmarks/cuda_profile.{hpp,py} write
(FSDPX_PROFILE=DIR): per trace, the step's span (first to last GPU activity), the time some kernel or copy
ran (the union over streams) and the idle rest, the busy time by kernel family, and the longest kernels.

    python3 benchmarks/trace_summary.py DIR/*.json [--top N]
"""
import argparse
import json
import os
import re

# The first family whose pattern matches a kernel's name takes it.
FAMILIES = [
    ("communication (NCCL)", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn.*(sdpa|mha)", re.I)),
    ("matrix products", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|sm\d+_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("loss, softmax", re.compile(r"softmax|cross_entropy|nll_loss|log_softmax", re.I)),
    ("copies, fills", re.compile(r"memcpy|memset|copy_kernel|fill_kernel|cat_|Memcpy|Memset", re.I)),
    ("normalization", re.compile(r"norm", re.I)),
    ("reductions", re.compile(r"reduce", re.I)),
]
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def family(name):
    return next((label for label, pattern in FAMILIES if pattern.search(name)), "other elementwise")


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(path, top):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        print(f"## {os.path.basename(path)}: no GPU activity in the trace\n")
        return
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    span = max(max(b for _, b in intervals) - min(a for a, _ in intervals), 1e-9)  # one instant: no division by 0
    busy = union_length(intervals)
    by_family, by_kernel = {}, {}
    for e in gpu:
        dur = float(e["dur"])
        label = family(e["name"])
        by_family[label] = by_family.get(label, 0.0) + dur
        count, total = by_kernel.get(e["name"], (0, 0.0))
        by_kernel[e["name"]] = (count + 1, total + dur)
    kernel_sum = max(sum(by_family.values()), 1e-9)
    print(f"## {os.path.basename(path)}")
    print(f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({busy / span:.0%}), idle {(span - busy) / 1e3:.1f} ms;"
          f" {len(gpu)} kernels and copies, {kernel_sum / 1e3:.1f} ms summed over streams\n")
    print("| family | ms | share of summed time |\n|---|---:|---:|")
    for label, dur in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {dur / 1e3:.1f} | {dur / kernel_sum:.1%} |")
    print(f"\n| longest kernels (top {top}) | calls | ms |\n|---|---:|---:|")
    for name, (count, dur) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"| `{short.replace('|', '/')}` | {count} | {dur / 1e3:.1f} |")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.traces:
        summarize(path, args.top)


if __name__ == "__main__":
    main()
