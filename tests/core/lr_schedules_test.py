"""fsdpx's LR schedules equal transformers' get_*_schedule_with_warmup over 100 steps, within 1e-7.

Usage: lr_schedules_test.py PROGRAM   (PROGRAM: tests/core/lr_schedule_program.cpp built)
"""
import subprocess
import sys

import torch

try:
    import transformers
except ImportError:
    sys.exit("transformers is not installed in this Python (" + sys.executable + "): run tools/setup.sh")
from transformers import (get_constant_schedule, get_constant_schedule_with_warmup,
                          get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

SCHEDULES = {
    "constant": lambda o: get_constant_schedule(o),
    "constant_with_warmup": lambda o: get_constant_schedule_with_warmup(o, 10),
    "linear": lambda o: get_linear_schedule_with_warmup(o, 10, 100),
    "linear_no_warmup": lambda o: get_linear_schedule_with_warmup(o, 0, 80),
    "cosine": lambda o: get_cosine_schedule_with_warmup(o, 10, 100),
    "cosine_cycles": lambda o: get_cosine_schedule_with_warmup(o, 5, 100, num_cycles=1.5),
    "cosine_min_lr": lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 10, 100, min_lr_rate=0.1),
    "cosine_min_lr_short": lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 3, 60, min_lr_rate=0.25),
}


def transformers_lrs(make):
    params = [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    optimizer = torch.optim.SGD([{"params": [params[0]], "lr": 3e-4}, {"params": [params[1]], "lr": 1e-2}])
    scheduler = make(optimizer)
    out = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(100):
        optimizer.step()
        scheduler.step()
        out.append([g["lr"] for g in optimizer.param_groups])
    return out


def main():
    lines = subprocess.run([sys.argv[1]], check=True, capture_output=True, text=True).stdout.split("\n")
    ours = {}
    for line in filter(None, lines):
        name, *values = line.split()
        ours[name] = [float(v) for v in values]
    worst = 0.0
    failures = []
    for name, make in SCHEDULES.items():
        theirs = transformers_lrs(make)
        for group in range(2):
            mine = ours.get(f"{name}/{group}")
            if mine is None or len(mine) != 101:
                failures.append(f"{name}/{group}: the program printed {0 if mine is None else len(mine)} values, not 101")
                continue
            for step, (a, row) in enumerate(zip(mine, theirs)):
                diff = abs(a - row[group])
                worst = max(worst, diff)
                if diff > 1e-7:
                    failures.append(f"{name}/{group} step {step}: fsdpx {a!r}, transformers {row[group]!r}")
    print(f"transformers {transformers.__version__}: {len(SCHEDULES)} schedules x 2 groups x 101 LRs, "
          f"max |fsdpx - transformers| = {worst:.3g}")
    if failures:
        print("\n".join(failures[:20]))
        sys.exit(1)


if __name__ == "__main__":
    main()
