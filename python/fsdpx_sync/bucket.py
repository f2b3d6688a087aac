"""The weight bucket: a self-describing header, then 64-byte-aligned payloads (docs/sync.md,
"The weight bucket"). An entry is a chunk of one tensor: elements [element_offset, element_offset +
numel) of the tensor flattened row-major, at byte_offset from the bucket's start."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import torch

from .checksum import BytesLike
from .errors import SyncError
from .wire import (
    BUCKET_FORMAT,
    BUCKET_MAGIC,
    BUCKET_PREFIX,
    DTYPE_CODES,
    DTYPE_NDIM,
    ENTRY_PLACE,
    HEADER_BOOKKEEPING_FLOOR,
    MAX_NDIM,
    MIN_ENTRY_BYTES,
    NAME_LEN,
    PARSED_ENTRY_BYTES,
    PREFIX_BYTES,
    RANGE_BOOKKEEPING,
    TENSOR_BOOKKEEPING,
    VERSION_BOOKKEEPING_FLOOR,
)

__all__ = ["BUCKET_MAGIC", "BUCKET_FORMAT", "PREFIX_BYTES", "MAX_NDIM", "DTYPES", "ESIZE", "MIN_ENTRY_BYTES",
           "HEADER_BOOKKEEPING_FLOOR", "VERSION_BOOKKEEPING_FLOOR", "PARSED_ENTRY_BYTES", "TENSOR_BOOKKEEPING",
           "RANGE_BOOKKEEPING", "bookkeeping_problem", "Entry", "Bucket", "decode_bucket", "Coverage", "Collector"]

DTYPES: dict[int, torch.dtype] = {code: getattr(torch, name) for name, code in DTYPE_CODES.items()}
ESIZE = {code: torch.empty(0, dtype=dt).element_size() for code, dt in DTYPES.items()}


def bookkeeping_problem(bookkeeping: int, arrived: int, floor: int, what: str) -> str | None:
    """Why `bookkeeping` bytes of bookkeeping are too many after `arrived` bytes with this `floor`, or None."""
    if bookkeeping - arrived <= floor:
        return None
    return (f"{what} would make this receiver hold {bookkeeping} bytes of bookkeeping for {arrived} bytes that "
            f"arrived (at most {floor} more than the bytes): too many entries or tensors for their bytes")




class Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    element_offset: int
    numel: int
    byte_offset: int
    tensor_numel: int
    nbytes: int


@dataclass
class Bucket:
    """A bucket's prefix, checked; its entries are parsed one at a time by entries() (never all held:
    a header of many entries costs what one entry costs)."""

    last: bool
    header_bytes: int
    total_bytes: int
    version: int
    index: int
    count: int
    entry_count: int
    view: memoryview
    where: str

    def fail(self, why: str) -> NoReturn:
        raise SyncError(f"fsdpx: a corrupt weight bucket from {self.where}: {why}")

    def entries(self) -> Iterator[Entry]:
        """Each entry, bounds-checked before it is yielded."""
        view, limit, pos = self.view, self.header_bytes, PREFIX_BYTES

        def need(n: int, what: str) -> None:
            if pos + n > limit:
                self.fail(f"the header ends inside {what} ({limit} header bytes)")

        for _ in range(self.entry_count):
            need(2, "an entry's name length")
            (length,) = NAME_LEN.unpack_from(view, pos)
            pos += 2
            need(length, "an entry's name")
            name = str(view[pos : pos + length], "utf-8", "replace")
            pos += length
            need(2, "an entry's dtype and rank")
            code, ndim = DTYPE_NDIM.unpack_from(view, pos)
            pos += 2
            if code not in DTYPES:
                self.fail(f"entry '{name}' has unknown dtype code {code}")
            if ndim > MAX_NDIM:
                self.fail(f"entry '{name}' has {ndim} dimensions")
            need(8 * ndim + ENTRY_PLACE.size, "an entry's shape and place")
            shape = struct.unpack_from(f"<{ndim}q", view, pos)
            pos += 8 * ndim
            element_offset, numel, byte_offset = ENTRY_PLACE.unpack_from(view, pos)
            pos += ENTRY_PLACE.size
            if any(d < 0 for d in shape):
                self.fail(f"entry '{name}' has a negative dimension")
            tensor_numel = 1
            for d in shape:
                tensor_numel *= d
            esize = ESIZE[code]
            if (numel < 0 or element_offset < 0 or element_offset + numel > tensor_numel
                    or byte_offset < self.header_bytes or byte_offset % esize
                    or byte_offset + numel * esize > self.total_bytes):
                self.fail(f"entry '{name}' (elements {element_offset}+{numel} of {tensor_numel} at byte {byte_offset}) "
                          f"lies outside the bucket of {self.total_bytes} bytes")
            yield Entry(name, DTYPES[code], shape, element_offset, numel, byte_offset, tensor_numel,
                        tensor_numel * esize)


def decode_bucket(data: BytesLike, where: str) -> Bucket:
    """Parses and checks a bucket's prefix; its entries come from Bucket.entries(), each checked."""
    view = memoryview(data).cast("B")
    if len(view) < PREFIX_BYTES:
        raise SyncError(f"fsdpx: a corrupt weight bucket from {where}: it ends inside its prefix ({len(view)} bytes)")
    prefix = BUCKET_PREFIX.unpack_from(view, 0)
    magic, fmt, flags, count_entries, header_bytes, total_bytes, version, index, count = prefix
    b = Bucket(bool(flags & 1), header_bytes, total_bytes, version, index, count, count_entries, view, where)
    if magic != BUCKET_MAGIC:
        b.fail("bad magic number (not a weight bucket)")
    if fmt != BUCKET_FORMAT:
        b.fail(f"format {fmt}, this receiver reads format {BUCKET_FORMAT}")
    if header_bytes > len(view) or header_bytes < PREFIX_BYTES or total_bytes < header_bytes:
        b.fail(f"header size {header_bytes} / total size {total_bytes} inconsistent with {len(view)} bytes available")
    if index >= count:
        b.fail(f"bucket index {index} of {count}")
    if count_entries > (header_bytes - PREFIX_BYTES) // MIN_ENTRY_BYTES:
        b.fail(f"{count_entries} entries cannot fit in a header of {header_bytes} bytes")
    problem = bookkeeping_problem(count_entries * PARSED_ENTRY_BYTES, min(total_bytes, len(view)) - header_bytes,
                                  HEADER_BOOKKEEPING_FLOOR, f"its {count_entries} entries")
    if problem is not None:
        b.fail(problem)
    return b


