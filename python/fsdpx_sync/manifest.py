"""A version's manifest and proof of arrival (docs/sync.md, "Delta versions and proof of arrival").

Every version, full or delta, starts with a manifest (the tensor ``.fsdpx.manifest``, uint8): each
tensor's name, dtype, shape, the CRC-32C of its final bytes and how it travels (unchanged, sparse
indices and values, full, or a zlib stream of its bits XOR the base's), and a digest over all of them.
A receiver holds version V exactly when its tensors' CRCs are the manifest's: ``verify`` answers "do I
hold version V exactly" for a module or tensors.
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol, Union, cast

import torch

from .bucket import DTYPES, ESIZE, MAX_NDIM, bookkeeping_problem
from .checksum import BytesLike, crc32c, tensor_bytes, tensor_crc32c
from .errors import LATE_MASK, SyncError, late
from .wire import (
    DTYPE_NDIM,
    ENCODING_NAMES,
    FULL,
    MANIFEST_ENTRY_BOOKKEEPING,
    MANIFEST_FORMAT,
    MANIFEST_MAGIC,
    MANIFEST_MIN_ENTRY_BYTES,
    MANIFEST_NAME,
    MANIFEST_PREFIX,
    MANIFEST_TAIL,
    NAME_LEN,
    NARROW_INDEX_LIMIT,
    SPARSE,
    VERSION_BOOKKEEPING_FLOOR,
)

ENCODING_CODES = {v: k for k, v in ENCODING_NAMES.items()}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_INT64_MAX = (1 << 63) - 1
_SHAPE_PACK = [struct.Struct(f"<{n}q").pack for n in range(MAX_NDIM + 1)]  # a shape of n dimensions
# An entry's shape of n dimensions and its MANIFEST_TAIL, read at once.
_SHAPE_TAIL = [struct.Struct(f"<{n}q" + MANIFEST_TAIL.format.lstrip("<")).unpack_from for n in range(MAX_NDIM + 1)]
_CRC = struct.Struct("<I")
_TAIL_CRC = 4  # where an entry's CRC lies in its tail (MANIFEST_TAIL: encoding, index bytes, zero, crc, changed)


class HasTensors(Protocol):
    """A WeightVersion, or anything else that holds (name, tensor) pairs as ``tensors``."""

    @property
    def tensors(self) -> Sequence[tuple[str, torch.Tensor]]: ...


# What ``verify`` checks: a module (its state_dict's names), a WeightVersion, a mapping or (name, tensor) pairs.
Target = Union[torch.nn.Module, HasTensors, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def dtype_code(dtype: torch.dtype, name: str = "") -> int:
    code = _CODES.get(dtype)
    if code is None:
        raise SyncError(f"fsdpx: tensor '{name}' of dtype {dtype} cannot travel (the bucket's dtypes: "
                        f"{', '.join(str(d).replace('torch.', '') for d in DTYPES.values())})")
    return code



@dataclass
class ManifestEntry:
    """One tensor of a version: what the receiver holds after it, and how it travels."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
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
        return (NAME_LEN.pack(len(name)) + name + DTYPE_NDIM.pack(dtype_code(self.dtype, self.name), len(self.shape))
                + _SHAPE_PACK[len(self.shape)](*self.shape))


