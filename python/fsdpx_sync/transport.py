"""The connection of a synchronizer client: connecting (TCP, or TLS with the certificate verified), the
HMAC handshake, and frames written and read within deadlines, every size checked before anything is
allocated and every payload's CRC-32C after (docs/sync.md, "Frames", "Authentication"). ``SyncClient``
(client.py) fetches versions over it.
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
from typing import NamedTuple, NoReturn, TypeVar

from . import wire
from .checksum import crc32c
from .errors import SyncError

GROW = 1 << 20  # a payload's buffer grows as its bytes arrive, from this much
_ZEROS = bytes(GROW)
_Self = TypeVar("_Self", bound="Connection")


class FrameHeader(NamedTuple):
    """A frame's 40-byte header (``wire.HEADER``), as read."""

    magic: int
    kind: int
    flags: int
    version: int
    length: int
    checksum: int
    aux: int


def handshake_mac(secret: bytes, label: bytes, role: int, first: bytes | bytearray, second: bytes | bytearray) -> bytes:
    return hmac.new(secret, label + struct.pack("<Q", role) + first + second, hashlib.sha256).digest()


class _Busy(Exception):
    """The server refused the connection for one of its limits, or closed it before the handshake
    ended: try again after ``pause`` seconds."""

    def __init__(self, reason: str, pause: float = 0.1) -> None:
        super().__init__(reason)
        self.pause = pause


