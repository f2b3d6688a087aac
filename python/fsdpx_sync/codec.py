"""The receiver's kernels for a delta's payloads (docs/sync.md, "Delta versions and proof of arrival"):
a sparse entry's indices and values (sizes, range and order checked), and an xor entry's zlib stream
(inflated a piece at a time, never beyond its tensor) XORed into the tensor. On the host with numpy
where it is (one thread, no pool), else with torch, on any device.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Union

import torch

from .checksum import tensor_bytes
from .manifest import ManifestEntry

_np: ModuleType | None  # numpy, or None (torch does without it; tests set it to None)
try:
    import numpy

    _np = numpy
except ImportError:
    _np = None

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STREAM_IN = 256 << 10  # an xor stream is read in pieces of this many bytes,
_STREAM_OUT = 4 << 20  # and inflated and XORed in pieces of at most this many
_U64 = (1 << 64) - 1
_UINT32 = getattr(torch, "uint32", None)  # torch >= 2.3: 4-byte indices widened in one step
SparseParts = Union[tuple[torch.Tensor, torch.Tensor], str]  # a sparse payload's indices and values, or why not


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements, flat, as the integer dtype of its element size: the bits that
    are compared, moved and XORed as they are (a view, no copy)."""
    return t.reshape(-1).view(_BITS[t.element_size()])



def numpy_of(t: torch.Tensor) -> Any:
    """A numpy view of a host tensor (writes land in it), or None (on a device, or without numpy)."""
    if _np is None or t.device.type != "cpu":
        return None
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


class StreamError(Exception):
    """Why an xor stream is refused."""


def inflate(payload: torch.Tensor, n: int) -> Iterator[bytes]:
    """The pieces a zlib stream (RFC 1950) inflates to, in order, when it inflates to exactly ``n``
    bytes and ends there; raises StreamError otherwise (after the pieces it did yield). Never produces
    more than ``n`` bytes whatever the stream says (one that would inflate beyond the tensor is refused
    at its first byte too many); reads its input, and yields its output, a piece at a time."""
    d = zlib.decompressobj()
    src = tensor_bytes(payload)
    pos, got = 0, 0
    pending: bytes | memoryview = b""

    def more() -> bool:
        nonlocal pending, pos
        if not pending:
            if pos >= len(src):
                return False
            pending = src[pos : pos + _STREAM_IN]
            pos += len(pending)
        return True

    try:
        while got < n and not d.eof and more():
            piece = d.decompress(pending, min(n - got, _STREAM_OUT))  # never 0: that means "no limit"
            pending = d.unconsumed_tail
            if piece:
                got += len(piece)
                yield piece
        while got == n and not d.eof and more():
            # The tensor is full: the stream must end here (its end marker and checksum may remain).
            if d.decompress(pending, 1):
                raise StreamError(f"the stream inflates beyond the tensor's {n} bytes")
            pending = d.unconsumed_tail
    except zlib.error as e:
        raise StreamError(f"not a valid zlib stream ({e})") from None
    if not d.eof:
        raise StreamError(f"the stream is truncated: it ends after {got} of the tensor's {n} bytes, unfinished")
    if got != n:
        raise StreamError(f"the stream inflates to {got} bytes, the tensor has {n}")
    trailing = len(d.unused_data) + len(pending) + len(src) - pos
    if trailing:
        raise StreamError(f"{trailing} bytes follow the end of the stream")


