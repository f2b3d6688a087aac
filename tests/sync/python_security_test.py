"""The Python receiver under attack (labels "security" and "python"): what a hostile synchronizer, or a
local peer of a real one, can make fsdpx_sync do. Each case would pass on a receiver that trusted the
server; each must end in a SyncError that names the cause, within bounds of memory and time.

- a frame header announcing a 1 GiB bucket commits only the bytes that arrive;
- a bucket of many entries costs about its own size, not several times it;
- the shared list of receiver checks (receiver_cases.py), which the C++ client runs too;
- a version of many empty tensors is refused once their bookkeeping outgrows its bytes by a floor;
- versions whose chunks overlap, leave gaps, repeat or lie outside their tensor are refused, naming the
  tensor (fixed cases, then a fuzz of random layouts against their expected outcome);
- a version carrying the manifest of another version is refused;
- a server trickling frames, or sending 250,000 chunks last first, cannot keep a fetch beyond its timeout;
- against the real C++ server (sync_server_program): a client refused for too many unauthenticated
  connections from its address is told so; a new trainer run with lower versions reaches a reader that
  holds a version far ahead.

    python_security_test.py --package <python/> --server <sync_server_program>
"""

import argparse
import json
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

from peer_support import (BUCKET, FETCH, HEADER, HELLO, MAGIC, PROTOCOL, SNAPSHOT_BEGIN, WELCOME,  # noqa: F401
                          craft_bucket, empty_tensors, frame, manifest_chunk, recv_exact, recv_frame,
                          send_version)




class FakeServer:
    """A fake synchronizer without a secret: for each connection, the handshake, then for each fetch
    the next of `serve(conn)` (a function that sends a version, or anything else)."""

    def __init__(self, serve):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.serve, self.stop, self.conn = serve, False, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.conn = conn
            with conn:
                conn.settimeout(30)
                try:
                    conn.sendall(frame(HELLO, -1, PROTOCOL, bytes(32)))
                    auth = recv_frame(conn)
                    conn.sendall(frame(WELCOME, -1, auth[0][6], bytes(32)))
                    while recv_frame(conn) is not None:  # a fetch
                        self.serve(conn)
                except OSError:
                    pass

    def close(self):
        self.stop = True
        if self.conn is not None:
            try:
                self.conn.shutdown(socket.SHUT_RDWR)  # a client that stays connected ends its session
            except OSError:
                pass
        self.thread.join()
        self.sock.close()


def expect_error(fn, *needles):
    from fsdpx_sync import SyncError
    try:
        fn()
    except SyncError as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in: {e}"
        return str(e)
    raise AssertionError(f"no SyncError (expected one with {needles})")


def test_large_frame_header(torch, SyncClient):
    """One header announcing a 1 GiB bucket (within max_bucket_bytes) makes the client hold only what
    arrives (before: a 1 GiB buffer, zeroed, at once)."""
    def serve(conn):
        conn.sendall(frame(SNAPSHOT_BEGIN, 1, 1, b"r"))
        conn.sendall(HEADER.pack(MAGIC, BUCKET, 0, 1, (1 << 30), 0, 0) + bytes(64 << 10))
        conn.shutdown(socket.SHUT_RDWR)
    server = FakeServer(serve)
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        expect_error(lambda: SyncClient("127.0.0.1", server.port).fetch_newer(-1, timeout=10),
                     "the server closed the connection")
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
        assert grew < 128 << 20, f"a 1 GiB frame header made the receiver's peak memory grow by {grew >> 20} MiB"
    finally:
        server.close()


def test_many_entries(torch, SyncClient):
    """A bucket of 20,000 one-element entries: the receiver's own memory stays about the bucket's size
    (before: every entry parsed into an object first, about 8 times the bucket)."""
    n = 20000
    w = torch.arange(n, dtype=torch.float32)
    bucket = craft_bucket(torch, 4, 0, 1, [manifest_chunk(4, {"w": w})] + [("w", w, k, 1) for k in range(n)], tight=True)
    frames = frame(SNAPSHOT_BEGIN, 4, 1, b"r") + frame(BUCKET, 4, 0, bucket)  # made before the measurement

    def serve(conn):
        conn.sendall(frames)
    server = FakeServer(serve)
    try:
        client = SyncClient("127.0.0.1", server.port)
        tracemalloc.start()
        got = client.fetch_newer(-1, timeout=60)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert torch.equal(got.named()["w"], w)
        assert peak < 1.5 * len(bucket), f"{peak} bytes of Python memory for a bucket of {len(bucket)} bytes"
        print(f"many entries: {n} entries, bucket {len(bucket)} bytes, peak Python memory {peak} bytes")
    finally:
        server.close()


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def rss_growth_during(fn):
    """fn()'s result and the most this process's resident memory grew while it ran (sampled every 5 ms)."""
    base, peak, done = rss_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes() - base)
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return fn(), peak
    finally:
        done.set()
        sampler.join()


