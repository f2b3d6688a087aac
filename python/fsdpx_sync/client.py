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

import hashlib
import hmac
import os
import secrets as _secrets
import select
import socket
import ssl
import struct
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .bucket import PREFIX_BYTES, Collector, decode_bucket
from .checksum import crc32c
from .delta import MANIFEST_NAME, Manifest, VersionStore, full_manifest, verify as _verify
from .engines import flatten_buckets
from .errors import SyncError

FRAME_MAGIC = 0x32535846  # "FXS2"
PROTOCOL = 4
FETCH_HOLDS_BASE = 1  # a fetch's flags: the reader holds version `have` exactly, of the digest that follows
HEADER = struct.Struct("<IHHqQQQ")  # magic, kind, flags, version, length, checksum, aux
MAX_TEXT = 64 << 10
MAX_RUN = 256  # a run's identity, or its label
REFUSED_BUSY = 1  # an error frame's aux: refused at accept for a limit, try again later
NONCE = 32
GROW = 1 << 20  # a payload's buffer grows as its bytes arrive, from this much
_ZEROS = bytes(GROW)
CLIENT_LABEL = b"fsdpx-sync-2 client"
SERVER_LABEL = b"fsdpx-sync-2 server"
ROLE_PUBLISH, ROLE_FETCH = 1, 2

(PUBLISH_BEGIN, BUCKET, PUBLISH_END, ACK, FETCH, SNAPSHOT_BEGIN, TIMEOUT, ERROR, GOODBYE, HELLO, AUTH,
 WELCOME) = range(1, 13)
KIND_NAMES = {1: "publish_begin", 2: "bucket", 3: "publish_end", 4: "ack", 5: "fetch", 6: "snapshot_begin",
              7: "timeout", 8: "error", 9: "goodbye", 10: "hello", 11: "auth", 12: "welcome"}


def handshake_mac(secret: bytes, label: bytes, role: int, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + struct.pack("<Q", role) + first + second, hashlib.sha256).digest()


