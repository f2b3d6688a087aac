"""The receiver checks both languages run against the same crafted frames (issue 50): what a hostile
synchronizer sends for a fetch, and what the C++ client (test_service_security.cpp, "the shared receiver
checks") and the Python receiver (python_security_test.py, test_shared_receiver_cases) must both say when
they refuse it. One list, so that a check one receiver makes and the other does not fails a test.

    receiver_cases.py --package <python/> --out DIR     writes DIR/cases.json and DIR/<case>.bin
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys


def cases() -> list[tuple[str, bytes, list[str]]]:
    """[(name, the bytes a server sends after the fetch, [what each receiver's refusal must say])]"""
    import torch

    from frame_support import Chunk, craft_bucket, empty_tensors, frame, manifest_chunk, version_frames
    from fsdpx_sync.wire import (
        BUCKET,
        FRAME_MAGIC,
        HEADER,
        MANIFEST_NAME,
        MAX_BUCKET_BYTES,
        PREFIX_BYTES,
        SNAPSHOT_BEGIN,
    )

    embed = torch.arange(40000, dtype=torch.float32).view(200, 200)
    empty = torch.empty(0, 4)
    whole = {"embed.weight": embed, "empty": empty}

    def version(buckets: list[list[Chunk]], v: int = 5, manifest_of: int | None = None) -> bytes:
        if manifest_of is not None or v == 5:
            buckets[0].insert(0, manifest_chunk(v if manifest_of is None else manifest_of, whole))
        return version_frames(v, buckets)

    def patched(offset: int, fmt: str, value: int) -> bytes:  # one bucket of embed whose bytes at `offset` are replaced
        b = craft_bucket(5, 0, 1, [manifest_chunk(5, whole), ("embed.weight", embed, 0, 40000),
                                          ("empty", empty, 0, 0)])
        struct.pack_into(fmt, b, offset, value)
        return frame(SNAPSHOT_BEGIN, 5, 1, b"fake") + frame(BUCKET, 5, 0, b)

    first_entry = PREFIX_BYTES + 2 + len(MANIFEST_NAME)  # the manifest's entry comes first: its dtype code, rank
    in_order = [craft_bucket(5, k, 2, c) for k, c in
                enumerate([[manifest_chunk(5, whole), ("embed.weight", embed, 0, 20000), ("empty", empty, 0, 0)],
                           [("embed.weight", embed, 20000, 20000)]])]
    bad_checksum = bytearray(frame(BUCKET, 5, 0, in_order[0]))
    struct.pack_into("<Q", bad_checksum, struct.calcsize("<IHHqQ"), 12345)  # the header's checksum field
    return [
        ("first half twice", version([[("embed.weight", embed, 0, 20000), ("empty", empty, 0, 0)],
                                      [("embed.weight", embed, 0, 20000)]]),
         ["version 5", "'embed.weight'", "elements [0, 20000) arrived twice"]),
        ("a gap", version([[("embed.weight", embed, 0, 20000), ("empty", empty, 0, 0)],
                           [("embed.weight", embed, 30000, 10000)]]),
         ["version 5", "'embed.weight'", "elements [20000, 30000) never did"]),
        ("a chunk beyond its tensor", version([[("embed.weight", embed, 30000, 20000)]]),
         ["version 5", "'embed.weight'", "lies outside"]),
        ("an empty tensor twice", version([[("embed.weight", embed, 0, 40000), ("empty", empty, 0, 0)],
                                           [("empty", empty, 0, 0)]]),
         ["version 5", "'empty'", "the empty tensor arrived twice"]),
        ("two shapes", version([[("embed.weight", embed, 0, 20000), ("empty", empty, 0, 0)],
                                [("embed.weight", embed.view(-1), 20000, 20000)]]),
         ["version 5", "'embed.weight' arrived with two different shapes or dtypes"]),
        ("the manifest of another version", version([[("embed.weight", embed, 0, 40000), ("empty", empty, 0, 0)]],
                                                    v=2, manifest_of=7),
         ["version 2 carries the manifest of version 7"]),
        ("no manifest", version_frames(3, [[("embed.weight", embed, 0, 40000), ("empty", empty, 0, 0)]]),
         ["version 3 does not start with its manifest"]),
        ("bad bucket magic", patched(0, "<I", 0x12345678), ["version 5", "bad magic number (not a weight bucket)"]),
        ("unknown dtype code", patched(first_entry, "<B", 99), ["version 5", "has unknown dtype code 99"]),
        ("negative dimension", patched(first_entry + 2, "<q", -3), ["version 5", "has a negative dimension"]),
        ("buckets out of order", frame(SNAPSHOT_BEGIN, 5, 2, b"fake") + frame(BUCKET, 5, 1, in_order[1])
         + frame(BUCKET, 5, 0, in_order[0]),
         ["version 5", "weight bucket out of order", "bucket 1 of 2 of version 5", "bucket 0 of 2 of version 5"]),
        ("a corrupted frame", frame(SNAPSHOT_BEGIN, 5, 2, b"fake") + bytes(bad_checksum),
         ["a frame whose checksum does not match its payload (corrupted in transit)"]),
        ("a version of no buckets", frame(SNAPSHOT_BEGIN, 5, 0, b"fake"), ["a version of 0 buckets"]),
        ("a bucket beyond max_bucket_bytes", frame(SNAPSHOT_BEGIN, 5, 1, b"fake")
         + HEADER.pack(FRAME_MAGIC, BUCKET, 0, 5, 2 * MAX_BUCKET_BYTES, 0, 0),
         [f"a bucket frame of {2 * MAX_BUCKET_BYTES} bytes (at most {MAX_BUCKET_BYTES} allowed here)"]),
        ("many empty tensors", version_frames(9, [empty_tensors(k * 150000, 150000) for k in range(4)], tight=True),
         ["version 9", "too many entries or tensors for their bytes"]),
        ("more entries than their bytes allow",
         version_frames(4, [empty_tensors(0, 400000)], tight=True),
         ["version 4", "its 400000 entries would make this receiver hold",
          "too many entries or tensors for their bytes"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.package))  # before frame_support and the cases import fsdpx_sync
    os.makedirs(args.out, exist_ok=True)
    index = []
    for n, (name, data, expected) in enumerate(cases()):
        path = f"case{n:02d}.bin"
        with open(os.path.join(args.out, path), "wb") as f:
            f.write(data)
        index.append({"name": name, "frames": path, "expected": expected})
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(index, f, indent=1)
    print(f"receiver_cases: {len(index)} cases in {args.out}")


if __name__ == "__main__":
    main()
