"""The weight bucket: a self-describing header, then 64-byte-aligned payloads (docs/sync.md,
"The weight bucket"). An entry is a chunk of one tensor: elements [element_offset, element_offset +
numel) of the tensor flattened row-major, at byte_offset from the bucket's start."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from .errors import SyncError

BUCKET_MAGIC = 0x42535846  # "FXSB"
BUCKET_FORMAT = 1
PREFIX_BYTES = 40
MAX_NDIM = 16

DTYPES = {
    1: torch.float32,
    2: torch.float64,
    3: torch.bfloat16,
    4: torch.float16,
    5: torch.int8,
    6: torch.uint8,
    7: torch.int32,
    8: torch.int64,
    9: torch.bool,
}


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    element_offset: int
    numel: int
    byte_offset: int

    @property
    def tensor_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Bucket:
    last: bool
    header_bytes: int
    total_bytes: int
    version: int
    index: int
    count: int
    entries: List[Entry]


class _Reader:
    def __init__(self, data: memoryview, limit: int, where: str):
        self.data, self.pos, self.limit, self.where = data, 0, limit, where

    def fail(self, why: str):
        raise SyncError(f"fsdpx: a corrupt weight bucket from {self.where}: {why}")

    def get(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.pos + size > self.limit:
            self.fail(f"it ends inside {what}")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def get_bytes(self, n: int, what: str) -> bytes:
        if self.pos + n > self.limit:
            self.fail(f"it ends inside {what}")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out


def decode_bucket(data, where: str) -> Bucket:
    """Parses and checks a bucket's header; every field is bounds-checked before it is used."""
    view = memoryview(data).cast("B")
    r = _Reader(view, len(view), where)
    if r.get("<I", "the magic number") != BUCKET_MAGIC:
        r.fail("bad magic number (not a weight bucket)")
    fmt = r.get("<H", "the format")
    if fmt != BUCKET_FORMAT:
        r.fail(f"format {fmt}, this receiver reads format {BUCKET_FORMAT}")
    last = bool(r.get("<H", "the flags") & 1)
    count_entries = r.get("<I", "the entry count")
    header_bytes = r.get("<I", "the header size")
    total_bytes = r.get("<Q", "the total size")
    version = r.get("<q", "the version")
    index = r.get("<I", "the bucket index")
    count = r.get("<I", "the bucket count")
    if header_bytes > len(view) or header_bytes < PREFIX_BYTES or total_bytes < header_bytes:
        r.fail(f"header size {header_bytes} / total size {total_bytes} inconsistent with {len(view)} bytes available")
    if index >= count:
        r.fail(f"bucket index {index} of {count}")
    body = _Reader(view, header_bytes, where)
    body.pos = PREFIX_BYTES
    entries = []
    for _ in range(count_entries):  # each entry takes bytes of the header: a lying count runs out
        name = body.get_bytes(body.get("<H", "an entry's name length"), "an entry's name").decode("utf-8", "replace")
        code = body.get("<B", "an entry's dtype")
        if code not in DTYPES:
            body.fail(f"entry '{name}' has unknown dtype code {code}")
        ndim = body.get("<B", "an entry's rank")
        if ndim > MAX_NDIM:
            body.fail(f"entry '{name}' has {ndim} dimensions")
        shape = tuple(body.get("<q", "an entry's shape") for _ in range(ndim))
        if any(d < 0 for d in shape):
            body.fail(f"entry '{name}' has a negative dimension")
        e = Entry(name, DTYPES[code], shape, body.get("<q", "an entry's element offset"),
                  body.get("<q", "an entry's element count"), body.get("<Q", "an entry's byte offset"))
        esize = torch.empty(0, dtype=e.dtype).element_size()
        if (e.numel < 0 or e.element_offset < 0 or e.element_offset + e.numel > e.tensor_numel
                or e.byte_offset < header_bytes or e.byte_offset % esize or e.byte_offset + e.numel * esize > total_bytes):
            body.fail(f"entry '{name}' (elements {e.element_offset}+{e.numel} of {e.tensor_numel} at byte "
                      f"{e.byte_offset}) lies outside the bucket of {total_bytes} bytes")
        entries.append(e)
    return Bucket(last, header_bytes, total_bytes, version, index, count, entries)


class Collector:
    """Assembles whole tensors from chunks; every tensor must arrive whole, each element once."""

    def __init__(self, max_bytes: int):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.received: Dict[str, int] = {}
        self.max_bytes, self.allocated = max_bytes, 0

    def accept(self, e: Entry, bucket: bytearray):
        t = self.tensors.get(e.name)
        if t is None:
            nbytes = e.tensor_numel * torch.empty(0, dtype=e.dtype).element_size()
            cost = nbytes + 256 + len(e.name)  # bookkeeping too: many empty tensors are not free
            if self.allocated + cost > self.max_bytes:
                raise SyncError(f"fsdpx: received tensor '{e.name}' of {nbytes} bytes exceeds max_version_bytes "
                                f"({self.max_bytes})")
            self.allocated += cost
            try:
                t = self.tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
            except RuntimeError as err:
                raise SyncError(f"fsdpx: received tensor '{e.name}' has an impossible shape {e.shape}: {err}") from err
            self.received[e.name] = 0
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise SyncError(f"fsdpx: '{e.name}' arrived with two different shapes or dtypes")
        if e.numel:
            chunk = torch.frombuffer(bucket, dtype=e.dtype, count=e.numel, offset=e.byte_offset)
            t.view(-1)[e.element_offset : e.element_offset + e.numel].copy_(chunk)
        self.received[e.name] += e.numel

    def finish(self) -> List[Tuple[str, torch.Tensor]]:
        missing = [f"'{n}' arrived with {self.received[n]} of {t.numel()} elements"
                   for n, t in self.tensors.items() if self.received[n] != t.numel()]
        if missing:
            raise SyncError("fsdpx: received weights are incomplete: " + "; ".join(missing[:8]))
        return list(self.tensors.items())