class _Busy(Exception):
    """The server refused the connection at accept for one of its limits: try again later."""


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
    tensors: List[Tuple[str, torch.Tensor]] = field(default_factory=list)
    run: str = ""
    manifest: Optional[Manifest] = None
    is_delta: bool = False
    changed_names: Optional[List[str]] = None

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def named(self) -> dict:
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
    def checksums(self) -> Dict[str, int]:
        """name -> CRC-32C of the tensor's bytes in this version."""
        return self._manifest().checksums

    def changed(self) -> List[Tuple[str, torch.Tensor]]:
        """(name, tensor) of the tensors this version changed (all of them for a full version)."""
        if not self.is_delta or self.changed_names is None:
            return list(self.tensors)
        wanted = set(self.changed_names)
        return [(n, t) for n, t in self.tensors if n in wanted]

    def verify(self, target) -> bool:
        """True when ``target`` (a module, a WeightVersion, a mapping or (name, tensor) pairs) holds
        this version exactly: every tensor's CRC-32C (of its bytes in the version's dtype) is the
        manifest's, none is missing, none is extra. Otherwise a SyncError naming the tensors."""
        return _verify(target, self._manifest())

    def for_vllm(self, changed_only: bool = True) -> List[Tuple[str, torch.Tensor]]:
        """What vLLM's ``model.load_weights(weights)`` takes: (name, whole tensor) pairs; of a delta,
        only the tensors it changed (``changed_only``), else every tensor."""
        return self.changed() if changed_only else list(self.tensors)

    def for_sglang(self, bucket_bytes: int = 512 << 20, changed_only: bool = True,
                   metadata_class=None) -> List[Dict[str, Any]]:
        """SGLang's "flattened_bucket" payloads (``engines.flatten_buckets``): one dict per bucket,
        ``{"flattened_tensor": ..., "metadata": [FlattenedTensorMetadata, ...]}``, tensors grouped by
        dtype, at most ``bucket_bytes`` each (a larger tensor alone); of a delta only the changed
        tensors (``changed_only``). Each goes to ``update_weights_from_tensor(...,
        load_format="flattened_bucket")``; ``metadata_class=dict`` gives plain dicts."""
        return flatten_buckets(self.changed() if changed_only else self.tensors, bucket_bytes, metadata_class)

    def load_into(self, module: torch.nn.Module, strict: bool = True) -> Tuple[List[str], List[str]]:
        """Copies every tensor into the module's parameter or persistent buffer of the same name (cast
        to its dtype, on its device): the names of module.state_dict(), as transformers' models have
        them. Strict: a missing, unexpected or wrong-shaped name is an error listing all of them,
        raised before anything is copied. A tied tensor (one tensor under several names, such as a
        tied LM head) needs only one of its names. Returns (missing, unexpected)."""
        targets = module.state_dict(keep_vars=True)  # persistent buffers only: never a rotary cache
        received = self.named()
        aliases = {}  # id of the tensor -> its names
        for n, t in targets.items():
            aliases.setdefault(id(t), []).append(n)
        missing = [n for n, t in targets.items() if not any(a in received for a in aliases[id(t)])]
        unexpected = [n for n in received if n not in targets]
        wrong = [f"{n}: {tuple(received[n].shape)} received, {tuple(t.shape)} in the module"
                 for n, t in targets.items() if n in received and received[n].shape != t.shape]
        if wrong or (strict and (missing or unexpected)):
            parts = []
            if missing:
                parts.append("missing: " + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))
            if unexpected:
                parts.append("unexpected: " + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
            if wrong:
                parts.append("wrong shape: " + "; ".join(wrong[:10]))
            raise SyncError(f"fsdpx: version {self.version} does not match the module: " + "; ".join(parts))
        with torch.no_grad():
            for name, t in targets.items():
                if name in received:
                    t.copy_(received[name])
        return missing, unexpected


class SyncClient:
    """One connection to a synchronizer server, for fetching (role "fetch") or, rarely from Python,
    nothing else. Not thread-safe: one client per thread."""

    def __init__(self, host: str, port: int, *, secret: Optional[str] = None, connect_timeout: float = 10.0,
                 io_timeout: float = 60.0, max_bucket_bytes: int = 1 << 30, max_version_bytes: int = 64 << 30,
                 tls: bool = False, tls_ca_file: Optional[str] = None, tls_server_name: Optional[str] = None,
                 keep_base: bool = True):
        """tls: speak TLS to a server that does; its certificate must be signed by an authority of
        ``tls_ca_file`` (PEM; None: the system's) and name ``tls_server_name`` (default: ``host``).

        keep_base: remember the version returned last (fetch_newer: its tensors, shared with the
        WeightVersion, no copy; fetch_newer_into: the module's own tensors) so that the next fetch of a
        version newer than it may arrive as a delta. False: every fetch asks for a full version."""
        self.where = f"{host}:{port}"
        self.address = (host, port)
        self._tls = None
        if tls:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca_file)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._tls = (context, tls_server_name or host)
        if secret is None:
            secret = os.environ.get("FSDPX_SYNC_FETCH_SECRET") or os.environ.get("FSDPX_SYNC_SECRET") or ""
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.max_bucket_bytes, self.max_version_bytes = max_bucket_bytes, max_version_bytes
        self._sock: Optional[socket.socket] = None
        self._last: Tuple[int, str] = (-1, "")  # the version fetched last, and its run's label
        self._last_manifest: Optional[Manifest] = None
        self.keep_base = keep_base
        # The version the next delta may be applied to: the tensors fetch_newer returned last (copy-on-
        # write), or a module's (in place) when _base_module is set (a weak reference to it).
        self._base: Optional[VersionStore] = None
        self._base_module: Optional[weakref.ref] = None
        self._deadline: Optional[float] = None  # while fetching: when the whole fetch must end
        self._timeout, self._progress = 0.0, ""

    # ---- connection ------------------------------------------------------------------------------

    def _connect(self, what: str):
        """Connects and authenticates. A server that refuses the connection for a limit (too many
        connections waiting to authenticate) is asked again until connect_timeout; then the error says
        which limit."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                return self._connect_once(deadline)
            except _Busy as busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(
                        f"fsdpx: {what} from the synchronizer at {self.where}: {busy}; asked again for "
                        f"{self.connect_timeout} s (connect_timeout). Too many connections wait to authenticate: many "
                        "clients connecting at once, or a peer holding connections open (the server's max_handshakes "
                        "and max_handshakes_per_address)") from None
                time.sleep(min(left, 0.1))

    def _connect_once(self, deadline: float):
        self.close()
        last = "no attempt"
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=max(0.05, deadline - time.monotonic()))
                break
            except OSError as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise SyncError(f"fsdpx: could not connect to the synchronizer at {self.where} within "
                                f"{self.connect_timeout} s: {last} (is the server running, and is the address right?)")
            time.sleep(0.05)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._tls is not None:
            context, name = self._tls
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                sock = context.wrap_socket(sock, server_hostname=name)
            except (ssl.SSLError, OSError) as e:
                sock.close()
                hint = ""
                if isinstance(e, ssl.SSLCertVerificationError):
                    hint = (" (the server's certificate is not signed by the trusted authorities, or does not name "
                            f"{name!r})")
                elif "WRONG_VERSION_NUMBER" in str(e) or "record layer failure" in str(e):
                    hint = " (the server does not speak TLS: is TLS set on both the server and the client?)"
                raise SyncError(f"fsdpx: the TLS handshake with the synchronizer at {self.where} failed: {e}{hint}") from None
        self._sock = sock
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self):
        what = "the handshake"
        hello, nonce = self._read_frame(self.io_timeout, what, text=True)
        if hello[1] == ERROR:
            self.close()
            text = nonce.decode("utf-8", "replace")
            if hello[6] == REFUSED_BUSY:
                raise _Busy(text)
            raise SyncError(f"fsdpx: the synchronizer at {self.where} refused the connection: {text}")
        if hello[1] != HELLO or hello[6] != PROTOCOL or len(nonce) != NONCE:
            self._fail(f"the server did not start with a protocol {PROTOCOL} hello", what)
        mine = _secrets.token_bytes(NONCE)
        mac = handshake_mac(self._secret, CLIENT_LABEL, ROLE_FETCH, nonce, mine) if self._secret else bytes(32)
        self._write_frame(AUTH, -1, ROLE_FETCH, mine + mac, what)
        reply, payload = self._read_frame(self.io_timeout, what, text=True)
        if reply[1] == ERROR:
            hint = "" if self._secret else " (this client has no secret: pass secret= or set FSDPX_SYNC_SECRET)"
            raise SyncError(f"fsdpx: the synchronizer at {self.where} refused to let this client fetch: "
                            f"{payload.decode('utf-8', 'replace')}{hint}")
        if reply[1] != WELCOME or len(payload) != 32:
            self._fail("the server answered the handshake with something other than a welcome", what)
        if self._secret:
            expected = handshake_mac(self._secret, SERVER_LABEL, ROLE_FETCH, mine, nonce)
            if not hmac.compare_digest(expected, bytes(payload)):
                self._fail("the server did not prove it holds the fetch secret (it runs without one, or with "
                           "another): its weights are not trusted", what)

    def close(self):
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- frames ----------------------------------------------------------------------------------

    def _fail(self, why: str, what: str):
        self.close()
        raise SyncError(f"fsdpx: {what} from the synchronizer at {self.where}: {why}")

    def _frame_deadline(self, timeout: float) -> Tuple[float, bool]:
        """When a frame must have arrived: within ``timeout``, and within the fetch's deadline (True when
        that comes first)."""
        deadline = time.monotonic() + timeout
        if self._deadline is not None and self._deadline < deadline:
            return self._deadline, True
        return deadline, False

    def _late(self, timeout: float, by_fetch: bool, what: str):
        if by_fetch:
            progress = f" ({self._progress})" if self._progress else ""
            self._fail(f"it did not finish within the fetch's timeout of {self._timeout} s{progress}: the server or the "
                       "network is slow or stalled, or the version is too large to arrive in that time (the timeout "
                       "covers the transfer: pass a longer one)", what)
        self._fail(f"it did not answer within {timeout} s (the server or the trainer behind it is stalled or "
                   "unreachable)", what)

    def _recv_into(self, view: memoryview, deadline: Tuple[float, bool], timeout: float, what: str) -> int:
        """Fills ``view`` by ``deadline`` (from _frame_deadline)."""
        assert self._sock is not None
        got = 0
        while got < len(view):
            left = deadline[0] - time.monotonic()
            if left <= 0:
                self._late(timeout, deadline[1], what)
            self._sock.settimeout(left)
            try:
                n = self._sock.recv_into(view[got:])
            except socket.timeout:
                continue
            except OSError as e:
                self._fail(f"the connection failed: {e}", what)
            if n == 0:
                self._fail("the server closed the connection (it exited, crashed or was stopped)", what)
            got += n
        return got

    def _recv_payload(self, length: int, deadline: Tuple[float, bool], what: str) -> bytearray:
        """``length`` bytes. The buffer grows as they arrive (doubling from 1 MiB): a header that
        announces a large frame makes the client hold only what was actually sent."""
        buf = bytearray(min(length, GROW))
        got = 0
        while True:
            got += self._recv_into(memoryview(buf)[got:], deadline, self.io_timeout, what)
            if got == length:
                return buf
            target = min(length, 2 * len(buf))
            while len(buf) < target:  # zeros from a shared block: no buffer of the whole size at once
                buf += _ZEROS[: target - len(buf)]

    def _write_frame(self, kind: int, version: int, aux: int, payload: bytes, what: str):
        assert self._sock is not None
        header = HEADER.pack(FRAME_MAGIC, kind, 0, version, len(payload), crc32c(payload) if payload else 0, aux)
        deadline, _ = self._frame_deadline(self.io_timeout)
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self._sock.sendall(header + payload)
        except OSError as e:
            self._fail(f"the connection failed: {e}", what)

    def _read_frame(self, timeout: float, what: str, text: bool = False):
        """(header fields, payload as a bytearray). Sizes are checked before anything is allocated, and
        the payload's buffer grows only as its bytes arrive. The header comes within ``timeout``, the
        payload within io_timeout, both within the fetch's deadline."""
        raw = bytearray(HEADER.size)
        self._recv_into(memoryview(raw), self._frame_deadline(timeout), timeout, what)
        h = HEADER.unpack(raw)
        magic, kind, _flags, _version, length, checksum, _aux = h
        if magic != FRAME_MAGIC:
            self._fail("a frame without the synchronizer's magic number (FXS2)", what)
        if kind not in KIND_NAMES:
            self._fail(f"a frame of unknown kind {kind}", what)
        limit = (MAX_RUN if kind == SNAPSHOT_BEGIN else MAX_TEXT if (text or kind == ERROR)
                 else self.max_bucket_bytes if kind == BUCKET else 0)
        if length > limit:
            self._fail(f"a {KIND_NAMES[kind]} frame of {length} bytes (at most {limit} allowed here)", what)
        payload = self._recv_payload(length, self._frame_deadline(self.io_timeout), what) if length else bytearray()
        if (crc32c(payload) if length else 0) != checksum:
            self._fail("a frame whose checksum does not match its payload (corrupted in transit)", what)
        return h, payload

    # ---- fetching --------------------------------------------------------------------------------

    @property
    def base_version(self) -> int:
        """The version a delta may be applied to (-1: none; the next fetch asks for a full version)."""
        return -1 if self._base is None else self._base.version

    def forget_base(self):
        """The next fetch asks for a full version."""
        self._base, self._base_module = None, None

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
        version, run, received = self._fetch(have, timeout, base)
        store = base if base is not None else VersionStore()
        try:
            changed = store.accept(received, in_place=False, where=f"the synchronizer at {self.where}")
        except SyncError as e:
            self.forget_base()
            raise SyncError(f"{e}; {_KEPT}") from None
        del received
        m = store.manifest
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
        if (self.keep_base and self._base is not None and self._base_module is not None
                and self._base_module() is module and have != -1 and self._base.version == have):
            targets = self._adoptable(module, self._base.manifest)
            if targets is not None:
                base = VersionStore()
                base.adopt(targets, self._base.manifest)  # the module's tensors now (a .to() replaces them)
        version, run, received = self._fetch(have, timeout, base)
        store = base if base is not None else VersionStore()
        try:
            with torch.no_grad():
                changed = store.accept(received, in_place=True, where=where)  # a delta: into the module, undone on failure
                del received
                m = store.manifest
                adopted = True
                if not m.is_delta:
                    WeightVersion(version, store.named(), run, m).load_into(module, strict=True)
                    targets = self._adoptable(module, m)
                    adopted = targets is not None
                    if adopted:
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
    def _adoptable(module: torch.nn.Module, manifest: Manifest) -> Optional[List[Tuple[str, torch.Tensor]]]:
        """The module's tensors of the version's names, in its order, when a delta can land in them in
        place: each contiguous, of the version's dtype and shape, no two sharing memory. Else None."""
        state = module.state_dict(keep_vars=True)
        out, spans = [], []
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

    def verify(self, target, version: Union[None, WeightVersion, Manifest] = None) -> bool:
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
    def _check_have(have: int):
        if have < -1:
            raise SyncError(f"fsdpx: fetching a version newer than {have}: versions are >= 0 (-1: any)")

    def _fetch(self, have: int, timeout: float, base: Optional[VersionStore]):
        """(version, run label, received tensors, the manifest first), asking for a delta from ``base``."""
        what = f"fetching a version newer than {have}"
        if self._sock is None or self._closed_by_server():
            self._connect(what)
        return self._fetch_once(have, timeout, what, base)

    def _closed_by_server(self) -> bool:
        """Between requests nothing may wait on the connection: a hang-up (the server's idle_timeout)
        or anything unasked for, seen without blocking, means a fresh connection."""
        assert self._sock is not None
        ready, _, _ = select.select([self._sock], [], [], 0)
        if not ready:
            return False
        if isinstance(self._sock, ssl.SSLSocket):
            return True  # TLS bytes unasked for (the server sends no session tickets): a close or an alert
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return True

    def _fetch_once(self, have: int, timeout: float, what: str, base: Optional[VersionStore]):
        timeout = min(max(timeout, 0.0), 365 * 24 * 3600.0)
        # The whole fetch ends by this deadline, whatever the server sends: a server trickling frames,
        # each within io_timeout, cannot keep it longer.
        self._deadline, self._timeout, self._progress = time.monotonic() + timeout, timeout, ""
        try:
            return self._fetch_stream(have, what, base)
        except BaseException:
            self.close()  # mid-stream, the connection is out of step: the next fetch opens a fresh one
            raise
        finally:
            self._deadline = None

    def _fetch_stream(self, have: int, what: str, base: Optional[VersionStore]):
        deadline = self._deadline
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
                            f"synchronizer at {self.where} has version {version}); the trainer may be slow, stopped or dead")
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
                late = False
                for n, e in enumerate(b.entries()):  # one at a time: a header of many entries holds none of them
                    if n & 1023 == 1023 and time.monotonic() > deadline:  # a bucket of many entries ends by it too
                        late = True
                        break
                    collector.accept(e, payload)
            except SyncError as e:
                self._fail(f"version {version}: {_unprefixed(e)}", what)
            if late:
                self._progress += f", bucket {k} parsed in part"
                self._late(0.0, True, what)
            del b, payload
        try:
            tensors = collector.finish()  # every element of every tensor exactly once
        except SyncError as e:
            self._fail(f"version {version}: {_unprefixed(e)}", what)
        if not tensors or tensors[0][0] != MANIFEST_NAME:
            self._fail(f"version {version} does not start with its manifest ('{MANIFEST_NAME}'): the server speaks an "
                       "older protocol (update it), or the version is corrupt", what)
        try:
            manifest_version = Manifest.decode(tensors[0][1], where=f"the synchronizer at {self.where}").version
        except SyncError:
            manifest_version = version  # a manifest that does not parse is refused by VersionStore.accept, naming why
        if manifest_version != version:  # as the C++ client and the server check
            self.forget_base()  # as every failure of a fetch: the next one asks for a full version
            self._fail(f"version {version} carries the manifest of version {manifest_version}", what)
        return version, run, tensors


_KEPT = "the weights held before are kept, bit for bit, and the next fetch asks for a full version"


def _unprefixed(e: Exception) -> str:
    text = str(e)
    return text[len("fsdpx: "):] if text.startswith("fsdpx: ") else text
