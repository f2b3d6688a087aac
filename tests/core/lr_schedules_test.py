"""fsdpx's LR schedules equal transformers' get_*_schedule_with_warmup over 100 steps, within rounding.

Both compute each LR in double precision, in at most 8 operations (the warmup ratio or the progress, a
cosine, the floor's blend, the product with the base LR), each correctly rounded or within an ulp (libm's
cosine): two implementations differ by at most 2 ulps per operation of the terms they combine, which are
at most the base LR (a cosine's 1 + cos may cancel to near 0, so the bound is relative to the base LR, not
to the result): 16 * 2^-53 * base LR.

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


BASE_LRS = (3e-4, 1e-2)  # the two groups' (tests/core/lr_schedule_program.cpp uses the same)
ULPS = 16 * 2.0 ** -53


def transformers_lrs(make):
    params = [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    optimizer = torch.optim.SGD([{"params": [params[0]], "lr": BASE_LRS[0]}, {"params": [params[1]], "lr": BASE_LRS[1]}])
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
                if diff > ULPS * BASE_LRS[group]:
                    failures.append(f"{name}/{group} step {step}: fsdpx {a!r}, transformers {row[group]!r}")
    print(f"transformers {transformers.__version__}: {len(SCHEDULES)} schedules x 2 groups x 101 LRs, "
          f"max |fsdpx - transformers| = {worst:.3g}")
    if failures:
        print("\n".join(failures[:20]))
        sys.exit(1)


if __name__ == "__main__":
    main()
