"""Delta versions and proof of arrival (docs/sync.md, "Delta versions and proof of arrival").

Every version, full or delta, starts with a manifest (the tensor ``.fsdpx.manifest``, uint8): each
tensor's name, dtype, shape, the CRC-32C of its final bytes and how it travels (unchanged, sparse
indices and values, full, or a zlib stream of its bits XOR the base's), and a digest over all of them.
A receiver holds version V exactly when its tensors' CRCs are the manifest's.

Both ends of a sync hold a ``VersionStore``: the publisher cuts the next version against it
(``cut`` / ``commit``: the encoder, for tests and Python publishers), the receiver applies the next one
to it (``accept``: every size, index and stream checked, every written tensor's CRC compared, anything
applied undone on a failure). ``verify`` answers "do I hold version V exactly" for a module or tensors.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .bucket import DTYPES, ESIZE, MAX_NDIM, VERSION_BOOKKEEPING_FLOOR, bookkeeping_problem
from .checksum import crc32c, tensor_bytes, tensor_crc32c
from .errors import SyncError

MANIFEST_NAME = ".fsdpx.manifest"
MANIFEST_MAGIC = 0x4D535846  # "FXSM"
MANIFEST_FORMAT = 1
UNCHANGED, SPARSE, FULL, XOR = 0, 1, 2, 3
ENCODING_NAMES = {UNCHANGED: "unchanged", SPARSE: "sparse", FULL: "full", XOR: "xor"}
_ENCODING_CODES = {v: k for k, v in ENCODING_NAMES.items()}

_PREFIX = struct.Struct("<IHHqqIIIIQ")  # magic, format, flags, version, base, base digest, digest, count, 0, 0
_TAIL = struct.Struct("<BBHIq")  # encoding, index bytes, zero, crc, changed
_NAME_LEN = struct.Struct("<H")
_DTYPE_NDIM = struct.Struct("<BB")
# An entry's fixed fields: a count the bytes cannot hold is refused before anything is parsed.
MIN_ENTRY_BYTES = 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8
MANIFEST_ENTRY_BOOKKEEPING = 512  # a decoded entry, its name and its place in the name set (about 275 in Python)
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT64_MAX = (1 << 63) - 1
_STREAM_IN = 256 << 10  # an xor stream is read in pieces of this many bytes,
_STREAM_OUT = 4 << 20  # and inflated and XORed in pieces of at most this many
_U64 = (1 << 64) - 1
_UINT32 = getattr(torch, "uint32", None)  # torch >= 2.3: 4-byte indices widened in one step


def dtype_code(dtype: torch.dtype, name: str = "") -> int:
    code = _CODES.get(dtype)
    if code is None:
        raise SyncError(f"fsdpx: tensor '{name}' of dtype {dtype} cannot travel (the bucket's dtypes: "
                        f"{', '.join(str(d).replace('torch.', '') for d in DTYPES.values())})")
    return code


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements, flat, as the integer dtype of its element size: the bits that
    are compared, moved and XORed as they are (a view, no copy)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


@dataclass
class ManifestEntry:
    """One tensor of a version: what the receiver holds after it, and how it travels."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    encoding: int = FULL
    index_bytes: int = 0
    crc: int = 0
    changed: int = -1  # elements whose bits differ from the base; -1 in a full version

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def element_size(self) -> int:
        return ESIZE[dtype_code(self.dtype, self.name)]

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    @property
    def encoding_name(self) -> str:
        return ENCODING_NAMES.get(self.encoding, str(self.encoding))

    def identity(self) -> bytes:
        """``u16 name length, name, u8 dtype, u8 ndim, i64 shape[ndim]``: what the digest covers with the CRC."""
        name = self.name.encode()
        if len(name) >= 1 << 16 or len(self.shape) > MAX_NDIM:
            raise SyncError(f"fsdpx: tensor '{self.name}' cannot travel (a name of {len(name)} bytes, "
                            f"{len(self.shape)} dimensions)")
        return (_NAME_LEN.pack(len(name)) + name + _DTYPE_NDIM.pack(dtype_code(self.dtype, self.name), len(self.shape))
                + struct.pack(f"<{len(self.shape)}q", *self.shape))