def test_many_empty_tensors(torch, SyncClient):
    """4 buckets of 150,000 distinct empty tensors: refused once their bookkeeping outgrows the bytes that
    came by the C++ receivers' floor (before: 1.5 million of them cost 2.39 GiB and 22.5 s), in memory
    bounded by the floors (a bucket of more entries than its bytes allow is a shared receiver case)."""
    from fsdpx_sync.bucket import HEADER_BOOKKEEPING_FLOOR, VERSION_BOOKKEEPING_FLOOR
    per_bucket, count = 150000, 4
    buckets = [craft_bucket(torch, 9, k, count, empty_tensors(torch, k * per_bucket, per_bucket), tight=True)
               for k in range(count)]
    frames = frame(SNAPSHOT_BEGIN, 9, count, b"empties") + b"".join(frame(BUCKET, 9, k, b) for k, b in enumerate(buckets))
    del buckets
    server = FakeServer(lambda conn: conn.sendall(frames))
    try:
        client = SyncClient("127.0.0.1", server.port)
        start = time.monotonic()
        text, grew = rss_growth_during(lambda: expect_error(lambda: client.fetch_newer(-1, timeout=60), "version 9",
                                                            "too many entries or tensors for their bytes"))
        took = time.monotonic() - start
        assert grew[0] < HEADER_BOOKKEEPING_FLOOR + VERSION_BOOKKEEPING_FLOOR, f"resident memory grew by {grew[0]}: {text}"
        print(f"many empty tensors: refused after {took:.2f} s, resident memory grew by {grew[0] >> 20} MiB: "
              f"{text[-160:]}")
    finally:
        server.close()


def test_shared_receiver_cases(SyncClient, folder):
    """The crafted versions of receiver_cases.py (the same frames the C++ client is given): each refused
    saying what the list says both receivers say."""
    with open(os.path.join(folder, "cases.json")) as f:
        cases = json.load(f)
    for case in cases:
        with open(os.path.join(folder, case["frames"]), "rb") as f:
            data = f.read()
        server = FakeServer(lambda conn: conn.sendall(data))
        try:
            text = expect_error(lambda: SyncClient("127.0.0.1", server.port).fetch_newer(-1, timeout=10),
                                *case["expected"])
            print(f"shared case refused, {case['name']}: {text[-140:]}")
        finally:
            server.close()
    assert len(cases) >= 16, f"only {len(cases)} shared cases in {folder}"


def test_coverage_cases(torch, SyncClient):
    embed = torch.arange(40000, dtype=torch.float32).view(200, 200)
    empty = torch.empty(0, 4)
    cases = [
        ("the first half twice", [[("embed.weight", embed, 0, 20000)], [("embed.weight", embed, 0, 20000)]],
         ["'embed.weight'", "elements [0, 20000) arrived twice"]),
        ("a gap", [[("embed.weight", embed, 0, 20000)], [("embed.weight", embed, 30000, 10000)]],
         ["'embed.weight'", "elements [20000, 30000) never did"]),
        ("a chunk beyond the tensor", [[("embed.weight", embed, 0, 20000), ("embed.weight", embed, 30000, 20000)]],
         ["'embed.weight'", "lies outside"]),
        ("an empty tensor twice", [[("embed.weight", embed, 0, 40000), ("empty", empty, 0, 0)], [("empty", empty, 0, 0)]],
         ["'empty'", "the empty tensor arrived twice"]),
    ]
    queue = []
    server = FakeServer(lambda conn: send_version(torch, conn, 5, queue.pop(0)))
    try:
        for what, buckets, needles in cases:
            queue.append(buckets)
            text = expect_error(lambda: SyncClient("127.0.0.1", server.port).fetch_newer(-1, timeout=10),
                                f"from the synchronizer at 127.0.0.1:{server.port}", "version 5", *needles)
            print(f"refused, {what}: {text}")
        queue.append([[manifest_chunk(5, {"embed.weight": embed, "empty": empty}), ("embed.weight", embed, 25000, 15000),
                       ("empty", empty, 0, 0)], [("embed.weight", embed, 0, 25000)]])
        got = SyncClient("127.0.0.1", server.port).fetch_newer(-1, timeout=10).named()
        assert torch.equal(got["embed.weight"], embed) and got["empty"].shape == (0, 4)
    finally:
        server.close()