class Connection:
    """One connection to a synchronizer server with the role "fetch": opened (and authenticated) on
    demand, closed on any failure. Not thread-safe."""

    def __init__(self, host: str, port: int, *, secret: None | str | bytes = None, connect_timeout: float = 10.0,
                 io_timeout: float = 60.0, max_bucket_bytes: int = wire.MAX_BUCKET_BYTES, tls: bool = False,
                 tls_ca_file: str | None = None, tls_server_name: str | None = None) -> None:
        self.where = f"{host}:{port}"
        self.address = (host, port)
        self._tls: tuple[ssl.SSLContext, str] | None = None
        if tls:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca_file)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            self._tls = (context, tls_server_name or host)
        if secret is None:
            secret = os.environ.get("FSDPX_SYNC_FETCH_SECRET") or os.environ.get("FSDPX_SYNC_SECRET") or ""
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.connect_timeout, self.io_timeout = connect_timeout, io_timeout
        self.max_bucket_bytes = max_bucket_bytes
        self._sock: socket.socket | None = None
        self._deadline: float | None = None  # while fetching: when the whole fetch must end
        self._peer_closed = False  # the last failure was the server closing the connection
        self._timeout, self._progress = 0.0, ""

    # ---- connection ------------------------------------------------------------------------------

    def _connect(self, what: str) -> None:
        """Connects and authenticates. A server that refuses the connection for a limit (too many
        connections waiting to authenticate), or closes it before the handshake ended (to make room in a
        full pool of them), is asked again on a fresh connection until connect_timeout; then the error
        says which limit."""
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
                time.sleep(min(left, busy.pause))

    def _connect_once(self, deadline: float) -> None:
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
                raise SyncError(f"fsdpx: the TLS handshake with the synchronizer at {self.where} failed: "
                                f"{e}{hint}") from None
        self._sock = sock
        self._peer_closed = False
        try:
            self._handshake()
        except SyncError as e:
            self.close()
            if self._peer_closed:
                raise _Busy(str(e), pause=0.02) from None
            raise
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        what = "the handshake"
        hello, nonce = self._read_frame(self.io_timeout, what, text=True)
        if hello[1] == wire.ERROR:
            self.close()
            text = nonce.decode("utf-8", "replace")
            if hello[6] == wire.REFUSED_BUSY:
                raise _Busy(text)
            raise SyncError(f"fsdpx: the synchronizer at {self.where} refused the connection: {text}")
        if hello[1] != wire.HELLO or hello[6] != wire.PROTOCOL or len(nonce) != wire.NONCE:
            self._fail(f"the server did not start with a protocol {wire.PROTOCOL} hello", what)
        mine = _secrets.token_bytes(wire.NONCE)
        mac = (handshake_mac(self._secret, wire.CLIENT_LABEL, wire.ROLE_FETCH, nonce, mine) if self._secret
               else bytes(wire.MAC_BYTES))
        self._write_frame(wire.AUTH, -1, wire.ROLE_FETCH, mine + mac, what)
        reply, payload = self._read_frame(self.io_timeout, what, text=True)
        if reply[1] == wire.ERROR and reply[6] == wire.REFUSED_BUSY:  # closed to make room for another
            self.close()
            raise _Busy(payload.decode("utf-8", "replace"))
        if reply[1] == wire.ERROR:
            hint = "" if self._secret else " (this client has no secret: pass secret= or set FSDPX_SYNC_SECRET)"
            raise SyncError(f"fsdpx: the synchronizer at {self.where} refused to let this client fetch: "
                            f"{payload.decode('utf-8', 'replace')}{hint}")
        if reply[1] != wire.WELCOME or len(payload) != wire.MAC_BYTES:
            self._fail("the server answered the handshake with something other than a welcome", what)
        if self._secret:
            expected = handshake_mac(self._secret, wire.SERVER_LABEL, wire.ROLE_FETCH, mine, nonce)
            if not hmac.compare_digest(expected, bytes(payload)):
                self._fail("the server did not prove it holds the fetch secret (it runs without one, or with "
                           "another): its weights are not trusted", what)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- frames ----------------------------------------------------------------------------------

    def _fail(self, why: str, what: str) -> NoReturn:
        self.close()
        raise SyncError(f"fsdpx: {what} from the synchronizer at {self.where}: {why}")

    def _frame_deadline(self, timeout: float) -> tuple[float, bool]:
        """When a frame must have arrived: within ``timeout``, and within the fetch's deadline (True when
        that comes first)."""
        deadline = time.monotonic() + timeout
        if self._deadline is not None and self._deadline < deadline:
            return self._deadline, True
        return deadline, False

    def _late(self, timeout: float, by_fetch: bool, what: str) -> NoReturn:
        if by_fetch:
            progress = f" ({self._progress})" if self._progress else ""
            self._fail(f"it did not finish within the fetch's timeout of {self._timeout} s{progress}: the server or "
                       "the network is slow or stalled, or the version is too large to arrive in that time (the "
                       "timeout covers the transfer: pass a longer one)", what)
        self._fail(f"it did not answer within {timeout} s (the server or the trainer behind it is stalled or "
                   "unreachable)", what)

    def _recv_into(self, view: memoryview, deadline: tuple[float, bool], timeout: float, what: str) -> int:
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
                self._peer_closed = isinstance(e, ConnectionResetError)
                self._fail(f"the connection failed: {e}", what)
            if n == 0:
                self._peer_closed = True
                self._fail("the server closed the connection (it exited, crashed or was stopped)", what)
            got += n
        return got

    def _recv_payload(self, length: int, deadline: tuple[float, bool], what: str) -> bytearray:
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

    def _write_frame(self, kind: int, version: int, aux: int, payload: bytes, what: str) -> None:
        assert self._sock is not None
        checksum = crc32c(payload) if payload else 0
        header = wire.HEADER.pack(wire.FRAME_MAGIC, kind, 0, version, len(payload), checksum, aux)
        deadline, _ = self._frame_deadline(self.io_timeout)
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            self._sock.sendall(header + payload)
        except OSError as e:
            self._fail(f"the connection failed: {e}", what)

    def _read_frame(self, timeout: float, what: str, text: bool = False) -> tuple[FrameHeader, bytearray]:
        """(header fields, payload as a bytearray). Sizes are checked before anything is allocated, and
        the payload's buffer grows only as its bytes arrive. The header comes within ``timeout``, the
        payload within io_timeout, both within the fetch's deadline."""
        raw = bytearray(wire.HEADER.size)
        self._recv_into(memoryview(raw), self._frame_deadline(timeout), timeout, what)
        h = FrameHeader(*wire.HEADER.unpack(raw))
        magic, kind, _flags, _version, length, checksum, _aux = h
        if magic != wire.FRAME_MAGIC:
            self._fail("a frame without the synchronizer's magic number (FXS2)", what)
        if kind not in wire.KIND_NAMES:
            self._fail(f"a frame of unknown kind {kind}", what)
        limit = (wire.MAX_RUN if kind == wire.SNAPSHOT_BEGIN else wire.MAX_TEXT if (text or kind == wire.ERROR)
                 else self.max_bucket_bytes if kind == wire.BUCKET else 0)
        if length > limit:
            self._fail(f"a {wire.KIND_NAMES[kind]} frame of {length} bytes (at most {limit} allowed here)", what)
        payload = self._recv_payload(length, self._frame_deadline(self.io_timeout), what) if length else bytearray()
        if (crc32c(payload) if length else 0) != checksum:
            self._fail("a frame whose checksum does not match its payload (corrupted in transit)", what)
        return h, payload

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