@dataclass
class Manifest:
    """What a version must be: its tensors (names, dtypes, shapes, CRC-32Cs, in order) and, for a
    delta, the version it was cut from (``base_version``, ``base_digest``)."""

    version: int
    entries: List[ManifestEntry] = field(default_factory=list)
    base_version: int = -1
    base_digest: int = 0
    digest: int = 0

    @property
    def is_delta(self) -> bool:
        return self.base_version != -1

    @property
    def names(self) -> List[str]:
        return [e.name for e in self.entries]

    @property
    def checksums(self) -> Dict[str, int]:
        """name -> CRC-32C of the tensor's final bytes."""
        return {e.name: e.crc for e in self.entries}

    def index(self) -> Dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}

    def compute_digest(self) -> int:
        """CRC-32C over every entry's name, dtype, shape and CRC, in order: one number for the version."""
        records = bytearray()
        for e in self.entries:
            records += e.identity() + struct.pack("<I", e.crc)
        return crc32c(bytes(records))

    def encode(self) -> torch.Tensor:
        """The manifest tensor (1-D uint8) as it travels."""
        out = bytearray(_PREFIX.pack(MANIFEST_MAGIC, MANIFEST_FORMAT, 1 if self.is_delta else 0, self.version,
                                     self.base_version, self.base_digest, self.digest, len(self.entries), 0, 0))
        for e in self.entries:
            out += e.identity() + _TAIL.pack(e.encoding, e.index_bytes, 0, e.crc, e.changed)
        return torch.frombuffer(out, dtype=torch.uint8).clone()

    @classmethod
    def decode(cls, data, where: str = "the sender") -> "Manifest":
        """Parses and checks a manifest (a uint8 tensor, or bytes): every field bounds-checked before it
        is read, counts bounded by the bytes, shapes checked for overflow, unknown codes refused, and the
        digest recomputed. A SyncError naming the manifest (and the tensor) otherwise."""
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or data.dim() != 1:
                raise SyncError(f"fsdpx: the manifest from {where} is not a 1-D uint8 tensor "
                                f"({data.dtype}, {tuple(data.shape)})")
            view = tensor_bytes(data)
        else:
            view = memoryview(data).cast("B")
        size = len(view)
        pos = 0

        def fail(why: str):
            raise SyncError(f"fsdpx: the manifest ('{MANIFEST_NAME}') from {where} is corrupt: {why}")

        def need(n: int, what: str):
            if pos + n > size:
                fail(f"it ends inside {what} (at byte {pos} of {size})")

        need(_PREFIX.size, "its prefix")
        magic, fmt, flags, version, base_version, base_digest, digest, count, _, _ = _PREFIX.unpack_from(view, 0)
        pos = _PREFIX.size
        if magic != MANIFEST_MAGIC:
            fail("bad magic number (not a manifest)")
        if fmt != MANIFEST_FORMAT:
            fail(f"format {fmt}, this receiver reads format {MANIFEST_FORMAT}")
        delta = bool(flags & 1)
        if version < 0 or delta != (base_version != -1) or (delta and base_version < 0):
            fail(f"version {version} with base {base_version} ({'a delta' if delta else 'full'})")
        if count > (size - _PREFIX.size) // MIN_ENTRY_BYTES:
            fail(f"{count} tensors cannot fit in {size} bytes")
        problem = bookkeeping_problem(count * MANIFEST_ENTRY_BOOKKEEPING, size, VERSION_BOOKKEEPING_FLOOR,
                                      f"its {count} entries")
        if problem is not None:
            fail(problem)
        m = cls(version, [], base_version, base_digest, digest)
        seen = set()
        for _ in range(count):
            need(2, "a name's length")
            (length,) = _NAME_LEN.unpack_from(view, pos)
            pos += 2
            need(length, "a name")
            try:
                name = str(view[pos : pos + length], "utf-8")
            except UnicodeDecodeError:
                fail(f"a name of {length} bytes at byte {pos} is not UTF-8")
            pos += length
            need(2, f"the dtype and rank of '{name}'")
            code, ndim = _DTYPE_NDIM.unpack_from(view, pos)
            pos += 2
            if code not in DTYPES:
                fail(f"tensor '{name}' has unknown dtype code {code}")
            if ndim > MAX_NDIM:
                fail(f"tensor '{name}' has {ndim} dimensions (at most {MAX_NDIM})")
            need(8 * ndim + _TAIL.size, f"the shape and encoding of '{name}'")
            shape = struct.unpack_from(f"<{ndim}q", view, pos)
            pos += 8 * ndim
            numel = 1
            for d in shape:
                numel *= d
                if d < 0 or numel > _INT64_MAX:
                    fail(f"tensor '{name}' has a negative or overflowing shape {shape}")
            if numel * ESIZE[code] > _INT64_MAX:
                fail(f"tensor '{name}' has an overflowing size")
            encoding, index_bytes, _, crc, changed = _TAIL.unpack_from(view, pos)
            pos += _TAIL.size
            if encoding not in ENCODING_NAMES:
                fail(f"tensor '{name}' has unknown encoding {encoding}")
            if not delta and encoding != FULL:
                fail(f"tensor '{name}' is {ENCODING_NAMES[encoding]} in a full version")
            if encoding == SPARSE and (index_bytes not in (4, 8) or (index_bytes == 4 and numel > 1 << 32)):
                fail(f"tensor '{name}' of {numel} elements has {index_bytes}-byte indices")
            if changed < -1 or changed > numel or (encoding == SPARSE and changed < 1):
                fail(f"tensor '{name}' of {numel} elements says {changed} changed")
            if name in seen:
                fail(f"tensor '{name}' is listed twice")
            seen.add(name)
            m.entries.append(ManifestEntry(name, DTYPES[code], tuple(shape), encoding, index_bytes, crc, changed))
        if pos != size:
            fail(f"{size - pos} bytes follow the last of its {count} entries")
        if m.compute_digest() != digest:
            fail("its digest does not match its entries (corrupted, or made wrongly)")
        return m


