"""A client of fsdpx's synchronizer server (fsdpx/sync/server.hpp) for Python rollout workers.

    from fsdpx_sync import SyncClient
    client = SyncClient("10.0.0.1", 5710, secret=os.environ["FSDPX_SYNC_SECRET"])
    version = -1
    while True:
        weights = client.fetch_newer(version, timeout=600)    # all of one version, checked, or SyncError
        llm.model.load_weights(weights)                       # vLLM / SGLang: an iterable of (name, tensor)
        # or: weights.load_into(hf_model)                     # transformers: by name, strict
        version = weights.version

Deltas: the client keeps the version it returned last (``keep_base``), tells the server it holds it,
and the server sends only what changed; the client applies it (copy-on-write, or in place into a
module with ``fetch_newer_into``), checks every tensor against the version's manifest (CRC-32C), and
undoes everything on any failure. ``verify`` proves a module holds a version exactly.

The wire protocol is specified in docs/sync.md ("Frames", "Authentication", "Delta versions and proof
of arrival").
"""

from __future__ import annotations

import struct
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .bucket import PREFIX_BYTES, Collector, decode_bucket
from .checksum import tensor_bytes
from .delta import MANIFEST_NAME, Manifest, VersionStore, full_manifest, verify as _verify
from .engines import flatten_buckets
from .errors import SyncError, late
from .manifest import Target
from .transport import GROW, Connection, handshake_mac
from .wire import (
    ACK,
    AUTH,
    BUCKET,
    CLIENT_LABEL,
    ERROR,
    FETCH,
    FETCH_HOLDS_BASE,
    FRAME_MAGIC,
    GOODBYE,
    HEADER,
    HELLO,
    KIND_NAMES,
    MANIFEST_FORMAT,
    MANIFEST_MAGIC,
    MANIFEST_PREFIX,
    MAX_BUCKET_BYTES,
    MAX_RUN,
    MAX_TEXT,
    MAX_VERSION_BYTES,
    NONCE,
    PROTOCOL,
    PUBLISH_BEGIN,
    PUBLISH_END,
    REFUSED_BUSY,
    ROLE_FETCH,
    ROLE_PUBLISH,
    SERVER_LABEL,
    SNAPSHOT_BEGIN,
    TIMEOUT,
    WELCOME,
)

# Where they were defined before wire.py: still importable from here.
__all__ = ["WeightVersion", "SyncClient", "handshake_mac", "GROW", "FRAME_MAGIC", "PROTOCOL", "FETCH_HOLDS_BASE",
           "HEADER", "MAX_TEXT", "MAX_RUN", "REFUSED_BUSY", "NONCE", "CLIENT_LABEL", "SERVER_LABEL", "ROLE_PUBLISH",
           "ROLE_FETCH", "PUBLISH_BEGIN", "BUCKET", "PUBLISH_END", "ACK", "FETCH", "SNAPSHOT_BEGIN", "TIMEOUT", "ERROR",
           "GOODBYE", "HELLO", "AUTH", "WELCOME", "KIND_NAMES"]
# version, run label, received tensors (manifest first), the fetch's deadline (a time.monotonic())
Fetched = tuple[int, str, list[tuple[str, torch.Tensor]], float]


