#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_sync (tests/fuzz/corpus/sync): real frames of weight sync, made by the
encoders the Python sync tests use (frame_support.py here, python/fsdpx_sync), each prefixed by the
byte that picks fuzz_sync's reader (0 bucket header, 1 manifest, 2 bytes to the server, 3 bytes to a client).

    .venv/bin/python tests/sync/make_fuzz_seeds.py
"""
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "python"), HERE]

import torch  # noqa: E402

from frame_support import craft_bucket, frame, manifest_chunk, version_frames  # noqa: E402
from fsdpx_sync.manifest import full_manifest  # noqa: E402
from fsdpx_sync.wire import (  # noqa: E402
    AUTH,
    BUCKET,
    FETCH,
    GOODBYE,
    HELLO,
    MAC_BYTES,
    NONCE,
    PROTOCOL,
    PUBLISH_BEGIN,
    PUBLISH_END,
    ROLE_FETCH,
    ROLE_PUBLISH,
    WELCOME,
)

OUT = os.path.join(HERE, "..", "fuzz", "corpus", "sync")


def write(name: str, reader: int, data: bytes) -> None:
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([reader]) + data)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(5, dtype=torch.bfloat16)
    sources = {"w": w, "b": b}
    chunks = [manifest_chunk(3, sources), ("w", w, 0, 12), ("b", b, 0, 5)]
    bucket = craft_bucket(3, 0, 1, chunks)
    split = [craft_bucket(3, 0, 2, chunks[:2]), craft_bucket(3, 1, 2, [("b", b, 0, 3), ("b", b, 3, 2)])]
    write("header_one_bucket", 0, bytes(bucket))
    write("header_first_of_two", 0, bytes(split[0]))
    write("header_split_tensor", 0, bytes(split[1]))
    write("manifest_full", 1, bytes(full_manifest(3, list(sources.items())).encode().numpy().tobytes()))
    write("manifest_empty", 1, bytes(full_manifest(0, []).encode().numpy().tobytes()))
    hello_answer = bytes(NONCE) + bytes(MAC_BYTES)  # no secret: the MAC is not checked
    fetch_base = struct.pack("<II", 0, 0)
    write("server_fetch", 2, frame(AUTH, -1, ROLE_FETCH, hello_answer) + frame(FETCH, -1, 0, fetch_base))
    write("server_fetch_newer", 2, frame(AUTH, -1, ROLE_FETCH, hello_answer) + frame(FETCH, 1, 10, fetch_base + b"run"))
    publish = [frame(AUTH, -1, ROLE_PUBLISH, hello_answer), frame(PUBLISH_BEGIN, 3, 1, b"fuzz-run"),
               frame(BUCKET, 3, 0, bucket), frame(PUBLISH_END, 3, 0), frame(GOODBYE, -1, 0)]
    write("server_publish", 2, b"".join(publish))
    write("server_publish_two_buckets", 2, b"".join(
        [publish[0], frame(PUBLISH_BEGIN, 3, 2, b"fuzz-run")] + [frame(BUCKET, 3, i, s) for i, s in enumerate(split)]
        + [frame(PUBLISH_END, 3, 0)]))
    hello = frame(HELLO, -1, PROTOCOL, bytes(range(NONCE)))
    welcome = frame(WELCOME, -1, ROLE_FETCH, bytes(MAC_BYTES))
    write("client_handshake", 3, hello + welcome)
    write("client_version", 3, hello + welcome + version_frames(3, [chunks]))
    write("client_version_two_buckets", 3, hello + welcome + version_frames(3, [chunks[:2], [("b", b, 0, 5)]]))


if __name__ == "__main__":
    main()