def full_manifest(version: int, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> Manifest:
    """The manifest of a full version of these tensors (every CRC-32C computed)."""
    m = Manifest(version)
    for name, t in named_tensors:
        dtype_code(t.dtype, name)
        m.entries.append(ManifestEntry(name, t.dtype, tuple(t.shape), FULL, 0, tensor_crc32c(t), -1))
    m.digest = m.compute_digest()
    return m


def split_manifest(received: Sequence[Tuple[str, torch.Tensor]], where: str) -> Tuple[Manifest, Dict[str, torch.Tensor]]:
    """A received version's manifest (first, once; checked) and its other tensors by name."""
    if not received or received[0][0] != MANIFEST_NAME:
        raise SyncError(f"fsdpx: a weight version from {where} does not start with its manifest ('{MANIFEST_NAME}'): "
                        "the sender speaks an older protocol (update it), or the version is corrupt")
    m = Manifest.decode(received[0][1], where)
    rest: Dict[str, torch.Tensor] = {}
    for name, t in received[1:]:
        if name == MANIFEST_NAME:
            raise SyncError(f"fsdpx: weight version {m.version} from {where} carries two manifests")
        if name in rest:
            raise SyncError(f"fsdpx: weight version {m.version} from {where}: tensor '{name}' arrived twice")
        rest[name] = t
    return m, rest


# ---- the receiver: decoding and applying, undone on any failure ------------------------------------


try:
    import numpy as _np
except ImportError:  # torch does without it
    _np = None


def _numpy_of(t: torch.Tensor):
    """A numpy view of a host tensor (writes land in it), or None (on a device, or without numpy)."""
    if _np is None or t.device.type != "cpu":
        return None
    try:
        return t.numpy()
    except (RuntimeError, TypeError):
        return None


class _StreamError(Exception):
    """Why an xor stream is refused."""


def _inflate(payload: torch.Tensor, n: int) -> Iterator[bytes]:
    """The pieces a zlib stream (RFC 1950) inflates to, in order, when it inflates to exactly ``n``
    bytes and ends there; raises _StreamError otherwise (after the pieces it did yield). Never produces
    more than ``n`` bytes whatever the stream says (one that would inflate beyond the tensor is refused
    at its first byte too many); reads its input, and yields its output, a piece at a time."""
    d = zlib.decompressobj()
    src = tensor_bytes(payload)
    pos, got, pending = 0, 0, b""

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
                raise _StreamError(f"the stream inflates beyond the tensor's {n} bytes")
            pending = d.unconsumed_tail
    except zlib.error as e:
        raise _StreamError(f"not a valid zlib stream ({e})") from None
    if not d.eof:
        raise _StreamError(f"the stream is truncated: it ends after {got} of the tensor's {n} bytes, unfinished")
    if got != n:
        raise _StreamError(f"the stream inflates to {got} bytes, the tensor has {n}")
    trailing = len(d.unused_data) + len(pending) + len(src) - pos
    if trailing:
        raise _StreamError(f"{trailing} bytes follow the end of the stream")


def _xor_stream(target: torch.Tensor, payload: torch.Tensor, limit: Optional[int] = None) -> str:
    """XORs what an xor entry's stream inflates to into a contiguous tensor, a piece at a time (no copy
    of the whole tensor's bits is held). Returns "" once the stream proved whole (exactly the tensor's
    bytes, ended, its checksum right); otherwise why, with the tensor as it was: the pieces already
    XORed are XORed again (inflated again: the same stream yields the same first bytes). ``limit``:
    only the first ``limit`` bytes, unchecked (that undo)."""
    flat = target.reshape(-1).view(torch.uint8)
    n = flat.numel() if limit is None else limit
    host = _numpy_of(flat)  # on the host, numpy XORs each piece in place (no thread pool for a few MiB)
    at = 0
    try:
        for piece in _inflate(payload, flat.numel()):
            if at + len(piece) > n:
                piece = piece[: n - at]
            if piece and host is not None:
                part = host[at : at + len(piece)]
                _np.bitwise_xor(part, _np.frombuffer(piece, dtype=_np.uint8), out=part)
            elif piece:
                with warnings.catch_warnings():  # read only: zlib's bytes are not copied again
                    warnings.simplefilter("ignore", UserWarning)
                    bits = torch.frombuffer(piece, dtype=torch.uint8)
                flat[at : at + len(piece)].bitwise_xor_(bits.to(flat.device))
            at += len(piece)
            if limit is not None and at >= limit:
                return ""
    except _StreamError as e:
        if limit is None and at:
            _xor_stream(target, payload, at)
        return str(e)
    return ""


def _sparse_parts(payload: torch.Tensor, e: ManifestEntry) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], str]:
    """(indices int64, values in the entry's bits dtype, "") or (None, None, why): sizes, range and
    order checked, all on the host (numpy where it is: one thread, no pool, for what is ~1% of a tensor)."""
    esize = e.element_size
    expected = e.changed * (e.index_bytes + esize)
    if payload.numel() != expected:
        return None, None, f"{payload.numel()} bytes where {e.changed} changes take {expected}"
    raw = payload.detach().cpu().contiguous()
    split = e.changed * e.index_bytes
    if _np is not None:
        buf = raw.numpy()
        wire = buf[:split].view("<u4" if e.index_bytes == 4 else "<u8")
        if wire.size > 1:
            bad = wire[1:] <= wire[:-1]
            if bad.any():
                k = int(_np.argmax(bad))
                return None, None, f"indices do not ascend ({int(wire[k + 1])} after {int(wire[k])})"
        for i in (0, -1):  # ascending: the first and the last in range, all of them are
            if int(wire[i]) >= e.numel:
                return None, None, f"index {int(wire[i])} lies outside its {e.numel} elements"
        indices = torch.from_numpy(wire.astype(_np.int64))
        values = buf[split:]
        if split % esize:
            values = values.copy()  # an odd count of 4-byte indices before 8-byte values: realigned
        return indices, torch.from_numpy(values).view(_BITS[esize]), ""
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
            return None, None, (f"indices do not ascend ({int(indices[k + 1]) & _U64} after "
                                f"{int(indices[k]) & _U64})")
    for i in (0, -1):
        if not 0 <= int(indices[i]) < e.numel:
            return None, None, f"index {int(indices[i]) & _U64} lies outside its {e.numel} elements"
    values = raw[split:]
    if split % esize:
        values = values.clone()
    return indices, values.view(_BITS[esize]), ""