@dataclass
class Manifest:
    """What a version must be: its tensors (names, dtypes, shapes, CRC-32Cs, in order) and, for a
    delta, the version it was cut from (``base_version``, ``base_digest``)."""

    version: int
    entries: list[ManifestEntry] = field(default_factory=list)
    base_version: int = -1
    base_digest: int = 0
    digest: int = 0

    @property
    def is_delta(self) -> bool:
        return self.base_version != -1

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def checksums(self) -> dict[str, int]:
        """name -> CRC-32C of the tensor's final bytes."""
        return {e.name: e.crc for e in self.entries}

    def index(self) -> dict[str, ManifestEntry]:
        return {e.name: e for e in self.entries}

    def compute_digest(self) -> int:
        """CRC-32C over every entry's name, dtype, shape and CRC, in order: one number for the version."""
        records = bytearray()
        for e in self.entries:
            records += e.identity()
            records += _CRC.pack(e.crc)
        return crc32c(bytes(records))

    def encode(self) -> torch.Tensor:
        """The manifest tensor (1-D uint8) as it travels."""
        out = bytearray(MANIFEST_PREFIX.pack(MANIFEST_MAGIC, MANIFEST_FORMAT, 1 if self.is_delta else 0, self.version,
                                     self.base_version, self.base_digest, self.digest, len(self.entries), 0, 0))
        for e in self.entries:
            out += e.identity() + MANIFEST_TAIL.pack(e.encoding, e.index_bytes, 0, e.crc, e.changed)
        return torch.frombuffer(out, dtype=torch.uint8).clone()

    @classmethod
    def decode(cls, data: BytesLike | torch.Tensor, where: str = "the sender", *,
               deadline: float | None = None) -> Manifest:
        """Parses and checks a manifest (a uint8 tensor, or bytes): every field bounds-checked before it
        is read, counts bounded by the bytes, shapes checked for overflow, unknown codes refused, and the
        digest recomputed. A SyncError naming the manifest (and the tensor) otherwise; FetchLate once
        ``deadline`` (a time.monotonic()) passed.

        The digest is computed over each entry's identity and CRC as they lie in the manifest: the bytes
        ``compute_digest`` would encode them to again (a name is strict UTF-8, which decodes and encodes
        back to the same bytes; a dtype code, a rank, a shape and a CRC pack back to theirs)."""
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or data.dim() != 1:
                raise SyncError(f"fsdpx: the manifest from {where} is not a 1-D uint8 tensor "
                                f"({data.dtype}, {tuple(data.shape)})")
            view = tensor_bytes(data)
        else:
            view = memoryview(data).cast("B")
        size = len(view)
        pos = 0

        def fail(why: str) -> NoReturn:
            raise SyncError(f"fsdpx: the manifest ('{MANIFEST_NAME}') from {where} is corrupt: {why}")

        def short(what: str) -> NoReturn:
            fail(f"it ends inside {what} (at byte {pos} of {size})")

        if MANIFEST_PREFIX.size > size:
            short("its prefix")
        prefix = MANIFEST_PREFIX.unpack_from(view, 0)
        magic, fmt, flags, version, base_version, base_digest, digest, count, _, _ = prefix
        pos = MANIFEST_PREFIX.size
        if magic != MANIFEST_MAGIC:
            fail("bad magic number (not a manifest)")
        if fmt != MANIFEST_FORMAT:
            fail(f"format {fmt}, this receiver reads format {MANIFEST_FORMAT}")
        delta = bool(flags & 1)
        if version < 0 or delta != (base_version != -1) or (delta and base_version < 0):
            fail(f"version {version} with base {base_version} ({'a delta' if delta else 'full'})")
        if count > (size - MANIFEST_PREFIX.size) // MANIFEST_MIN_ENTRY_BYTES:
            fail(f"{count} tensors cannot fit in {size} bytes")
        problem = bookkeeping_problem(count * MANIFEST_ENTRY_BOOKKEEPING, size, VERSION_BOOKKEEPING_FLOOR,
                                      f"its {count} entries")
        if problem is not None:
            fail(problem)
        m = cls(version, [], base_version, base_digest, digest)
        entries = m.entries
        seen: set[str] = set()
        records = bytearray()  # what the digest covers: each entry's identity and CRC
        dtypes, esizes, places, encodings = DTYPES, ESIZE, _SHAPE_TAIL, ENCODING_NAMES
        tail_size = MANIFEST_TAIL.size
        for k in range(count):
            if deadline is not None and k & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                raise late(f"the manifest ('{MANIFEST_NAME}') from {where}", k, count)
            start = pos
            if pos + 2 > size:
                short("a name's length")
            length = view[pos] | view[pos + 1] << 8  # NAME_LEN
            pos += 2
            if pos + length > size:
                short("a name")
            try:
                name = str(view[pos : pos + length], "utf-8")
            except UnicodeDecodeError:
                fail(f"a name of {length} bytes at byte {pos} is not UTF-8")
            pos += length
            if pos + 2 > size:
                short(f"the dtype and rank of '{name}'")
            code, ndim = view[pos], view[pos + 1]  # DTYPE_NDIM
            pos += 2
            dtype = dtypes.get(code)
            if dtype is None:
                fail(f"tensor '{name}' has unknown dtype code {code}")
            if ndim > MAX_NDIM:
                fail(f"tensor '{name}' has {ndim} dimensions (at most {MAX_NDIM})")
            if pos + 8 * ndim + tail_size > size:
                short(f"the shape and encoding of '{name}'")
            fields = places[ndim](view, pos)  # the shape, then MANIFEST_TAIL
            shape = fields[:ndim]
            numel = 1
            for d in shape:
                numel *= d
                if d < 0 or numel > _INT64_MAX:
                    fail(f"tensor '{name}' has a negative or overflowing shape {shape}")
            if numel * esizes[code] > _INT64_MAX:
                fail(f"tensor '{name}' has an overflowing size")
            pos += 8 * ndim
            records += view[start:pos]
            records += view[pos + _TAIL_CRC : pos + _TAIL_CRC + 4]
            pos += tail_size
            encoding, index_bytes, _, crc, changed = fields[ndim:]
            if encoding not in encodings:
                fail(f"tensor '{name}' has unknown encoding {encoding}")
            if not delta and encoding != FULL:
                fail(f"tensor '{name}' is {ENCODING_NAMES[encoding]} in a full version")
            if encoding == SPARSE and (index_bytes not in (4, 8) or (index_bytes == 4 and numel > NARROW_INDEX_LIMIT)):
                fail(f"tensor '{name}' of {numel} elements has {index_bytes}-byte indices")
            if changed < -1 or changed > numel or (encoding == SPARSE and changed < 1):
                fail(f"tensor '{name}' of {numel} elements says {changed} changed")
            if name in seen:
                fail(f"tensor '{name}' is listed twice")
            seen.add(name)
            entries.append(ManifestEntry(name, dtype, shape, encoding, index_bytes, crc, changed))
        if pos != size:
            fail(f"{size - pos} bytes follow the last of its {count} entries")
        if crc32c(bytes(records)) != digest:
            fail("its digest does not match its entries (corrupted, or made wrongly)")
        return m


