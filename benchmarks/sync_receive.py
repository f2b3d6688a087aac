"""Python receiver (python/fsdpx_sync) vs the C++ client: one server, one version, side by side.

    .venv/bin/python benchmarks/sync_receive.py build/benchmarks/bench_sync_receive [--mib 256] [--iters 5] [--rounds 2]

Each round fetches the same version --iters times with the C++ client, then with Python (the CRC-32C
of google-crc32c when installed), then once with Python's torch CRC-32C fallback; it prints MB/s and
the ratio Python / C++ per round, so the spread between rounds shows.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fsdpx_sync  # noqa: E402
from fsdpx_sync import checksum as crc_module  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    server = subprocess.Popen([args.program, "serve", str(args.mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline().split()[1])
    try:
        print(f"one version: {args.mib} MiB of bfloat16 in 64 tensors, loopback, {os.cpu_count()} cores; "
              f"Python CRC-32C: {crc_module.implementation()}")
        for r in range(args.rounds):
            out = subprocess.run([args.program, "fetch", str(port), str(args.iters)], check=True, capture_output=True,
                                 text=True).stdout.split("\n")
            cpp = [float(line.split()[1]) for line in out if line.startswith("SECONDS")]
            client = fsdpx_sync.SyncClient("127.0.0.1", port)
            py = []
            for _ in range(args.iters):
                t = time.perf_counter()
                w = client.fetch_newer(-1, timeout=10)
                py.append(time.perf_counter() - t)
            nbytes = sum(t.numel() * t.element_size() for _, t in w)
            native = crc_module._NATIVE
            crc_module._NATIVE = None  # the torch fallback, once
            t = time.perf_counter()
            client.fetch_newer(-1, timeout=60)
            fallback = time.perf_counter() - t
            crc_module._NATIVE = native
            client.close()
            mb = nbytes / 1e6
            c, p = statistics.median(cpp), statistics.median(py)
            print(f"round {r + 1}: C++ {mb / c:8.0f} MB/s (median of {len(cpp)}, {mb / max(cpp):.0f}-{mb / min(cpp):.0f}) | "
                  f"Python {mb / p:8.0f} MB/s ({mb / max(py):.0f}-{mb / min(py):.0f}) | Python/C++ {c / p:.2f} | "
                  f"Python with the torch CRC-32C {mb / fallback:.0f} MB/s")
    finally:
        server.stdin.close()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
