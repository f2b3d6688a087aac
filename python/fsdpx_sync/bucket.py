"""The weight bucket: a self-describing header, then 64-byte-aligned payloads (docs/sync.md,
"The weight bucket"). An entry is a chunk of one tensor: elements [element_offset, element_offset +
numel) of the tensor flattened row-major, at byte_offset from the bucket's start."""

from __future__ import annotations

import struct
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

import torch

from .checksum import BytesLike
from .errors import LATE_MASK, SyncError, late
from .wire import (
    BUCKET_FORMAT,
    BUCKET_MAGIC,
    BUCKET_PREFIX,
    DTYPE_CODES,
    ENTRY_PLACE,
    HEADER_BOOKKEEPING_FLOOR,
    MAX_NDIM,
    MIN_ENTRY_BYTES,
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
_DTYPE_ESIZE = {dt: ESIZE[code] for code, dt in DTYPES.items()}  # by torch dtype
# An entry's shape of n dimensions and its ENTRY_PLACE, read at once.
_SHAPE_PLACE = [struct.Struct(f"<{n}q" + ENTRY_PLACE.format.lstrip("<")).unpack_from for n in range(MAX_NDIM + 1)]


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
        limit, pos = self.header_bytes, PREFIX_BYTES
        head = self.view
        header_bytes, total_bytes = self.header_bytes, self.total_bytes
        dtypes, esizes, places, place_size = DTYPES, ESIZE, _SHAPE_PLACE, ENTRY_PLACE.size
        new_entry = tuple.__new__  # Entry(...) without its Python-level __new__

        def short(what: str) -> NoReturn:
            self.fail(f"the header ends inside {what} ({limit} header bytes)")

        for _ in range(self.entry_count):
            if pos + 2 > limit:
                short("an entry's name length")
            length = head[pos] | head[pos + 1] << 8  # NAME_LEN
            pos += 2
            if pos + length > limit:
                short("an entry's name")
            name = str(head[pos : pos + length], "utf-8", "replace")
            pos += length
            if pos + 2 > limit:
                short("an entry's dtype and rank")
            code, ndim = head[pos], head[pos + 1]  # DTYPE_NDIM
            pos += 2
            dtype = dtypes.get(code)
            if dtype is None:
                self.fail(f"entry '{name}' has unknown dtype code {code}")
            if ndim > MAX_NDIM:
                self.fail(f"entry '{name}' has {ndim} dimensions")
            if pos + 8 * ndim + place_size > limit:
                short("an entry's shape and place")
            fields = places[ndim](head, pos)  # the shape, then ENTRY_PLACE
            pos += 8 * ndim + place_size
            shape = fields[:ndim]
            element_offset, numel, byte_offset = fields[ndim:]
            tensor_numel = 1
            if ndim:
                if min(shape) < 0:
                    self.fail(f"entry '{name}' has a negative dimension")
                for d in shape:
                    tensor_numel *= d
            esize = esizes[code]
            if (numel < 0 or element_offset < 0 or element_offset + numel > tensor_numel
                    or byte_offset < header_bytes or byte_offset % esize
                    or byte_offset + numel * esize > total_bytes):
                self.fail(f"entry '{name}' (elements {element_offset}+{numel} of {tensor_numel} at byte {byte_offset}) "
                          f"lies outside the bucket of {total_bytes} bytes")
            yield new_entry(Entry, (name, dtype, shape, element_offset, numel, byte_offset, tensor_numel,
                                    tensor_numel * esize))


def _as_dtype(bucket: BytesLike, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The bucket's bytes as a 1-D tensor of ``dtype`` (no copy), and its length; of no elements for a
    bool (a chunk of bools is cloned: that makes each byte 0 or 1, as copying it into a tensor does)."""
    count = 0 if dtype == torch.bool else memoryview(bucket).nbytes // _DTYPE_ESIZE[dtype]
    if count == 0:
        return torch.empty(0, dtype=dtype), 0
    return torch.frombuffer(bucket, dtype=dtype, count=count), count


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
    """Which elements of one tensor have arrived: [start, end) ranges, appended as chunks come (a
    chunk that continues the last range, forwards or backwards, extends it: chunks in order keep one
    range), sorted and checked once at the end, so a chunk costs O(1) whatever the order chunks are
    sent in. The last range is held as two numbers, the ranges before it in two compact arrays made
    only when a second range appears (a tensor that arrives in one chunk, or in order, needs none). A
    tensor is whole only when every element arrived exactly once: counting elements alone would take
    the first half sent twice for the whole tensor, with its other half uninitialised. More elements
    than the tensor has is an overlap, found at once."""

    __slots__ = ("begin", "end", "starts", "ends", "ranges", "covered", "empty_seen")

    def __init__(self) -> None:
        self.begin = self.end = 0  # the last range, when there is one
        self.starts: array[int] | None = None  # the ranges before it, in the order they appeared
        self.ends: array[int] | None = None
        self.ranges = self.covered = 0
        self.empty_seen = False

    @classmethod
    def whole(cls, numel: int) -> Coverage:
        """Elements [0, numel) arrived, in one chunk (numel > 0)."""
        c = cls()
        c.end = c.covered = numel
        c.ranges = 1
        return c

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
        if self.ranges and self.end == begin:
            self.end = end
        elif self.ranges and self.begin == end:
            self.begin = begin
        else:
            if self.ranges:
                if self.starts is None or self.ends is None:
                    self.starts, self.ends = array("q"), array("q")
                self.starts.append(self.begin)
                self.ends.append(self.end)
            self.begin, self.end = begin, end
            self.ranges += 1
        self.covered += n
        return self.overlap() if self.covered > numel else None

    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranges by start (one sort in C, however many chunks came); two ranges at least."""
        assert self.starts is not None and self.ends is not None
        starts = torch.cat([torch.frombuffer(self.starts, dtype=torch.int64), torch.tensor([self.begin])])  # copies
        ends = torch.cat([torch.frombuffer(self.ends, dtype=torch.int64), torch.tensor([self.end])])
        order = torch.argsort(starts)
        return starts[order], ends[order]

    def overlap(self) -> str | None:
        """The first elements that arrived twice, in words; None when no two ranges overlap. Sorted by
        start, the first overlap lies between neighbours. One range never overlaps itself: a chunk
        extends it only where it ends or begins."""
        if self.ranges < 2:
            return None
        starts, ends = self._sorted()
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
        if self.ranges < 2:  # no overlap; one range holds `covered` elements, [begin, end)
            if self.covered == numel:
                return None
            at, until = (0, self.begin) if self.ranges and self.begin > 0 else (self.end, numel)
            return f"{self.covered} of {numel} elements arrived; elements [{at}, {until}) never did"
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
        self.flat: dict[str, torch.Tensor] = {}  # a tensor's 1-D view, made when a chunk of it is copied in
        # Which elements of a tensor arrived; none for a tensor that arrived whole in one chunk (the usual
        # case: made only if another chunk of it comes).
        self.received: dict[str, Coverage] = {}
        self.max_bytes, self.allocated = max_bytes, 0  # the tensors' bytes
        self.arrived = self.bookkeeping = 0  # the chunks' bytes accepted; what is held beyond the tensors' bytes

    def _refuse_bookkeeping(self, what: str) -> NoReturn:
        raise SyncError(f"fsdpx: received weights: "
                        f"{bookkeeping_problem(self.bookkeeping, self.arrived, VERSION_BOOKKEEPING_FLOOR, what)}")

    def _refuse_size(self, e: Entry) -> NoReturn:
        raise SyncError(f"fsdpx: received weights: tensor '{e.name}' of {e.nbytes} bytes would take the "
                        f"version beyond max_version_bytes ({self.max_bytes})")

    def accept(self, e: Entry, bucket: BytesLike) -> None:
        """Takes one chunk of ``bucket``."""
        self.accept_entries((e,), bucket)

    def accept_entries(self, entries: Iterable[Entry], bucket: BytesLike, deadline: float | None = None) -> bool:
        """Takes these chunks of ``bucket`` (a Bucket's entries(), parsed one at a time), in order: True;
        False, the rest neither parsed nor taken, once ``deadline`` (a time.monotonic(), looked at once
        every 1024 entries) passed."""
        tensors, max_bytes, frombuffer = self.tensors, self.max_bytes, torch.frombuffer
        # The bucket as a tensor of each dtype (made once it is needed): a chunk is copied out of it in one
        # step (narrow_copy: a tensor of its own, of exactly the chunk's bytes).
        views: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for n, e in enumerate(entries):
            if deadline is not None and n & 1023 == 1023 and time.monotonic() > deadline:
                return False
            name, numel = e.name, e.numel
            if numel == e.tensor_numel and numel and e.element_offset == 0 and name not in tensors:
                # A new tensor whole in one chunk (the usual case): the checks of _accept, in their
                # order, then one copy.
                nbytes = e.nbytes
                if self.allocated + nbytes > max_bytes:
                    self._refuse_size(e)
                self.allocated += nbytes
                self.bookkeeping += TENSOR_BOOKKEEPING + 2 * len(name)  # the name kept twice, as in C++
                if self.bookkeeping - self.arrived > VERSION_BOOKKEEPING_FLOOR:
                    self._refuse_bookkeeping(f"tensor '{name}', the {len(tensors) + 1}th,")
                self.arrived += nbytes
                self.bookkeeping += RANGE_BOOKKEEPING  # its one range
                if self.bookkeeping - self.arrived > VERSION_BOOKKEEPING_FLOOR:
                    self._refuse_bookkeeping(f"the chunks of '{name}', so scattered,")
                dtype = e.dtype
                view = views.get(dtype)
                if view is None:
                    view = views[dtype] = _as_dtype(bucket, dtype)
                start, skew = divmod(e.byte_offset, _DTYPE_ESIZE[dtype])
                if not skew and start + numel <= view[1]:
                    t = view[0].narrow_copy(0, start, numel)
                else:  # a bool (its clone makes every byte 0 or 1, as the copy of a chunk does)
                    t = frombuffer(bucket, dtype=dtype, count=numel, offset=e.byte_offset).clone()
                tensors[name] = t if len(e.shape) == 1 else t.view(e.shape)
            else:
                self._accept(e, bucket)
        return True

    def _accept(self, e: Entry, bucket: BytesLike) -> None:
        """Takes a chunk of a tensor that is not new, or not whole: its elements' ranges recorded."""
        name = e.name
        t = self.tensors.get(name)
        if t is None:
            if self.allocated + e.nbytes > self.max_bytes:
                self._refuse_size(e)
            self.allocated += e.nbytes
            self.bookkeeping += TENSOR_BOOKKEEPING + 2 * len(name)  # the name kept twice, as in C++
            if self.bookkeeping - self.arrived > VERSION_BOOKKEEPING_FLOOR:
                self._refuse_bookkeeping(f"tensor '{name}', the {len(self.tensors) + 1}th,")
            try:
                t = self.tensors[name] = torch.empty(e.shape, dtype=e.dtype)
            except RuntimeError as err:
                raise SyncError(f"fsdpx: received tensor '{name}' has an impossible shape {e.shape}: {err}") from err
            coverage = self.received[name] = Coverage()
        elif t.shape != e.shape or t.dtype != e.dtype:
            raise SyncError(f"fsdpx: received weights: '{name}' arrived with two different shapes or dtypes")
        else:
            got = self.received.get(name)
            coverage = self.received[name] = Coverage.whole(e.tensor_numel) if got is None else got
        ranges = coverage.ranges
        problem = coverage.add(e.element_offset, e.numel, e.tensor_numel)
        if problem is not None:
            raise SyncError(f"fsdpx: received weights are not whole: '{name}': {problem}")
        self.arrived += e.numel * _DTYPE_ESIZE[e.dtype]
        if coverage.ranges > ranges:
            self.bookkeeping += RANGE_BOOKKEEPING
            if self.bookkeeping - self.arrived > VERSION_BOOKKEEPING_FLOOR:
                self._refuse_bookkeeping(f"the chunks of '{name}', so scattered,")
        if e.numel:
            flat = self.flat.get(name)
            if flat is None:
                flat = self.flat[name] = t.view(-1)
            chunk = torch.frombuffer(bucket, dtype=e.dtype, count=e.numel, offset=e.byte_offset)
            flat[e.element_offset : e.element_offset + e.numel].copy_(chunk)

    def finish(self, deadline: float | None = None) -> list[tuple[str, torch.Tensor]]:
        """The tensors, once every element of every one arrived exactly once; a SyncError naming the
        first few that did not otherwise (FetchLate once ``deadline``, a time.monotonic(), passed)."""
        missing = []
        count = len(self.tensors)
        for n, (name, t) in enumerate(self.tensors.items()):
            if deadline is not None and n & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                raise late("received weights", n, count)
            coverage = self.received.get(name)
            if coverage is None or (coverage.ranges == 1 and coverage.covered == t.numel()):
                continue  # whole in one chunk, or one range of every element
            gap = coverage.gap(t.numel())
            if gap is not None:
                missing.append(f"'{name}': {gap}")
        if missing:
            more = f"; and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise SyncError("fsdpx: received weights are not whole (every element of every tensor must arrive exactly "
                            "once): " + "; ".join(missing[:8]) + more)
        return list(self.tensors.items())