def test_many_chunks_last_first(torch, SyncClient):
    """250,000 one-element chunks, every other element of a tensor, sent last first in one bucket (as many
    as a bucket of their bytes may describe): the fetch ends by its 3 s timeout (before: 400,000 took 26 s,
    each chunk inserted at the front of sorted arrays, and entry parsing never looked at the deadline)."""
    n = 250000
    w = torch.zeros(2 * n)
    chunks = [manifest_chunk(6, {"w": w})] + [("w", w, 2 * k, 1) for k in range(n - 1, -1, -1)]
    frames = frame(SNAPSHOT_BEGIN, 6, 1, b"r") + frame(BUCKET, 6, 0, craft_bucket(torch, 6, 0, 1, chunks, tight=True,
                                                                                  zeros=True))
    server = FakeServer(lambda conn: conn.sendall(frames))
    try:
        client = SyncClient("127.0.0.1", server.port)
        start = time.monotonic()
        text = expect_error(lambda: client.fetch_newer(-1, timeout=3), "version 6")
        took = time.monotonic() - start
        assert took < 4.5, f"a fetch with a 3 s timeout took {took:.1f} s: {text}"
        assert "never did" in text or "did not finish within the fetch's timeout of 3" in text, text
        print(f"many chunks last first: {n} chunks, ended after {took:.2f} s: {text[-120:]}")
    finally:
        server.close()


def test_manifest_of_another_version(torch, SyncClient):
    """Version 2 carrying the manifest of version 7 (whole and consistent otherwise) is refused, as the
    C++ client and the server refuse it (before: returned as version 2 with version 7's manifest)."""
    w = torch.arange(64, dtype=torch.float32)
    server = FakeServer(lambda conn: send_version(torch, conn, 2, [[manifest_chunk(7, {"w": w}), ("w", w, 0, 64)]]))
    try:
        expect_error(lambda: SyncClient("127.0.0.1", server.port).fetch_newer(-1, timeout=10),
                     "version 2 carries the manifest of version 7")
    finally:
        server.close()


def test_coverage_fuzz(torch, SyncClient, SyncError, versions=80):
    """Random layouts (chunks cut at random, shuffled over 1-4 buckets), damaged or not: a duplicate
    chunk, a dropped one (a gap), one grown into its neighbour, one moved beyond its tensor. A damaged
    version is refused naming the damaged tensor; a whole one arrives bit-exact."""
    rng = random.Random(20261201)
    queue = []
    server = FakeServer(lambda conn: send_version(torch, conn, 7, queue.pop(0)))
    client = SyncClient("127.0.0.1", server.port)
    outcomes = {}
    try:
        for v in range(versions):
            chunks, sources = [], {}
            for t in range(rng.randint(1, 3)):
                name = f"layer{t}.w"
                numel = 0 if rng.random() < 0.1 else rng.randint(1, 3000)
                dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
                src = sources[name] = torch.randint(0, 200, (numel,)).to(dtype)
                cuts = sorted({0, numel, *(rng.randint(1, numel - 1) for _ in range(rng.randint(0, 5)) if numel > 1)})
                if numel == 0:
                    cuts = [0, 0]
                chunks += [[name, src, a, b - a] for a, b in zip(cuts, cuts[1:])]
            i = rng.randrange(len(chunks))
            c = chunks[i]
            name, numel, damage = c[0], c[1].numel(), None
            kind = rng.randrange(6)
            if kind == 0:
                chunks.append(list(c))
                damage = "duplicate"
            elif kind == 1 and sum(o[0] == name for o in chunks) > 1:
                del chunks[i]
                damage = "gap"
            elif kind == 2 and c[2] + c[3] < numel:
                c[3] += rng.randint(1, numel - c[2] - c[3])
                damage = "overlap"
            elif kind == 2 and c[3] > 1:
                c[3] -= rng.randint(1, c[3] - 1)
                damage = "gap"
            elif kind == 3:
                c[2] = numel - c[3] + rng.randint(1, 5)
                damage = "out of range"
            rng.shuffle(chunks)
            nb = min(len(chunks), rng.randint(1, 4))
            buckets = [[] for _ in range(nb)]
            for k, ch in enumerate(chunks):
                buckets[k if k < nb else rng.randrange(nb)].append(tuple(ch))
            buckets[0].insert(0, manifest_chunk(7, sources))  # first, as protocol 4 has it
            queue.append(buckets)
            if damage is None:
                got = client.fetch_newer(-1, timeout=10).named()
                for n, src in sources.items():
                    assert torch.equal(got[n].view(torch.uint8), src.view(torch.uint8)), (v, n)
            else:
                try:
                    client.fetch_newer(-1, timeout=10)
                    raise AssertionError(f"version {v}: a {damage} of '{name}' was accepted")
                except SyncError as e:
                    assert f"'{name}'" in str(e), (v, damage, str(e))
            outcomes[damage] = outcomes.get(damage, 0) + 1
    finally:
        client.close()
        server.close()
    print(f"coverage fuzz: {outcomes}")
    assert all(outcomes.get(d, 0) >= 3 for d in ("duplicate", "gap", "overlap", "out of range", None)), outcomes


