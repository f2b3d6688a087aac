"""CRC-32C (Castagnoli), the checksum of every synchronizer frame and every checkpoint file.

The same function as fsdpx's C++ ``fsdpx::detail::Crc32c``. With ``google-crc32c`` (or ``crc32c``)
installed, their C implementation is used; otherwise a vectorized one in torch: the data is cut into
many equal chunks whose CRCs advance together, one byte position per step, and the chunk CRCs are
then combined pairwise (a CRC is linear over GF(2): appending ``m`` bytes shifts the earlier CRC by a
fixed 32x32 bit matrix).
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Union

import torch

from .wire import CRC32C_POLYNOMIAL as _POLY

BytesLike = Union[bytes, bytearray, memoryview]  # what a frame's payload, or a file's bytes, arrive as
_PIECE = 64 << 10


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (_POLY ^ (c >> 1)) if (c & 1) else (c >> 1)
        table.append(c)
    return table


_TABLE = _make_table()


def _readonly_array(view: memoryview) -> Any:
    """A read-only numpy view of ``view`` (no copy), or None without numpy: the C CRC-32C reads
    read-only buffers only, and a writable buffer would otherwise be copied."""
    try:
        import numpy
    except ImportError:
        return None
    array = numpy.frombuffer(view, dtype=numpy.uint8)
    array.flags.writeable = False
    return array


def _native() -> Callable[[BytesLike], int] | None:
    try:
        import google_crc32c

        def value(data: BytesLike) -> int:
            # It reads only read-only buffers: a writable one is read through a read-only numpy view,
            # or (without numpy) copied a piece at a time, never whole at once (a bucket's copy would
            # double the receiver's memory).
            view = memoryview(data).cast("B")
            if view.readonly:
                return int(google_crc32c.value(view.obj if isinstance(view.obj, bytes) else bytes(view)))
            array = _readonly_array(view)
            if array is not None:
                return int(google_crc32c.value(array))
            crc = 0
            for at in range(0, len(view), _PIECE):
                crc = google_crc32c.extend(crc, bytes(view[at : at + _PIECE]))
            return crc

        return value
    except ImportError:
        pass
    try:
        import crc32c as _c

        return lambda data: int(_c.crc32c(data))
    except ImportError:
        return None


_NATIVE = _native()

# ---- GF(2) linear maps on the 32-bit CRC register, as the images of its 32 bits -----------------


def _apply(columns: Sequence[int], x: int) -> int:
    y, j = 0, 0
    while x:
        if x & 1:
            y ^= columns[j]
        x >>= 1
        j += 1
    return y


def _compose(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """a after b."""
    return [_apply(a, col) for col in b]


_ONE_ZERO_BYTE = [_TABLE[(1 << j) & 0xFF] ^ ((1 << j) >> 8) for j in range(32)]


@functools.lru_cache(maxsize=256)
def _zeros_map(nbytes: int) -> tuple[int, ...]:
    """The map that feeding ``nbytes`` zero bytes applies to the register."""
    result = [1 << j for j in range(32)]
    power = list(_ONE_ZERO_BYTE)
    n = nbytes
    while n:
        if n & 1:
            result = _compose(power, result)
        power = _compose(power, power)
        n >>= 1
    return tuple(result)


@functools.lru_cache(maxsize=64)
def _byte_tables(nbytes: int) -> torch.Tensor:
    """[4, 256] int64: the zeros map of ``nbytes`` applied to each byte of the register."""
    cols = _zeros_map(nbytes)
    out = []
    for k in range(4):
        row = [0] * 256
        for b in range(1, 256):
            low = b & -b
            row[b] = row[b ^ low] ^ cols[8 * k + low.bit_length() - 1]
        out.append(row)
    return torch.tensor(out, dtype=torch.int64)


def _shift(crcs: torch.Tensor, nbytes: int) -> torch.Tensor:
    t = _byte_tables(nbytes)
    return t[0][crcs & 0xFF] ^ t[1][(crcs >> 8) & 0xFF] ^ t[2][(crcs >> 16) & 0xFF] ^ t[3][crcs >> 24]


_TABLE_T = torch.tensor(_TABLE, dtype=torch.int64)


def _raw_chunks(rows: torch.Tensor) -> torch.Tensor:
    """Register after each row (uint8 [n, L], feeding columns left to right), from 0."""
    n, length = rows.shape
    cols = rows.t().contiguous()  # one byte position of every chunk per row: contiguous steps
    state = torch.zeros(n, dtype=torch.int64)
    for i in range(length):
        state = _TABLE_T[(state ^ cols[i]) & 0xFF] ^ (state >> 8)
    return state


def _raw(data: torch.Tensor) -> int:
    """The register after ``data`` (1-D uint8), from 0."""
    n = data.numel()
    if n == 0:
        return 0
    chunk = 64
    while n // chunk > 65536 and chunk < (1 << 16):
        chunk *= 2
    count = n // chunk
    state = 0
    if count:
        crcs = _raw_chunks(data[: count * chunk].view(count, chunk))
        span = chunk
        while crcs.numel() > 1:
            if crcs.numel() % 2:  # a zero chunk in front changes nothing (the register stays 0)
                crcs = torch.cat([torch.zeros(1, dtype=torch.int64), crcs])
            pairs = crcs.view(-1, 2)
            crcs = _shift(pairs[:, 0].contiguous(), span) ^ pairs[:, 1]
            span *= 2
        state = int(crcs[0])
    rest = data[count * chunk :]
    if rest.numel():
        tail = int(_raw_chunks(rest.view(1, -1))[0])
        state = _apply(_zeros_map(rest.numel()), state) ^ tail
    return state


def crc32c(data: BytesLike | torch.Tensor, value: int = 0) -> int:
    """CRC-32C of ``data`` (bytes, bytearray, memoryview or a uint8 tensor), continuing ``value``."""
    if not isinstance(data, torch.Tensor) and _NATIVE is not None and value == 0:
        return _NATIVE(data)
    return crc32c_torch(data, value)


def crc32c_torch(data: BytesLike | torch.Tensor, value: int = 0) -> int:
    """The same, always computed with torch (the fallback; tested against the native one)."""
    if not isinstance(data, torch.Tensor):
        view = memoryview(data).cast("B")
        with warnings.catch_warnings():  # read, never written: a read-only buffer (bytes) is fine
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
    tensor = data.reshape(-1)
    if tensor.dtype != torch.uint8:
        tensor = tensor.view(torch.uint8)
    init = (value ^ 0xFFFFFFFF) & 0xFFFFFFFF
    return _apply(_zeros_map(tensor.numel()), init) ^ _raw(tensor.contiguous()) ^ 0xFFFFFFFF


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, row-major, as a memoryview without a copy (``t`` is made contiguous
    first, which copies only a tensor that is not). The tensor must stay alive while the view is used;
    the view keeps a reference to the array it reads through."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    flat = flat.view(torch.uint8)
    try:
        return flat.numpy().data
    except (ImportError, RuntimeError, TypeError):  # no numpy: the memory itself, the tensor kept alive by the array
        array = (ctypes.c_uint8 * flat.numel()).from_address(flat.data_ptr())
        array._fsdpx_owner = flat  # type: ignore[attr-defined]
        return memoryview(array).cast("B")


def _native_memory() -> Callable[[Any], int] | None:
    """google-crc32c's ``value`` where it reads a ctypes array laid over memory directly (checked once,
    here: it takes only buffers it need not release, which ctypes' arrays are), else None."""
    try:
        import google_crc32c
    except ImportError:
        return None
    probe = b"fsdpx"
    try:
        array = (ctypes.c_char * len(probe)).from_buffer_copy(probe)
        if int(google_crc32c.value(array)) != int(google_crc32c.value(probe)):
            return None
    except (TypeError, ValueError, BufferError):
        return None
    return google_crc32c.value  # type: ignore[no-any-return]