class Coverage:
    """Which elements of one tensor have arrived: [start, end) ranges in two compact arrays, appended
    as chunks come (a chunk that continues the last range, forwards or backwards, extends it: chunks
    in order keep one range), sorted and checked once at the end, so a chunk costs O(1) whatever the
    order chunks are sent in. A tensor is whole only when every element arrived exactly once: counting
    elements alone would take the first half sent twice for the whole tensor, with its other half
    uninitialised. More elements than the tensor has is an overlap, found at once."""

    __slots__ = ("starts", "ends", "covered", "empty_seen")

    def __init__(self) -> None:
        self.starts, self.ends = array("q"), array("q")
        self.covered, self.empty_seen = 0, False

    def add(self, begin: int, n: int, numel: int) -> str | None:
        """Records elements [begin, begin + n); the reason it cannot, or None."""
        end = begin + n
        if begin < 0 or n < 0 or end > numel:
            return f"elements [{begin}, {begin}+{n}) lie outside its {numel} elements"
        if n == 0:
            if numel != 0:
                return f"an empty chunk at element {begin} of a tensor of {numel} elements"
            if self.empty_seen:
                return "the empty tensor arrived twice"
            self.empty_seen = True
            return None
        starts, ends = self.starts, self.ends
        if starts and ends[-1] == begin:
            ends[-1] = end
        elif starts and starts[-1] == end:
            starts[-1] = begin
        else:
            starts.append(begin)
            ends.append(end)
        self.covered += n
        return self.overlap() if self.covered > numel else None

    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges by start (one sort in C, however many chunks came)."""
        if not self.starts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        starts = torch.frombuffer(self.starts, dtype=torch.int64).clone()  # copies: the arrays may grow later
        ends = torch.frombuffer(self.ends, dtype=torch.int64).clone()
        order = torch.argsort(starts)
        return starts[order], ends[order]

    def overlap(self) -> str | None:
        """The first elements that arrived twice, in words; None when no two ranges overlap. Sorted by
        start, the first overlap lies between neighbours."""
        starts, ends = self._sorted()
        if starts.numel() < 2:
            return None
        twice = (starts[1:] < ends[:-1]).nonzero()
        if twice.numel() == 0:
            return None
        i = int(twice[0, 0])
        a, b = int(starts[i + 1]), min(int(ends[i]), int(ends[i + 1]))
        return (f"elements [{a}, {b}) arrived twice (chunks [{int(starts[i])}, {int(ends[i])}) and [{a}, "
                f"{int(ends[i + 1])}) overlap)")

    def gap(self, numel: int) -> str | None:
        """None when all ``numel`` elements arrived exactly once; else the first elements that arrived
        twice, or the first range that did not arrive."""
        if numel == 0:
            return None if self.empty_seen else "it never arrived"
        twice = self.overlap()
        if twice is not None:
            return twice
        if self.covered == numel:
            return None
        starts, ends = self._sorted()
        previous = torch.cat([torch.zeros(1, dtype=torch.int64), ends])  # where each range's predecessor ends
        holes = (starts > previous[:-1]).nonzero()
        if holes.numel() > 0:
            i = int(holes[0, 0])
            at, until = int(previous[i]), int(starts[i])
        else:
            at, until = int(previous[-1]), numel
        return f"{self.covered} of {numel} elements arrived; elements [{at}, {until}) never did"


class Collector:
    """Assembles whole tensors from chunks; every element of every tensor must arrive exactly once."""

    def __init__(self, max_bytes: int) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.flat: dict[str, torch.Tensor] = {}
        self.received: dict[str, Coverage] = {}
        self.max_bytes, self.allocated = max_bytes, 0  # the tensors' bytes
        self.arrived = self.bookkeeping = 0  # the chunks' bytes accepted; what is held beyond the tensors' bytes

    def _charge_bookkeeping(self, cost: int, what: str) -> None:
        self.bookkeeping += cost
        problem = bookkeeping_problem(self.bookkeeping, self.arrived, VERSION_BOOKKEEPING_FLOOR, what)
        if problem is not None:
            raise SyncError(f"fsdpx: received weights: {problem}")

    def accept(self, e: Entry, bucket: BytesLike) -> None:
        t = self.tensors.get(e.name)
        if t is None:
            if self.allocated + e.nbytes > self.max_bytes:
                raise SyncError(f"fsdpx: received weights: tensor '{e.name}' of {e.nbytes} bytes would take the "
                                f"version beyond max_version_bytes ({self.max_bytes})")
            self.allocated += e.nbytes
            self._charge_bookkeeping(TENSOR_BOOKKEEPING + 2 * len(e.name),  # the name kept twice, as in C++
                                     f"tensor '{e.name}', the {len(self.tensors) + 1}th,")
            try:
                t = self.tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
            except RuntimeError as err:
                raise SyncError(f"fsdpx: received tensor '{e.name}' has an impossible shape {e.shape}: {err}") from err
            self.received[e.name] = Coverage()
            self.flat[e.name] = t.view(-1)
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise SyncError(f"fsdpx: received weights: '{e.name}' arrived with two different shapes or dtypes")
        coverage = self.received[e.name]
        ranges = len(coverage.starts)
        problem = coverage.add(e.element_offset, e.numel, t.numel())
        if problem is not None:
            raise SyncError(f"fsdpx: received weights are not whole: '{e.name}': {problem}")
        self.arrived += e.numel * t.element_size()
        if len(coverage.starts) > ranges:
            self._charge_bookkeeping(RANGE_BOOKKEEPING, f"the chunks of '{e.name}', so scattered,")
        if e.numel:
            chunk = torch.frombuffer(bucket, dtype=e.dtype, count=e.numel, offset=e.byte_offset)
            self.flat[e.name][e.element_offset : e.element_offset + e.numel].copy_(chunk)

    def finish(self) -> list[tuple[str, torch.Tensor]]:
        missing = []
        for n, t in self.tensors.items():
            gap = self.received[n].gap(t.numel())
            if gap is not None:
                missing.append(f"'{n}': {gap}")
        if missing:
            more = f"; and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise SyncError("fsdpx: received weights are not whole (every element of every tensor must arrive exactly "
                            "once): " + "; ".join(missing[:8]) + more)
        return list(self.tensors.items())