def test_trickle(torch, SyncClient):
    """Each bucket well within io_timeout, 100 of them 0.3 s apart: the fetch ends at its 1 s timeout
    (before: 30 s)."""
    w = torch.arange(100, dtype=torch.float32)

    def serve(conn):
        conn.sendall(frame(SNAPSHOT_BEGIN, 3, 100, b"slow"))
        for k in range(100):
            time.sleep(0.3)
            conn.sendall(frame(BUCKET, 3, k, craft_bucket(torch, 3, k, 100, [("w", w, k, 1)])))
    server = FakeServer(serve)
    try:
        start = time.monotonic()
        expect_error(lambda: SyncClient("127.0.0.1", server.port, io_timeout=5).fetch_newer(-1, timeout=1.0),
                     "did not finish within the fetch's timeout of 1.0 s", "of 100 buckets received")
        took = time.monotonic() - start
        assert 0.9 < took < 2.5, took
    finally:
        server.close()


def test_real_server(torch, SyncClient, server_program):
    proc = subprocess.Popen([server_program, "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])

        def command(line):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            return proc.stdout.readline().strip()

        assert command("publish 1 first") == "ok"
        # Four connections from 127.0.0.1 that never authenticate fill max_handshakes_per_address (4):
        # the client is refused, and told why (before: "the server closed the connection").
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.2)
        expect_error(lambda: SyncClient("127.0.0.1", port, connect_timeout=0.3).fetch_newer(-1, timeout=5),
                     "the server refused the connection: too many unauthenticated connections from 127.0.0.1",
                     "asked again for 0.3 s")
        for s in silent:
            s.close()
        time.sleep(0.2)
        reader = SyncClient("127.0.0.1", port)
        assert reader.fetch_newer(-1, timeout=5).version == 1
        # A run far ahead, then a new run with small versions: the reader holding the far one gets it.
        far = (1 << 30) + 1
        assert command(f"publish {far} someone-else") == "ok"
        got = reader.fetch_newer(1, timeout=5)
        assert got.version == far
        assert command("publish 2 restarted") == "ok"
        back = reader.fetch_newer(far, timeout=5)
        assert back.version == 2 and back.run != got.run and len(back.run) == 32, (back.version, back.run, got.run)
        w = back.named()["w"]
        assert torch.equal(w, torch.arange(1000, dtype=torch.float32).mul(0.5).add(2).view(10, 100))
        assert torch.equal(back.named()["b"], torch.full((7,), 2.0, dtype=torch.bfloat16))
        answer = command("publish 2 restarted")
        assert answer.startswith("error") and "not newer than 2" in answer and "new run" in answer, answer
        command("quit")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--cases", required=True, help="the folder receiver_cases.py wrote")
    args = ap.parse_args()
    sys.path.insert(0, args.package)
    import torch
    from fsdpx_sync import SyncClient, SyncError
    for key in ("FSDPX_SYNC_SECRET", "FSDPX_SYNC_FETCH_SECRET", "FSDPX_SYNC_PUBLISH_SECRET"):
        os.environ.pop(key, None)
    test_large_frame_header(torch, SyncClient)  # first: it reads the process's peak memory
    test_many_entries(torch, SyncClient)
    test_coverage_cases(torch, SyncClient)
    test_manifest_of_another_version(torch, SyncClient)
    test_many_chunks_last_first(torch, SyncClient)
    test_many_empty_tensors(torch, SyncClient)
    test_shared_receiver_cases(SyncClient, args.cases)
    test_coverage_fuzz(torch, SyncClient, SyncError)
    test_trickle(torch, SyncClient)
    test_real_server(torch, SyncClient, args.server)
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