def full_manifest(version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
    """The manifest of a full version of these tensors (every CRC-32C computed)."""
    m = Manifest(version)
    for name, t in named_tensors:
        dtype_code(t.dtype, name)
        m.entries.append(ManifestEntry(name, t.dtype, tuple(t.shape), FULL, 0, tensor_crc32c(t), -1))
    m.digest = m.compute_digest()
    return m


def split_manifest(received: Sequence[tuple[str, torch.Tensor]], where: str, *,
                   deadline: float | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """A received version's manifest (first, once; checked) and its other tensors by name; FetchLate
    once ``deadline`` (a time.monotonic()) passed."""
    if not received or received[0][0] != MANIFEST_NAME:
        raise SyncError(f"fsdpx: a weight version from {where} does not start with its manifest ('{MANIFEST_NAME}'): "
                        "the sender speaks an older protocol (update it), or the version is corrupt")
    m = Manifest.decode(received[0][1], where, deadline=deadline)
    try:  # in C; the loop below names what is wrong, if anything
        rest: dict[str, torch.Tensor] = dict(itertools.islice(received, 1, None))
        if len(rest) == len(received) - 1 and MANIFEST_NAME not in rest:
            return m, rest
    except (TypeError, ValueError):
        pass
    rest = {}
    for k, (name, t) in enumerate(received):
        if k == 0:
            continue
        if deadline is not None and k & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
            raise late(f"weight version {m.version} from {where}", k, len(received))
        if name == MANIFEST_NAME:
            raise SyncError(f"fsdpx: weight version {m.version} from {where} carries two manifests")
        if name in rest:
            raise SyncError(f"fsdpx: weight version {m.version} from {where}: tensor '{name}' arrived twice")
        rest[name] = t
    return m, rest


# ---- proof of arrival --------------------------------------------------------------------------------


def _module_tensors(module: torch.nn.Module, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers (module.state_dict()'s names), each tensor once,
    under the name the version lists it by (a tied one has several)."""
    listed = manifest.index()
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, int] = {}
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


def named_tensors_of(target: Target) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a target: a mapping, a WeightVersion (anything with ``tensors``) or an
    iterable of pairs."""
    if isinstance(target, dict):
        return list(target.items())
    if hasattr(target, "tensors") and not isinstance(target, torch.Tensor):
        return list(cast(HasTensors, target).tensors)
    return list(cast("Iterable[tuple[str, torch.Tensor]]", target))


def verify(target: Target, manifest: Manifest) -> bool:
    """"Do I hold version V exactly": every tensor of ``manifest`` is in ``target`` (a module, a
    WeightVersion, a mapping or (name, tensor) pairs) by name, with its dtype, shape and CRC-32C, and
    nothing else is. Returns True; otherwise a SyncError naming every tensor that differs, is missing or
    is not in the version (a tensor of another dtype differs, whatever its values)."""
    pairs = _module_tensors(target, manifest) if isinstance(target, torch.nn.Module) else named_tensors_of(target)
    problems: list[str] = []
    by_name: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if name == MANIFEST_NAME:
            continue
        if name in by_name:
            problems.append(f"'{name}' is listed twice")
        by_name[name] = t
    for e in manifest.entries:
        held = by_name.pop(e.name, None)
        if held is None:
            problems.append(f"'{e.name}' is missing")
        elif held.dtype != e.dtype or tuple(held.shape) != e.shape:
            problems.append(f"'{e.name}' is {held.dtype} {tuple(held.shape)}, version {manifest.version} has {e.dtype} "
                            f"{e.shape}")
        elif tensor_crc32c(held) != e.crc:
            problems.append(f"'{e.name}' differs (its CRC-32C is not the version's)")
    for name in by_name:
        problems.append(f"'{name}' is not in version {manifest.version}")
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise SyncError(f"fsdpx: these weights are not version {manifest.version} (digest {manifest.digest:#010x}): "
                        f"{shown}")
    return True
