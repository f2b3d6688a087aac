"""A client of fsdpx's synchronizer server (fsdpx/sync/server.hpp) for Python rollout workers.

    from fsdpx_sync import SyncClient
    client = SyncClient("10.0.0.1", 5710, secret=os.environ["FSDPX_SYNC_SECRET"])
    version = -1
    while True:
        weights = client.fetch_newer(version, timeout=600)    # all of one version, checked, or SyncError
        llm.model.load_weights(weights)                       # vLLM / SGLang: an iterable of (name, tensor)
        # or: weights.load_into(hf_model)                     # transformers: by name, strict
        version = weights.version

The wire protocol is specified in docs/sync.md ("Frames" and "Authentication").
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
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import torch

from .bucket import PREFIX_BYTES, Collector, decode_bucket
from .checksum import crc32c
from .errors import SyncError

FRAME_MAGIC = 0x32535846  # "FXS2"
PROTOCOL = 2
HEADER = struct.Struct("<IHHqQQQ")  # magic, kind, flags, version, length, checksum, aux
MAX_TEXT = 64 << 10
NONCE = 32
CLIENT_LABEL = b"fsdpx-sync-2 client"
SERVER_LABEL = b"fsdpx-sync-2 server"
ROLE_PUBLISH, ROLE_FETCH = 1, 2

(PUBLISH_BEGIN, BUCKET, PUBLISH_END, ACK, FETCH, SNAPSHOT_BEGIN, TIMEOUT, ERROR, GOODBYE, HELLO, AUTH,
 WELCOME) = range(1, 13)
KIND_NAMES = {1: "publish_begin", 2: "bucket", 3: "publish_end", 4: "ack", 5: "fetch", 6: "snapshot_begin",
              7: "timeout", 8: "error", 9: "goodbye", 10: "hello", 11: "auth", 12: "welcome"}


def handshake_mac(secret: bytes, label: bytes, role: int, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, label + struct.pack("<Q", role) + first + second, hashlib.sha256).digest()


@dataclass
class WeightVersion:
    """All tensors of one version, in the order they were published; iterating yields (name, tensor)."""

    version: int
    tensors: List[Tuple[str, torch.Tensor]] = field(default_factory=list)

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def named(self) -> dict:
        return dict(self.tensors)

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
                 tls: bool = False, tls_ca_file: Optional[str] = None, tls_server_name: Optional[str] = None):
        """tls: speak TLS to a server that does; its certificate must be signed by an authority of
        ``tls_ca_file`` (PEM; None: the system's) and name ``tls_server_name`` (default: ``host``)."""
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

    # ---- connection ------------------------------------------------------------------------------

    def _connect(self):
        self.close()
        deadline = time.monotonic() + self.connect_timeout
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

    def _recv_into(self, view: memoryview, timeout: float, what: str):
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        got = 0
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"it did not answer within {timeout} s (the server or the trainer behind it is stalled "
                           "or unreachable)", what)
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

    def _write_frame(self, kind: int, version: int, aux: int, payload: bytes, what: str):
        assert self._sock is not None
        header = HEADER.pack(FRAME_MAGIC, kind, 0, version, len(payload), crc32c(payload) if payload else 0, aux)
        self._sock.settimeout(self.io_timeout)
        try:
            self._sock.sendall(header + payload)
        except OSError as e:
            self._fail(f"the connection failed: {e}", what)

    def _read_frame(self, timeout: float, what: str, text: bool = False):
        """(header fields, payload as a bytearray). Sizes are checked before anything is allocated."""
        raw = bytearray(HEADER.size)
        self._recv_into(memoryview(raw), timeout, what)
        h = HEADER.unpack(raw)
        magic, kind, _flags, _version, length, checksum, _aux = h
        if magic != FRAME_MAGIC:
            self._fail("a frame without the synchronizer's magic number (protocol 2)", what)
        if kind not in KIND_NAMES:
            self._fail(f"a frame of unknown kind {kind}", what)
        limit = MAX_TEXT if (text or kind == ERROR) else self.max_bucket_bytes if kind == BUCKET else 0
        if length > limit:
            self._fail(f"a {KIND_NAMES[kind]} frame of {length} bytes (at most {limit} allowed here)", what)
        payload = bytearray(length)
        if length:
            self._recv_into(memoryview(payload), self.io_timeout, what)
        if (crc32c(payload) if length else 0) != checksum:
            self._fail("a frame whose checksum does not match its payload (corrupted in transit)", what)
        return h, payload

    # ---- fetching --------------------------------------------------------------------------------

    def fetch_newer(self, have: int = -1, timeout: float = 60.0) -> WeightVersion:
        """The newest version once it is newer than ``have`` (-1: any), waiting up to ``timeout``
        seconds. All of one version, every frame's CRC-32C checked, or a SyncError."""
        if have < -1:
            raise SyncError(f"fsdpx: fetching a version newer than {have}: versions are >= 0 (-1: any)")
        what = f"fetching a version newer than {have}"
        if self._sock is None or self._closed_by_server():
            self._connect()
        return self._fetch_once(have, timeout, what)

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

    def _fetch_once(self, have: int, timeout: float, what: str) -> WeightVersion:
        try:
            return self._fetch_stream(have, timeout, what)
        except BaseException:
            self.close()  # mid-stream, the connection is out of step: the next fetch opens a fresh one
            raise

    def _fetch_stream(self, have: int, timeout: float, what: str) -> WeightVersion:
        timeout = min(max(timeout, 0.0), 365 * 24 * 3600.0)
        deadline = time.monotonic() + timeout
        while True:
            # The server may answer `timeout` early (it caps a wait at its idle_timeout): ask again.
            left = max(0.0, deadline - time.monotonic())
            self._write_frame(FETCH, have, int(left * 1000), b"", what)
            begin, text = self._read_frame(left + self.io_timeout, what)
            if begin[1] != TIMEOUT or time.monotonic() >= deadline:
                break
        kind, version, count = begin[1], begin[3], begin[6]
        if kind == TIMEOUT:
            raise SyncError(f"fsdpx: no weight version newer than {have} was published within {timeout} s (the "
                            f"synchronizer at {self.where} has version {version}); the trainer may be slow, stopped or dead")
        if kind == ERROR:
            raise SyncError(f"fsdpx: the synchronizer at {self.where} answered: {text.decode('utf-8', 'replace')}")
        if kind != SNAPSHOT_BEGIN:
            self._fail(f"an unexpected {KIND_NAMES.get(kind, kind)} frame", what)
        if version <= have:
            self._fail(f"it sent version {version} for a request newer than {have}", what)
        if count == 0 or count > self.max_version_bytes // PREFIX_BYTES:
            self._fail(f"a version of {count} buckets", what)
        collector = Collector(self.max_version_bytes)
        for k in range(count):
            frame, payload = self._read_frame(self.io_timeout, what)
            if frame[1] != BUCKET:
                self._fail("a bucket frame was expected", what)
            b = decode_bucket(payload, f"synchronizer {self.where}")
            if b.version != version or b.index != k or b.count != count or b.total_bytes != len(payload):
                self._fail(f"bucket {b.index} of {b.count} of version {b.version} ({b.total_bytes} bytes) arrived "
                           f"where bucket {k} of {count} of version {version} ({len(payload)} bytes) was expected", what)
            for e in b.entries:
                collector.accept(e, payload)
        return WeightVersion(version, collector.finish())