_NATIVE_MEMORY = _native_memory()
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass whose values are not its memory (a DTensor, say)
_STRIDED = torch.strided


@functools.lru_cache(maxsize=1024)
def _bytes_at(nbytes: int) -> Any:
    """The ctypes array type of ``nbytes`` bytes."""
    return ctypes.c_char * nbytes


def tensor_crc32c(t: torch.Tensor) -> int:
    """CRC-32C of a tensor's bytes (row-major, little-endian, in its own dtype), on any device: what a
    version's manifest records for it. With google-crc32c, at memory speed (no copy of a contiguous CPU
    tensor)."""
    if t.numel() == 0:
        return 0
    if (_NATIVE_MEMORY is not None and type(t) in _PLAIN and t.is_cpu and t.layout == _STRIDED
            and t.is_contiguous() and not t.is_neg() and not t.is_conj()):
        # The common case, cheaply: a plain CPU tensor's elements are its memory, in order, from
        # data_ptr() (the tensor is alive while it is read).
        return int(_NATIVE_MEMORY(_bytes_at(t.nbytes).from_address(t.data_ptr())))
    if _NATIVE is not None:
        return _NATIVE(tensor_bytes(t))
    return crc32c_torch(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def implementation() -> str:
    """Which CRC-32C runs: "native" (a C extension) or "torch" (vectorized, slower)."""
    return "native" if _NATIVE is not None else "torch"