def _scatter(flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, keep: bool) -> Optional[torch.Tensor]:
    """Writes ``values`` at ``indices`` of a flat bits tensor; returns the values it overwrote when
    ``keep``. On the host with numpy's indexing (one thread), on a device with torch's."""
    host = _numpy_of(flat)
    if host is not None:
        i = indices.numpy()
        old = torch.from_numpy(host[i]) if keep else None
        host[i] = values.numpy()
        return old
    indices, values = indices.to(flat.device), values.to(flat.device)
    old = flat.index_select(0, indices) if keep else None
    flat.index_copy_(0, indices, values)
    return old


def _copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (copy-on-write)."""
    return t.clone(memory_format=torch.contiguous_format)


@dataclass
class _Undo:
    index: int
    encoding: int
    saved: Any = None  # sparse: old values; full: the old tensor; xor: the stream (inflated again)
    indices: Optional[torch.Tensor] = None


class VersionStore:
    """The version one end of a sync holds: its manifest and its tensors, in the manifest's order.

    A publisher cuts the next version against it (``cut``, then ``commit`` once it was sent); a receiver
    applies the next one to it (``accept``). Its tensors may be a module's (``adopt``): deltas then land
    in the module, in place."""

    def __init__(self):
        self.manifest: Optional[Manifest] = None
        self.tensors: List[torch.Tensor] = []

    @property
    def empty(self) -> bool:
        return self.manifest is None

    @property
    def version(self) -> int:
        return -1 if self.manifest is None else self.manifest.version

    @property
    def digest(self) -> int:
        return 0 if self.manifest is None else self.manifest.digest

    def holds(self, version: int, digest: int) -> bool:
        return self.manifest is not None and self.manifest.version == version and self.manifest.digest == digest

    def named(self) -> List[Tuple[str, torch.Tensor]]:
        return [] if self.manifest is None else list(zip(self.manifest.names, self.tensors))

    def clear(self):
        self.manifest, self.tensors = None, []

    def adopt(self, named_tensors: Sequence[Tuple[str, torch.Tensor]], manifest: Manifest):
        """Holds these tensors (a module's, say, after a full version was loaded into them) as version
        ``manifest``: they must have its names, dtypes and shapes, in order, and be contiguous. Their
        bytes are not read again (``verify`` does)."""
        if len(named_tensors) != len(manifest.entries):
            raise SyncError(f"fsdpx: {len(named_tensors)} tensors cannot hold version {manifest.version} of "
                            f"{len(manifest.entries)}")
        held = []
        for (name, t), e in zip(named_tensors, manifest.entries):
            if name != e.name or t.dtype != e.dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
                raise SyncError(f"fsdpx: tensor '{name}' ({t.dtype}, {tuple(t.shape)}) cannot hold '{e.name}' of version "
                                f"{manifest.version} ({e.dtype}, {e.shape}, contiguous)")
            held.append(t.detach())
        self.tensors, self.manifest = held, manifest

    # ---- the receiver -----------------------------------------------------------------------------

    def accept(self, received: Sequence[Tuple[str, torch.Tensor]], *, in_place: bool = False,
               where: str = "the sender") -> List[str]:
        """Takes a received version (its tensors as they arrived, the manifest first). A full version
        replaces what is held (every tensor's dtype, shape and CRC-32C checked against the manifest, none
        missing, none extra); a delta is applied to what is held, only if that is its base (version and
        digest). ``in_place``: the held tensors are written (a module's); else copy-on-write: a tensor
        the delta touches is cloned, then written, so tensors handed out before never change.

        Returns the names the version changed (every name for a full version). Any failure is a
        SyncError naming the tensor, and the store (and in place, its tensors) keeps what it held, bit
        for bit."""
        m, rest = split_manifest(received, where)

        def fail(why: str):
            raise SyncError(f"fsdpx: weight version {m.version} from {where}: {why}")

        listed = m.index()
        for name in rest:
            e = listed.get(name)
            if e is None or e.encoding == UNCHANGED:
                fail(f"tensor '{name}' arrived but its manifest {'says it is unchanged' if e else 'does not list it'}")
        with torch.no_grad():
            if not m.is_delta:
                held = []
                for e in m.entries:
                    t = rest.get(e.name)
                    if t is None:
                        fail(f"tensor '{e.name}' never arrived (its manifest lists it)")
                    if t.dtype != e.dtype or tuple(t.shape) != e.shape:
                        fail(f"tensor '{e.name}' arrived as {t.dtype} {tuple(t.shape)}, its manifest says {e.dtype} {e.shape}")
                    if tensor_crc32c(t) != e.crc:
                        fail(f"tensor '{e.name}' does not match its checksum (CRC-32C) in the manifest: it was corrupted "
                             "on the way or made wrongly")
                    held.append(t.contiguous())
                self.tensors, self.manifest = held, m
                return m.names
            return self._apply_delta(m, rest, in_place, fail)

    def _apply_delta(self, m: Manifest, rest: Dict[str, torch.Tensor], in_place: bool, fail) -> List[str]:
        base = self.manifest
        if base is None or not self.holds(m.base_version, m.base_digest):
            holding = "no version" if base is None else f"version {base.version} (digest {base.digest:#010x})"
            fail(f"its manifest says it is a delta from version {m.base_version} (digest {m.base_digest:#010x}), but "
                 f"this receiver holds {holding}: nothing was applied")
        if len(base.entries) != len(m.entries):
            fail(f"the delta lists {len(m.entries)} tensors, its base {len(base.entries)}")
        for e, b in zip(m.entries, base.entries):
            if e.name != b.name or e.dtype != b.dtype or e.shape != b.shape:
                fail(f"tensor '{e.name}' ({e.dtype}, {e.shape}) is not tensor '{b.name}' of its base at the same place")
            if e.encoding == UNCHANGED and e.crc != b.crc:
                fail(f"tensor '{e.name}' is unchanged, but its checksum differs from its base's")
            if e.encoding != UNCHANGED and e.name not in rest:
                fail(f"tensor '{e.name}' ({e.encoding_name}) never arrived")
        nxt = list(self.tensors)
        undo: List[_Undo] = []
        changed: List[str] = []
        try:
            for i, e in enumerate(m.entries):
                if e.encoding == UNCHANGED:
                    continue
                payload = rest[e.name]

                def bad(why: str):
                    fail(f"tensor '{e.name}' ({e.encoding_name}): {why}")

                held = self.tensors[i]
                if e.encoding == FULL:
                    if payload.dtype != e.dtype or tuple(payload.shape) != e.shape:
                        bad(f"arrived as {payload.dtype} {tuple(payload.shape)}")
                    if in_place:
                        undo.append(_Undo(i, FULL, held.clone()))
                        held.copy_(payload)
                        target = held
                    else:
                        target = payload.to(held.device).contiguous()
                else:
                    if payload.dtype != torch.uint8 or payload.dim() != 1:
                        bad(f"its payload is {payload.dtype} {tuple(payload.shape)}, not 1-D uint8")
                    if e.encoding == SPARSE:
                        indices, values, why = _sparse_parts(payload, e)
                        if why:
                            bad(why)
                        target = held if in_place else _copy_of(held)
                        old = _scatter(bits_of(target), indices, values, keep=in_place)
                        if in_place:
                            undo.append(_Undo(i, SPARSE, old, indices))
                    else:
                        target = held if in_place else _copy_of(held)
                        why = _xor_stream(target, payload)  # on failure, the target is as it was
                        if why:
                            bad(why)
                        if in_place:
                            undo.append(_Undo(i, XOR, payload))
                if tensor_crc32c(target) != e.crc:
                    bad("the result does not match its checksum (CRC-32C) in the manifest: the delta was corrupted, "
                        "or this receiver's copy of the base was changed since it arrived")
                nxt[i] = target
                changed.append(e.name)
        except BaseException:
            for u in reversed(undo):
                held = self.tensors[u.index]
                if u.encoding == SPARSE:
                    _scatter(bits_of(held), u.indices, u.saved, keep=False)
                elif u.encoding == FULL:
                    held.copy_(u.saved)
                else:
                    _xor_stream(held, u.saved, held.numel() * held.element_size())
            raise
        self.tensors, self.manifest = nxt, m
        return changed

    # ---- the publisher ----------------------------------------------------------------------------

    def cut(self, version: int, named_tensors: Sequence[Tuple[str, torch.Tensor]], *, delta: bool = True,
            zlib_level: int = 1, xor_min_changed: int = 4096,
            force: Union[None, str, Dict[str, str]] = None) -> "EncodedVersion":
        """Encodes ``version`` of these tensors (any device and layout, sent in their own dtypes) against
        the held version: a delta when the store holds one of the same names, dtypes and shapes in the
        same order (and ``delta``), else a full version. Per tensor, the encoding of fewest bytes: sparse
        or full by count; xor when at least ``xor_min_changed`` elements changed, a compressed sample
        says it would win, and the whole, compressed, does. ``force`` ("sparse", "full" or "xor", for
        every changed tensor or by name) overrides the choice for tensors that changed (tests). The
        store does not change: ``commit`` the result once it was sent."""
        m = Manifest(version)
        base = self.manifest
        is_delta = (delta and base is not None and len(base.entries) == len(named_tensors) and version != base.version
                    and all(b.name == n and b.dtype == t.dtype and b.shape == tuple(t.shape)
                            for b, (n, t) in zip(base.entries, named_tensors)))
        if is_delta:
            m.base_version, m.base_digest = base.version, base.digest
        out = EncodedVersion(m, [(MANIFEST_NAME, torch.empty(0, dtype=torch.uint8))], [None] * len(named_tensors))
        for i, (name, tensor) in enumerate(named_tensors):
            t = tensor.detach().to("cpu").contiguous()
            dtype_code(t.dtype, name)
            e = ManifestEntry(name, t.dtype, tuple(t.shape), FULL, 0, tensor_crc32c(t), -1)
            m.entries.append(e)
            full_bytes = t.numel() * t.element_size()
            out.full_bytes += full_bytes
            if not is_delta:
                out.tensors.append((name, t))
                out.finals[i] = t
                continue
            new_bits, old_bits = bits_of(t), bits_of(self.tensors[i])
            indices = (new_bits != old_bits).nonzero().reshape(-1)
            e.changed = indices.numel()
            if e.changed == 0:
                e.encoding = UNCHANGED
                continue
            esize = t.element_size()
            e.index_bytes = 8 if t.numel() > 1 << 32 else 4
            sparse_bytes = e.changed * (e.index_bytes + esize)
            best = min(sparse_bytes, full_bytes)
            e.encoding = SPARSE if sparse_bytes < full_bytes else FULL
            wanted = force if isinstance(force, str) else (force or {}).get(name)
            packed = None
            if wanted is not None:
                e.encoding = _ENCODING_CODES[wanted]
                if e.encoding == XOR:
                    packed = zlib.compress(tensor_bytes(torch.bitwise_xor(new_bits, old_bits)), zlib_level)
            elif e.changed >= xor_min_changed:
                xored = tensor_bytes(torch.bitwise_xor(new_bits, old_bits))
                # A sample first (4 slices of 16 KiB across the tensor): the whole is compressed only if
                # the sample says it would win, and kept only if it does.
                piece = 16 << 10
                slices = 4 if full_bytes >= 4 * piece else 1
                sample_in = sample_out = 0
                for s in range(slices):
                    at = 0 if slices == 1 else s * (full_bytes - piece) // 3
                    chunk = xored[at : at + piece]
                    sample_in += len(chunk)
                    sample_out += len(zlib.compress(chunk, zlib_level))
                if sample_out * full_bytes / max(sample_in, 1) < 0.9 * best:
                    whole = zlib.compress(xored, zlib_level)
                    if len(whole) < best:
                        packed, e.encoding = whole, XOR
            if e.encoding == SPARSE:
                idx = indices
                if e.index_bytes == 4:  # unsigned on the wire: the low 32 bits
                    if indices.numel() and int(indices[-1]) >= 1 << 31:
                        idx = torch.where(indices >= 1 << 31, indices - (1 << 32), indices)
                    idx = idx.to(torch.int32)
                payload = torch.cat([idx.view(torch.uint8), new_bits.index_select(0, indices).view(torch.uint8)])
                out.tensors.append((name, payload))
            elif e.encoding == XOR:
                out.tensors.append((name, torch.frombuffer(bytearray(packed), dtype=torch.uint8)
                                    if packed else torch.empty(0, dtype=torch.uint8)))
            else:
                out.tensors.append((name, t))
            out.finals[i] = t
        m.digest = m.compute_digest()
        out.tensors[0] = (MANIFEST_NAME, m.encode())
        out.bytes = sum(t.numel() * t.element_size() for _, t in out.tensors)
        return out

    def commit(self, encoded: "EncodedVersion"):
        """The receivers took ``encoded`` (cut by this store, from tensors that have not changed since):
        the store now holds its version. It keeps copies of the tensors that changed (those of ``cut``
        may be the caller's own, or travel)."""
        m = encoded.manifest
        if m.is_delta and not self.holds(m.base_version, m.base_digest):
            raise SyncError("fsdpx: a delta committed onto another version than its base (commit each cut version, "
                            "in order)")
        self.tensors = [self.tensors[i] if f is None else f.clone() for i, f in enumerate(encoded.finals)]
        self.manifest = m


@dataclass
class EncodedVersion:
    """What a publisher sends for one version: ``tensors`` (the manifest first, then what travels)."""

    manifest: Manifest
    tensors: List[Tuple[str, torch.Tensor]]
    finals: List[Optional[torch.Tensor]]  # per entry: its final host tensor, None when unchanged
    bytes: int = 0  # of ``tensors``, the manifest included
    full_bytes: int = 0  # what a full version sends (without its manifest)

    def count(self, encoding: Union[int, str]) -> int:
        code = _ENCODING_CODES[encoding] if isinstance(encoding, str) else encoding
        return sum(e.encoding == code for e in self.manifest.entries)

    def counts(self) -> Dict[str, int]:
        return {name: self.count(code) for code, name in ENCODING_NAMES.items()}


# ---- proof of arrival --------------------------------------------------------------------------------


def _module_tensors(module: torch.nn.Module, manifest: Manifest) -> List[Tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers (module.state_dict()'s names), each tensor once,
    under the name the version lists it by (a tied one has several)."""
    listed = manifest.index()
    out: List[Tuple[str, torch.Tensor]] = []
    seen: Dict[int, int] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t is None:
            continue
        k = seen.get(id(t))
        if k is None:
            seen[id(t)] = len(out)
            out.append((name, t))
        elif name in listed and out[k][0] not in listed:
            out[k] = (name, t)
    return out


def named_tensors_of(target) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a target: a mapping, a WeightVersion (anything with ``tensors``) or an
    iterable of pairs."""
    if isinstance(target, dict):
        return list(target.items())
    if hasattr(target, "tensors") and not isinstance(target, torch.Tensor):
        return list(target.tensors)
    return list(target)


def verify(target, manifest: Manifest) -> bool:
    """"Do I hold version V exactly": every tensor of ``manifest`` is in ``target`` (a module, a
    WeightVersion, a mapping or (name, tensor) pairs) by name, with its dtype, shape and CRC-32C, and
    nothing else is. Returns True; otherwise a SyncError naming every tensor that differs, is missing or
    is not in the version (a tensor of another dtype differs, whatever its values)."""
    if isinstance(target, torch.nn.Module):
        pairs = _module_tensors(target, manifest)
    else:
        pairs = named_tensors_of(target)
    problems: List[str] = []
    by_name: Dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if name == MANIFEST_NAME:
            continue
        if name in by_name:
            problems.append(f"'{name}' is listed twice")
        by_name[name] = t
    for e in manifest.entries:
        t = by_name.pop(e.name, None)
        if t is None:
            problems.append(f"'{e.name}' is missing")
        elif t.dtype != e.dtype or tuple(t.shape) != e.shape:
            problems.append(f"'{e.name}' is {t.dtype} {tuple(t.shape)}, version {manifest.version} has {e.dtype} {e.shape}")
        elif tensor_crc32c(t) != e.crc:
            problems.append(f"'{e.name}' differs (its CRC-32C is not the version's)")
    for name in by_name:
        problems.append(f"'{name}' is not in version {manifest.version}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise SyncError(f"fsdpx: these weights are not version {manifest.version} (digest {manifest.digest:#010x}): {shown}")
    return True