def xor_stream(target: torch.Tensor, payload: torch.Tensor, limit: int | None = None) -> str:
    """XORs what an xor entry's stream inflates to into a contiguous tensor, a piece at a time (no copy
    of the whole tensor's bits is held). Returns "" once the stream proved whole (exactly the tensor's
    bytes, ended, its checksum right); otherwise why, with the tensor as it was: the pieces already
    XORed are XORed again (inflated again: the same stream yields the same first bytes). ``limit``:
    only the first ``limit`` bytes, unchecked (that undo)."""
    flat = target.reshape(-1).view(torch.uint8)
    n = flat.numel() if limit is None else limit
    host = numpy_of(flat)  # on the host, numpy XORs each piece in place (no thread pool for a few MiB)
    np = _np
    at = 0
    try:
        for piece in inflate(payload, flat.numel()):
            if at + len(piece) > n:
                piece = piece[: n - at]
            if piece and host is not None and np is not None:
                part = host[at : at + len(piece)]
                np.bitwise_xor(part, np.frombuffer(piece, dtype=np.uint8), out=part)
            elif piece:
                with warnings.catch_warnings():  # read only: zlib's bytes are not copied again
                    warnings.simplefilter("ignore", UserWarning)
                    bits = torch.frombuffer(piece, dtype=torch.uint8)
                flat[at : at + len(piece)].bitwise_xor_(bits.to(flat.device))
            at += len(piece)
            if limit is not None and at >= limit:
                return ""
    except StreamError as e:
        if limit is None and at:
            xor_stream(target, payload, at)
        return str(e)
    return ""


def sparse_parts(payload: torch.Tensor, e: ManifestEntry) -> SparseParts:
    """(indices int64, values in the entry's bits dtype), or why not: sizes, range and order checked, all
    on the host (numpy where it is: one thread, no pool, for what is ~1% of a tensor)."""
    esize = e.element_size
    expected = e.changed * (e.index_bytes + esize)
    if payload.numel() != expected:
        return f"{payload.numel()} bytes where {e.changed} changes take {expected}"
    raw = payload.detach().cpu().contiguous()
    split = e.changed * e.index_bytes
    if _np is not None:
        return _sparse_parts_numpy(_np, raw, split, e)
    return _sparse_parts_torch(raw, split, e)


def _sparse_parts_numpy(np: ModuleType, raw: torch.Tensor, split: int, e: ManifestEntry) -> SparseParts:
    esize = e.element_size
    buf = raw.numpy()
    wire = buf[:split].view("<u4" if e.index_bytes == 4 else "<u8")
    if wire.size > 1:
        bad = wire[1:] <= wire[:-1]
        if bad.any():
            k = int(np.argmax(bad))
            return f"indices do not ascend ({int(wire[k + 1])} after {int(wire[k])})"
    for i in (0, -1):  # ascending: the first and the last in range, all of them are
        if int(wire[i]) >= e.numel:
            return f"index {int(wire[i])} lies outside its {e.numel} elements"
    indices = torch.from_numpy(wire.astype(np.int64))
    values = buf[split:]
    if split % esize:
        values = values.copy()  # an odd count of 4-byte indices before 8-byte values: realigned
    return indices, torch.from_numpy(values).view(_BITS[esize])


def _sparse_parts_torch(raw: torch.Tensor, split: int, e: ManifestEntry) -> SparseParts:
    esize = e.element_size
    if e.index_bytes == 4:
        if _UINT32 is not None:
            indices = raw[:split].view(_UINT32).to(torch.int64)
        else:
            indices = raw[:split].view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    else:
        indices = raw[:split].view(torch.int64)  # unsigned on the wire: beyond 2^63, negative here
    if indices.numel() > 1:
        bad = indices[1:] <= indices[:-1]
        if bool(bad.any()):
            k = int(bad.nonzero()[0])
            return (f"indices do not ascend ({int(indices[k + 1]) & _U64} after "
                    f"{int(indices[k]) & _U64})")
    for i in (0, -1):
        if not 0 <= int(indices[i]) < e.numel:
            return f"index {int(indices[i]) & _U64} lies outside its {e.numel} elements"
    values = raw[split:]
    if split % esize:
        values = values.clone()
    return indices, values.view(_BITS[esize])


def scatter(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """Writes ``values`` at ``indices`` of a flat bits tensor; returns the values it overwrote when
    ``keep``. On the host with numpy's indexing (one thread), on a device with torch's."""
    host = numpy_of(flat)
    if host is not None:
        i = indices.numpy()
        old = torch.from_numpy(host[i]) if keep else None
        host[i] = values.numpy()
        return old
    indices, values = indices.to(flat.device), values.to(flat.device)
    old = flat.index_select(0, indices) if keep else None
    flat.index_copy_(0, indices, values)
    return old


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (copy-on-write)."""
    return t.clone(memory_format=torch.contiguous_format)

