"""Delta versions (docs/sync.md, "Delta versions and proof of arrival"): what one end of a sync holds.

Both ends of a sync hold a ``VersionStore``: the publisher cuts the next version against it
(``cut`` / ``commit``: the encoder, for tests and Python publishers), the receiver applies the next one
to it (``accept``: every size, index and stream checked, every written tensor's CRC compared, anything
applied undone on a failure). The manifest and ``verify`` are in ``manifest``, the payloads' kernels in
``codec``; their names stay importable from here.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, cast

import torch

from .checksum import tensor_bytes, tensor_crc32c
from .codec import bits_of, copy_of, scatter, sparse_parts, xor_stream
from .errors import LATE_MASK, SyncError, late
from .manifest import (
    ENCODING_CODES,
    Manifest,
    ManifestEntry,
    dtype_code,
    full_manifest,
    named_tensors_of,
    split_manifest,
    verify,
)
from .wire import (
    ENCODING_NAMES,
    FULL,
    MANIFEST_ENTRY_BOOKKEEPING,
    MANIFEST_FORMAT,
    MANIFEST_MAGIC,
    MANIFEST_MIN_ENTRY_BYTES as MIN_ENTRY_BYTES,
    MANIFEST_NAME,
    NARROW_INDEX_LIMIT,
    SPARSE,
    UNCHANGED,
    XOR,
)

__all__ = ["MANIFEST_NAME", "MANIFEST_MAGIC", "MANIFEST_FORMAT", "UNCHANGED", "SPARSE", "FULL", "XOR", "ENCODING_NAMES",
           "MIN_ENTRY_BYTES", "MANIFEST_ENTRY_BOOKKEEPING", "dtype_code", "bits_of", "ManifestEntry", "Manifest",
           "full_manifest", "split_manifest", "named_tensors_of", "verify", "VersionStore", "EncodedVersion"]


@dataclass
class _Undo:
    index: int
    encoding: int
    saved: Any = None  # sparse: old values; full: the old tensor; xor: the stream (inflated again)
    indices: torch.Tensor | None = None


class VersionStore:
    """The version one end of a sync holds: its manifest and its tensors, in the manifest's order.

    A publisher cuts the next version against it (``cut``, then ``commit`` once it was sent); a receiver
    applies the next one to it (``accept``). Its tensors may be a module's (``adopt``): deltas then land
    in the module, in place."""

    def __init__(self) -> None:
        self.manifest: Manifest | None = None
        self.tensors: list[torch.Tensor] = []

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

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self.manifest is None else list(zip(self.manifest.names, self.tensors))

    def clear(self) -> None:
        self.manifest, self.tensors = None, []

    def adopt(self, named_tensors: Sequence[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        """Holds these tensors (a module's, say, after a full version was loaded into them) as version
        ``manifest``: they must have its names, dtypes and shapes, in order, and be contiguous. Their
        bytes are not read again (``verify`` does)."""
        if len(named_tensors) != len(manifest.entries):
            raise SyncError(f"fsdpx: {len(named_tensors)} tensors cannot hold version {manifest.version} of "
                            f"{len(manifest.entries)}")
        held = []
        for (name, t), e in zip(named_tensors, manifest.entries):
            if name != e.name or t.dtype != e.dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
                raise SyncError(f"fsdpx: tensor '{name}' ({t.dtype}, {tuple(t.shape)}) cannot hold '{e.name}' of "
                                f"version {manifest.version} ({e.dtype}, {e.shape}, contiguous)")
            held.append(t.detach())
        self.tensors, self.manifest = held, manifest

    # ---- the receiver -----------------------------------------------------------------------------

    def accept(self, received: Sequence[tuple[str, torch.Tensor]], *, in_place: bool = False,
               where: str = "the sender", deadline: float | None = None) -> list[str]:
        """Takes a received version (its tensors as they arrived, the manifest first). A full version
        replaces what is held (every tensor's dtype, shape and CRC-32C checked against the manifest, none
        missing, none extra); a delta is applied to what is held, only if that is its base (version and
        digest). ``in_place``: the held tensors are written (a module's); else copy-on-write: a tensor
        the delta touches is cloned, then written, so tensors handed out before never change.

        Returns the names the version changed (every name for a full version). Any failure is a
        SyncError naming the tensor, and the store (and in place, its tensors) keeps what it held, bit
        for bit: FetchLate once ``deadline`` (a time.monotonic(): a fetch's) passed while the version was
        checked or applied (what was applied is undone first)."""
        m, rest = split_manifest(received, where, deadline=deadline)

        def fail(why: str) -> NoReturn:
            raise SyncError(f"fsdpx: weight version {m.version} from {where}: {why}")

        def check_listed() -> None:
            """Every tensor that arrived is one the manifest lists as travelling."""
            listed = m.index()
            for k, name in enumerate(rest):
                if deadline is not None and k & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                    raise late(f"weight version {m.version} from {where}", k, len(rest))
                e = listed.get(name)
                if e is None or e.encoding == UNCHANGED:
                    fail(f"tensor '{name}' arrived but its manifest "
                         f"{'says it is unchanged' if e else 'does not list it'}")

        # A full version of as many tensors as its manifest lists, each of which arrived, lists every
        # tensor that arrived (and none of its entries is unchanged): check_listed() then runs only
        # before another failure is named, so that it is named first, as ever.
        listed_checked = m.is_delta or len(rest) != len(m.entries)
        if listed_checked:
            check_listed()

        def refuse(why: str) -> NoReturn:
            if not listed_checked:
                check_listed()
            fail(why)

        with torch.no_grad():
            if not m.is_delta:
                held: list[torch.Tensor] = []
                count = len(m.entries)
                for k, e in enumerate(m.entries):
                    if deadline is not None and k & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                        raise late(f"weight version {m.version} from {where}", k, count)
                    t = rest.get(e.name)
                    if t is None:
                        refuse(f"tensor '{e.name}' never arrived (its manifest lists it)")
                    if t.dtype != e.dtype or t.shape != e.shape:
                        refuse(f"tensor '{e.name}' arrived as {t.dtype} {tuple(t.shape)}, its manifest says {e.dtype} "
                               f"{e.shape}")
                    try:
                        crc = tensor_crc32c(t)
                    except BaseException:
                        if not listed_checked:
                            check_listed()
                        raise
                    if crc != e.crc:
                        refuse(f"tensor '{e.name}' does not match its checksum (CRC-32C) in the manifest: it was "
                               "corrupted on the way or made wrongly")
                    held.append(t if t.is_contiguous() else t.contiguous())
                self.tensors, self.manifest = held, m
                return m.names
            return self._apply_delta(m, rest, in_place, fail, where, deadline)

    def _apply_delta(self, m: Manifest, rest: dict[str, torch.Tensor], in_place: bool,
                     fail: Callable[[str], NoReturn], where: str = "the sender",
                     deadline: float | None = None) -> list[str]:
        base = self.manifest
        if base is None or not self.holds(m.base_version, m.base_digest):
            holding = "no version" if base is None else f"version {base.version} (digest {base.digest:#010x})"
            fail(f"its manifest says it is a delta from version {m.base_version} (digest {m.base_digest:#010x}), but "
                 f"this receiver holds {holding}: nothing was applied")
        if len(base.entries) != len(m.entries):
            fail(f"the delta lists {len(m.entries)} tensors, its base {len(base.entries)}")
        count = len(m.entries)
        for k, (e, b) in enumerate(zip(m.entries, base.entries)):
            if deadline is not None and k & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                raise late(f"weight version {m.version} from {where}", k, count)
            if e.name != b.name or e.dtype != b.dtype or e.shape != b.shape:
                fail(f"tensor '{e.name}' ({e.dtype}, {e.shape}) is not tensor '{b.name}' of its base at the same place")
            if e.encoding == UNCHANGED and e.crc != b.crc:
                fail(f"tensor '{e.name}' is unchanged, but its checksum differs from its base's")
            if e.encoding != UNCHANGED and e.name not in rest:
                fail(f"tensor '{e.name}' ({e.encoding_name}) never arrived")
        nxt = list(self.tensors)
        undo: list[_Undo] = []
        changed: list[str] = []
        try:
            for i, e in enumerate(m.entries):
                # Late: what was applied is undone below (the undo itself always runs to its end).
                if deadline is not None and i & LATE_MASK == LATE_MASK and time.monotonic() > deadline:
                    raise late(f"weight version {m.version} from {where}", i, count)
                if e.encoding == UNCHANGED:
                    continue
                payload = rest[e.name]

                def bad(why: str, e: ManifestEntry = e) -> NoReturn:
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
                        parts = sparse_parts(payload, e)
                        if isinstance(parts, str):
                            bad(parts)
                        indices, values = parts
                        target = held if in_place else copy_of(held)
                        old = scatter(bits_of(target), indices, values, keep=in_place)
                        if in_place:
                            undo.append(_Undo(i, SPARSE, old, indices))
                    else:
                        target = held if in_place else copy_of(held)
                        why = xor_stream(target, payload)  # on failure, the target is as it was
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
                    scatter(bits_of(held), cast(torch.Tensor, u.indices), u.saved, keep=False)
                elif u.encoding == FULL:
                    held.copy_(u.saved)
                else:
                    xor_stream(held, u.saved, held.numel() * held.element_size())
            raise
        self.tensors, self.manifest = nxt, m
        return changed

    # ---- the publisher ----------------------------------------------------------------------------

    def cut(self, version: int, named_tensors: Sequence[tuple[str, torch.Tensor]], *, delta: bool = True,
            zlib_level: int = 1, xor_min_changed: int = 4096,
            force: None | str | dict[str, str] = None) -> EncodedVersion:
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
        if is_delta and base is not None:
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
            e.index_bytes = 8 if t.numel() > NARROW_INDEX_LIMIT else 4
            sparse_bytes = e.changed * (e.index_bytes + esize)
            best = min(sparse_bytes, full_bytes)
            e.encoding = SPARSE if sparse_bytes < full_bytes else FULL
            wanted = force if isinstance(force, str) else (force or {}).get(name)
            packed = None
            if wanted is not None:
                e.encoding = ENCODING_CODES[wanted]
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

    def commit(self, encoded: EncodedVersion) -> None:
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
    tensors: list[tuple[str, torch.Tensor]]
    finals: list[torch.Tensor | None]  # per entry: its final host tensor, None when unchanged
    bytes: int = 0  # of ``tensors``, the manifest included
    full_bytes: int = 0  # what a full version sends (without its manifest)

    def count(self, encoding: int | str) -> int:
        code = ENCODING_CODES[encoding] if isinstance(encoding, str) else encoding
        return sum(e.encoding == code for e in self.manifest.entries)

    def counts(self) -> dict[str, int]:
        return {name: self.count(code) for code, name in ENCODING_NAMES.items()}