@dataclass
class WeightVersion:
    """All tensors of one version, in the order they were published (its manifest not among them);
    iterating yields (name, tensor). ``run`` labels the trainer run that published it (a new run's
    versions are newer whatever their numbers). ``manifest`` says what the version is (each tensor's
    CRC-32C, the version's digest); ``is_delta``: it arrived as a delta from the version before, and
    ``changed_names`` are the tensors it changed (every name for a full version).

    The tensors of a version returned by ``fetch_newer`` may be shared with later versions (those a
    delta did not touch) and are the client's base for the next delta: read them, copy them, but do
    not modify them in place (clone first)."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    run: str = ""
    manifest: Manifest | None = None
    is_delta: bool = False
    changed_names: list[str] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def _manifest(self) -> Manifest:
        if self.manifest is None:  # a checkpoint's step, say: the manifest of its tensors as they are
            self.manifest = full_manifest(self.version, self.tensors)
        return self.manifest

    @property
    def digest(self) -> int:
        """The version's digest: CRC-32C over every tensor's name, dtype, shape and CRC-32C."""
        return self._manifest().digest

    @property
    def checksums(self) -> dict[str, int]:
        """name -> CRC-32C of the tensor's bytes in this version."""
        return self._manifest().checksums

    def changed(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the tensors this version changed (all of them for a full version)."""
        if not self.is_delta or self.changed_names is None:
            return list(self.tensors)
        wanted = set(self.changed_names)
        return [(n, t) for n, t in self.tensors if n in wanted]

    def verify(self, target: Target) -> bool:
        """True when ``target`` (a module, a WeightVersion, a mapping or (name, tensor) pairs) holds
        this version exactly: every tensor's CRC-32C (of its bytes in the version's dtype) is the
        manifest's, none is missing, none is extra. Otherwise a SyncError naming the tensors."""
        return _verify(target, self._manifest())

    def for_vllm(self, changed_only: bool = True) -> list[tuple[str, torch.Tensor]]:
        """What vLLM's ``model.load_weights(weights)`` takes: (name, whole tensor) pairs; of a delta,
        only the tensors it changed (``changed_only``), else every tensor."""
        return self.changed() if changed_only else list(self.tensors)

    def for_sglang(self, bucket_bytes: int = 512 << 20, changed_only: bool = True,
                   metadata_class: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
        """SGLang's "flattened_bucket" payloads (``engines.flatten_buckets``): one dict per bucket,
        ``{"flattened_tensor": ..., "metadata": [FlattenedTensorMetadata, ...]}``, tensors grouped by
        dtype, at most ``bucket_bytes`` each (a larger tensor alone); of a delta only the changed
        tensors (``changed_only``). Each goes to ``update_weights_from_tensor(...,
        load_format="flattened_bucket")``; ``metadata_class=dict`` gives plain dicts."""
        return flatten_buckets(self.changed() if changed_only else self.tensors, bucket_bytes, metadata_class)

    def load_into(self, module: torch.nn.Module, strict: bool = True, *,
                  deadline: float | None = None) -> tuple[list[str], list[str]]:
        """Copies every tensor into the module's parameter or persistent buffer of the same name (cast
        to its dtype, on its device): the names of module.state_dict(), as transformers' models have
        them. Strict: a missing, unexpected or wrong-shaped name is an error listing all of them,
        raised before anything is copied. A tied tensor (one tensor under several names, such as a
        tied LM head) needs only one of its names. Returns (missing, unexpected). ``deadline`` (a
        time.monotonic(): a fetch's): a SyncError when it passed before copying starts (never after:
        a copy begun ends)."""
        targets = module.state_dict(keep_vars=True)  # persistent buffers only: never a rotary cache
        received = self.named()
        aliases: dict[int, list[str]] = {}  # id of the tensor -> its names
        for n, t in targets.items():
            aliases.setdefault(id(t), []).append(n)
        missing = [n for n, t in targets.items() if not any(a in received for a in aliases[id(t)])]
        unexpected = [n for n in received if n not in targets]
        wrong = [f"{n}: {tuple(received[n].shape)} received, {tuple(t.shape)} in the module"
                 for n, t in targets.items() if n in received and received[n].shape != t.shape]
        if wrong or (strict and (missing or unexpected)):
            parts: list[str] = []
            if missing:
                parts.append("missing: " + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))
            if unexpected:
                parts.append("unexpected: " + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
            if wrong:
                parts.append("wrong shape: " + "; ".join(wrong[:10]))
            raise SyncError(f"fsdpx: version {self.version} does not match the module: " + "; ".join(parts))
        if deadline is not None and time.monotonic() > deadline:
            raise late(f"version {self.version}", 0, len(received))
        with torch.no_grad():
            for name, t in targets.items():
                if name in received:
                    t.copy_(received[name])
        return missing, unexpected


class SyncClient(Connection):
    """One connection to a synchronizer server, for fetching (role "fetch") or, rarely from Python,
    nothing else. Not thread-safe: one client per thread."""

    def __init__(self, host: str, port: int, *, secret: str | None = None, connect_timeout: float = 10.0,
                 io_timeout: float = 60.0, max_bucket_bytes: int = MAX_BUCKET_BYTES,
                 max_version_bytes: int = MAX_VERSION_BYTES, tls: bool = False, tls_ca_file: str | None = None,
                 tls_server_name: str | None = None, keep_base: bool = True):
        """tls: speak TLS to a server that does; its certificate must be signed by an authority of
        ``tls_ca_file`` (PEM; None: the system's) and name ``tls_server_name`` (default: ``host``).

        keep_base: remember the version returned last (fetch_newer: its tensors, shared with the
        WeightVersion, no copy; fetch_newer_into: the module's own tensors) so that the next fetch of a
        version newer than it may arrive as a delta. False: every fetch asks for a full version."""
        super().__init__(host, port, secret=secret, connect_timeout=connect_timeout, io_timeout=io_timeout,
                         max_bucket_bytes=max_bucket_bytes, tls=tls, tls_ca_file=tls_ca_file,
                         tls_server_name=tls_server_name)
        self.max_version_bytes = max_version_bytes
        self._last: tuple[int, str] = (-1, "")  # the version fetched last, and its run's label
        self._last_manifest: Manifest | None = None
        self.keep_base = keep_base
        # The version the next delta may be applied to: the tensors fetch_newer returned last (copy-on-
        # write), or a module's (in place) when _base_module is set (a weak reference to it).
        self._base: VersionStore | None = None
        self._base_module: weakref.ref[torch.nn.Module] | None = None

    # ---- fetching --------------------------------------------------------------------------------

    @property
    def base_version(self) -> int:
        """The version a delta may be applied to (-1: none; the next fetch asks for a full version)."""
        return -1 if self._base is None else self._base.version

    def forget_base(self) -> None:
        """The next fetch asks for a full version."""
        self._base, self._base_module = None, None

    def last_version(self) -> int:
        """The version fetched last (-1 before the first fetch)."""
        return self._last[0]

    def last_was_delta(self) -> bool:
        """Whether the version fetched last arrived as a delta."""
        return self._last_manifest is not None and self._last_manifest.is_delta

    def load_newer_into(self, module: torch.nn.Module, timeout: float = 60.0) -> int:
        """``fetch_newer_into(module, self.last_version(), timeout)``, returning the version: the verb
        every receiver shares (C++: sync::Receiver; CheckpointWatcher.load_newer_into)."""
        return self.fetch_newer_into(module, self.last_version(), timeout).version

    def fetch_newer(self, have: int = -1, timeout: float = 60.0) -> WeightVersion:
        """The newest version once it is newer than ``have`` (-1: any), waiting up to ``timeout``
        seconds. ``timeout`` is the deadline of the whole fetch, the version's transfer included:
        whatever the server sends, this returns or raises within it (a large version needs a timeout
        that covers its transfer). All of one version (every frame's CRC-32C checked, every element of
        every tensor exactly once, every tensor's CRC-32C the manifest's), or a SyncError. A version of
        another trainer run than the one ``have`` came from (this client's last fetch) is newer whatever
        its number: a new run took over.

        With ``keep_base`` and ``have`` the version this client returned last, the server may send a
        delta: it is applied copy-on-write (the tensors it touches are new; the others are shared with
        the version before, whose tensors never change). Any failure keeps the version before intact
        and makes the next fetch ask for a full version."""
        self._check_have(have)
        base = self._base if (self.keep_base and self._base is not None and self._base_module is None
                              and have != -1 and self._base.version == have) else None
        version, run, received, deadline = self._fetch(have, timeout, base)
        store = base if base is not None else VersionStore()
        try:
            changed = store.accept(received, in_place=False, where=f"the synchronizer at {self.where}",
                                   deadline=deadline)
        except SyncError as e:
            self.forget_base()
            raise SyncError(f"{e}; {_KEPT}") from None
        del received
        m = store.manifest
        assert m is not None  # accepted: the store holds the version
        if self.keep_base:
            self._base, self._base_module = store, None
        else:
            self.forget_base()
        self._last, self._last_manifest = (version, run), m
        return WeightVersion(version, store.named(), run, m, m.is_delta, changed)

    def fetch_newer_into(self, module: torch.nn.Module, have: int = -1, timeout: float = 60.0) -> WeightVersion:
        """fetch_newer, loaded into ``module`` (its ``state_dict()`` names: parameters and persistent
        buffers, strict, as ``WeightVersion.load_into``). A delta is asked for, and applied in place,
        when this client's last version was loaded into this same module, ``have`` is that version, and
        every tensor of it in the module is contiguous, of the version's dtype and shape (any device);
        otherwise a full version is fetched, checked, then copied by name (cast to the module's
        dtypes). Either way a failure leaves the module's weights as they were, bit for bit, and the
        next fetch asks for a full version. Returns the version: its tensors are the module's own
        where the module holds the version's dtypes.

        Between fetches the module's weights must not change otherwise (``verify(module)`` proves they
        did not): a delta writes only what changed."""
        self._check_have(have)
        where = f"the synchronizer at {self.where}"
        base = None
        if (self.keep_base and self._base is not None and self._base.manifest is not None
                and self._base_module is not None and self._base_module() is module and have != -1
                and self._base.version == have):
            targets = self._adoptable(module, self._base.manifest)
            if targets is not None:
                base = VersionStore()
                base.adopt(targets, self._base.manifest)  # the module's tensors now (a .to() replaces them)
        version, run, received, deadline = self._fetch(have, timeout, base)
        store = base if base is not None else VersionStore()
        try:
            with torch.no_grad():
                # A delta lands in the module, undone on failure (a late one too).
                changed = store.accept(received, in_place=True, where=where, deadline=deadline)
                del received
                m = store.manifest
                assert m is not None  # accepted: the store holds the version
                adopted = True
                if not m.is_delta:
                    # Late only before copying starts: once it does, the module holds the version.
                    WeightVersion(version, store.named(), run, m).load_into(module, strict=True,
                                                                            deadline=deadline)
                    targets = self._adoptable(module, m)
                    adopted = targets is not None
                    if targets is not None:
                        store.adopt(targets, m)
        except SyncError as e:
            self.forget_base()
            raise SyncError(f"{e}; {_KEPT}") from None
        if self.keep_base and adopted:
            self._base, self._base_module = store, weakref.ref(module)
        else:
            self.forget_base()
        self._last, self._last_manifest = (version, run), m
        return WeightVersion(version, store.named(), run, m, m.is_delta, changed)

    @staticmethod
    def _adoptable(module: torch.nn.Module, manifest: Manifest) -> list[tuple[str, torch.Tensor]] | None:
        """The module's tensors of the version's names, in its order, when a delta can land in them in
        place: each contiguous, of the version's dtype and shape, no two sharing memory. Else None.
        (Never late: before a fetch its deadline has not begun; after one, the module holds it.)"""
        state = module.state_dict(keep_vars=True)
        out: list[tuple[str, torch.Tensor]] = []
        spans: list[tuple[str, int, int]] = []
        for e in manifest.entries:
            t = state.get(e.name)
            if t is None or t.dtype != e.dtype or tuple(t.shape) != e.shape or not t.is_contiguous():
                return None
            if t.numel():
                spans.append((str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
            out.append((e.name, t.detach()))
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if a[0] == b[0] and b[1] < a[2]:
                return None  # one tensor under two names the trainer both sent: a delta would land twice
        return out

    def verify(self, target: Target, version: None | WeightVersion | Manifest = None) -> bool:
        """"Do I hold version V exactly": True when ``target`` (a module, a WeightVersion, a mapping or
        (name, tensor) pairs) holds ``version`` (default: the version this client returned last), every
        tensor's CRC-32C of its bytes in the version's dtype the manifest's, none missing, none extra;
        otherwise a SyncError naming the tensors that differ, are missing or unexpected."""
        if version is None:
            if self._last_manifest is None:
                raise SyncError("fsdpx: verify: this client has fetched no version yet (pass version=)")
            manifest = self._last_manifest
        elif isinstance(version, WeightVersion):
            manifest = version._manifest()
        else:
            manifest = version
        return _verify(target, manifest)

    @staticmethod
    def _check_have(have: int) -> None:
        if have < -1:
            raise SyncError(f"fsdpx: fetching a version newer than {have}: versions are >= 0 (-1: any)")

    def _fetch(self, have: int, timeout: float, base: VersionStore | None) -> Fetched:
        """(version, run label, received tensors, the manifest first, and the deadline the rest of the
        fetch checks them by), asking for a delta from ``base``."""
        what = f"fetching a version newer than {have}"
        if self._sock is None or self._closed_by_server():
            self._connect(what)
        return self._fetch_once(have, timeout, what, base)

    def _fetch_once(self, have: int, timeout: float, what: str, base: VersionStore | None) -> Fetched:
        timeout = min(max(timeout, 0.0), 365 * 24 * 3600.0)
        # The whole fetch ends by this deadline, whatever the server sends: a server trickling frames,
        # each within io_timeout, cannot keep it longer; checking the version it sent ends by it too.
        deadline = time.monotonic() + timeout
        self._deadline, self._timeout, self._progress = deadline, timeout, ""
        try:
            return self._fetch_stream(have, what, base, deadline)
        except BaseException:
            self.close()  # mid-stream, the connection is out of step: the next fetch opens a fresh one
            raise
        finally:
            self._deadline = None

    def _fetch_stream(self, have: int, what: str, base: VersionStore | None, deadline: float) -> Fetched:
        # The run of the version this client fetched last: a version of another run is newer.
        have_run = self._last[1] if have != -1 and have == self._last[0] else ""
        # flags, digest: whether this client holds `have` exactly (then a delta from it may come).
        holds = struct.pack("<II", FETCH_HOLDS_BASE, base.digest) if base is not None else struct.pack("<II", 0, 0)
        while True:
            # The server answers `timeout` a little before this fetch's deadline, so that the answer
            # arrives in time; it may answer earlier (it caps a wait at its idle_timeout): ask again.
            now = time.monotonic()
            left = max(0.0, deadline - now)
            server_wait = left - min(left / 4, 0.25)
            self._write_frame(FETCH, have, int(server_wait * 1000), holds + have_run.encode(), what)
            begin, text = self._read_frame(left + self.io_timeout, what)
            if begin[1] != TIMEOUT or time.monotonic() + 0.01 >= now + server_wait:
                break
        kind, version, count = begin[1], begin[3], begin[6]
        if kind == TIMEOUT:
            raise SyncError(f"fsdpx: no weight version newer than {have} was published within {self._timeout} s (the "
                            f"synchronizer at {self.where} has version {version}); the trainer may be slow, stopped or "
                            "dead")
        if kind == ERROR:
            raise SyncError(f"fsdpx: the synchronizer at {self.where} answered: {text.decode('utf-8', 'replace')}")
        if kind != SNAPSHOT_BEGIN:
            self._fail(f"an unexpected {KIND_NAMES.get(kind, kind)} frame", what)
        run = text.decode("utf-8", "replace")
        if version <= have and (not have_run or run == have_run):
            self._fail(f"it sent version {version} of run '{run}' for a request newer than {have}", what)
        if count == 0 or count > self.max_version_bytes // PREFIX_BYTES:
            self._fail(f"a version of {count} buckets", what)
        collector = Collector(self.max_version_bytes)
        for k in range(count):
            self._progress = f"version {version}: {k} of {count} buckets received"
            frame, payload = self._read_frame(self.io_timeout, what)
            if frame[1] != BUCKET:
                self._fail("a bucket frame was expected", what)
            try:
                b = decode_bucket(payload, f"synchronizer {self.where}")
                if b.version != version or b.index != k or b.count != count or b.total_bytes != len(payload):
                    raise SyncError(f"fsdpx: weight bucket out of order from synchronizer {self.where}: bucket "
                                    f"{b.index} of {b.count} of version {b.version} ({b.total_bytes} bytes) arrived "
                                    f"where bucket {k} of {count} of version {version} ({len(payload)} bytes) was "
                                    "expected")
                # One entry at a time (a header of many entries holds none of them), and a bucket of many
                # entries ends by the deadline too.
                overdue = not collector.accept_entries(b.entries(), payload, deadline)
            except SyncError as e:
                self._fail(f"version {version}: {_unprefixed(e)}", what)
            if overdue:
                self._progress += f", bucket {k} parsed in part"
                self._late(0.0, True, what)
            del b, payload
        try:
            tensors = collector.finish(deadline)  # every element of every tensor exactly once
        except SyncError as e:
            self._fail(f"version {version}: {_unprefixed(e)}", what)
        if not tensors or tensors[0][0] != MANIFEST_NAME:
            self._fail(f"version {version} does not start with its manifest ('{MANIFEST_NAME}'): the server speaks an "
                       "older protocol (update it), or the version is corrupt", what)
        # Its prefix only, as the C++ client: VersionStore.accept decodes and checks it whole (a manifest
        # whose prefix is not one is refused there, naming why).
        manifest_version = _manifest_version(tensors[0][1])
        if manifest_version is not None and manifest_version != version:  # as the C++ client and the server check
            self.forget_base()  # as every failure of a fetch: the next one asks for a full version
            self._fail(f"version {version} carries the manifest of version {manifest_version}", what)
        return version, run, tensors, deadline


_KEPT = "the weights held before are kept, bit for bit, and the next fetch asks for a full version"


def _manifest_version(t: torch.Tensor) -> int | None:
    """The version a manifest's prefix names (a 1-D uint8 tensor holding a prefix of the right magic
    number and format), else None: what the C++ client reads before the store decodes it whole."""
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < MANIFEST_PREFIX.size:
        return None
    magic, fmt, _flags, version = MANIFEST_PREFIX.unpack_from(tensor_bytes(t[: MANIFEST_PREFIX.size]), 0)[:4]
    return int(version) if magic == MANIFEST_MAGIC and fmt == MANIFEST_FORMAT else None


def _unprefixed(e: Exception) -> str:
    text = str(e)
    return text[len("fsdpx: "):] if text.startswith("fsdpx: ") else text
