"""The synchronizer service's memory over a long burst (issue 50): a server (bench_sync_soak host), one
publisher sending --versions versions of --mib MiB back to back (most as deltas), and readers that come
and go (C++ and Python: each connects, fetches 1-4 newer versions, leaves, pauses, comes back, until the
burst is over). Every process's resident memory is sampled every 0.25 s into a CSV (tools/plots.py draws
it); after warm-up (the first tenth of the versions, at least 50) the summary gives, per process, the median
of the first and of the last fifth of its samples and the trend (a least-squares slope): a process whose
memory swings with each version in flight (a reader) is flat when these do not rise.

    .venv/bin/python benchmarks/sync_soak.py build/benchmarks/bench_sync_soak [--versions 1000] [--mib 32]
        [--cpp-readers 2] [--python-readers 2] [--csv docs/data/sync_soak.csv]
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

from soak_support import commit, machine, rss_mib  # noqa: E402  (benchmarks/ is on the path)


def follow_in_python(port):
    """The Python reader: the C++ follower's loop (bench_sync_soak.cpp) with fsdpx_sync."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from fsdpx_sync import SyncClient, SyncError
    fetched, last, over = 0, -1, False
    while not over:
        client = SyncClient("127.0.0.1", port)
        for _ in range(random.randint(1, 4)):
            try:
                last = client.fetch_newer(last, timeout=60 if last < 0 else 5).version
                fetched += 1
            except SyncError as e:  # no newer version within the wait: the burst is over
                if "was published within" not in str(e):
                    raise
                over = True
                break
        client.close()
        time.sleep(random.uniform(0, 0.2))
    print(f"FETCHED {fetched} LAST {last}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", help="bench_sync_soak")
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--cpp-readers", type=int, default=2)
    ap.add_argument("--python-readers", type=int, default=2)
    ap.add_argument("--csv", default=os.path.join(HERE, "..", "docs", "data", "sync_soak.csv"))
    ap.add_argument("--follow", type=int, help=argparse.SUPPRESS)  # internal: be a Python reader of this port
    args = ap.parse_args()
    if args.follow is not None:
        return follow_in_python(args.follow)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    host = subprocess.Popen([args.program, "host"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    port = int(host.stdout.readline().split()[1])
    readers = [subprocess.Popen([args.program, "follow", str(port)], stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(args.cpp_readers)]
    readers += [subprocess.Popen([sys.executable, __file__, args.program, "--follow", str(port)],
                                 stdout=subprocess.PIPE, text=True, env=env) for _ in range(args.python_readers)]
    names = ["server", "publisher"] + [f"cpp_reader{i}" for i in range(args.cpp_readers)] + \
        [f"python_reader{i}" for i in range(args.python_readers)]
    start = time.monotonic()
    publisher = subprocess.Popen([args.program, "publish", str(port), str(args.versions), str(args.mib)],
                                 stdout=subprocess.PIPE, text=True, env=env)
    published = [0]

    def progress():
        for line in publisher.stdout:
            if line.startswith("PUBLISHED"):
                published[0] = int(line.split()[1])
    threading.Thread(target=progress, daemon=True).start()

    processes = [host, publisher] + readers
    rows = []
    try:
        while any(p.poll() is None for p in [publisher] + readers):
            rows.append((time.monotonic() - start, published[0], [rss_mib(p.pid) for p in processes]))
            time.sleep(0.25)
    finally:  # interrupted or not, no process outlives the script
        for p in [publisher] + readers:
            if p.poll() is None:
                p.terminate()
        host.stdin.close()
        host.wait()
    took = time.monotonic() - start
    outputs = [r.stdout.read().strip() for r in readers]
    failed = [n for n, p in zip(names[1:], [publisher] + readers) if p.returncode != 0]
    if failed:
        print(f"sync_soak: {', '.join(failed)} failed", file=sys.stderr)
        return 1

    warm_versions = max(50, args.versions // 10)
    warm_index = next((i for i, (_, v, _) in enumerate(rows) if v >= warm_versions), len(rows) - 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w") as f:
        f.write(f"# benchmarks/sync_soak.py --versions {args.versions} --mib {args.mib} --cpp-readers "
                f"{args.cpp_readers} --python-readers {args.python_readers}; resident MiB per process\n"
                f"# Machine: {machine()}. Build: {commit()}. Measured {time.strftime('%Y-%m-%d')}\n"
                f"# Warm-up: {warm_versions} versions\n")
        f.write("seconds,versions," + ",".join(f"{n}_mib" for n in names) + "\n")
        for t, v, mibs in rows:
            f.write(f"{t:.2f},{v}," + ",".join("" if m is None else f"{m:.1f}" for m in mibs) + "\n")

    print(f"{args.versions} versions of {args.mib} MiB in {took:.1f} s ({args.versions / took:.1f} versions/s); "
          f"readers: {'; '.join(outputs)}")
    print(f"| process | median, first fifth after warm-up | median, last fifth | trend (MiB per 100 versions) "
          f"| most after warm-up |\n|---|---:|---:|---:|---:|")
    for k, name in enumerate(names):
        after = [(v, mibs[k]) for _, v, mibs in rows[warm_index:] if mibs[k] is not None]
        if len(after) < 10:
            continue
        fifth = len(after) // 5
        first, last = (statistics.median(m for _, m in part) for part in (after[:fifth], after[-fifth:]))
        slope = statistics.linear_regression([v for v, _ in after], [m for _, m in after]).slope \
            if len({v for v, _ in after}) > 1 else 0.0
        print(f"| {name} | {first:.0f} MiB | {last:.0f} MiB | {100 * slope:+.2f} | {max(m for _, m in after):.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
