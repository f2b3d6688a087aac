"""What the Python sync tests that play a synchronizer share (python_security_test.py, python_delta_test.py,
receiver_cases.py): frames, crafted buckets (right or wrong), a fake server without a secret, and
expect_error. Every number of the wire comes from fsdpx_sync.wire: conftest.py (or receiver_cases.py) puts
the package on the path before this is imported."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Sequence

import torch

from fsdpx_sync import SyncError, crc32c
from fsdpx_sync.delta import dtype_code, full_manifest
from fsdpx_sync.wire import (
    ALIGNMENT,
    BUCKET,
    BUCKET_FORMAT,
    BUCKET_MAGIC,
    BUCKET_PREFIX,
    DTYPE_NDIM,
    ENTRY_PLACE,
    FRAME_MAGIC,
    HEADER,
    HELLO,
    MAC_BYTES,
    MANIFEST_NAME,
    NAME_LEN,
    NONCE,
    PREFIX_BYTES,
    PROTOCOL,
    SNAPSHOT_BEGIN,
    WELCOME,
)

Chunk = tuple[str, torch.Tensor, int, int]  # name, source tensor, element offset, element count
Frame = tuple[tuple[int, ...], bytearray]  # header fields, payload

# ---- frames (docs/sync.md, "Frames") -------------------------------------------------------------------


def frame(kind: int, version: int, aux: int, payload: bytes | bytearray = b"") -> bytes:
    return HEADER.pack(FRAME_MAGIC, kind, 0, version, len(payload), crc32c(payload) if payload else 0, aux) + bytes(
        payload)


def recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def recv_frame(conn: socket.socket) -> Frame | None:
    raw = recv_exact(conn, HEADER.size)
    if raw is None:
        return None
    h = HEADER.unpack(raw)
    payload = recv_exact(conn, h[4]) if h[4] else bytearray()
    return None if payload is None else (h, payload)


# ---- buckets, right or wrong (docs/sync.md, "The weight bucket") ----------------------------------------


def align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def craft_bucket(version: int, index: int, count: int, chunks: Sequence[Chunk], tight: bool = False,
                 zeros: bool = False) -> bytearray:
    """A bucket holding exactly `chunks` [(name, source, offset, numel)], right or wrong; chunks outside
    their source travel as zeros. `tight`: payloads packed without padding beyond each element's size
    (many tiny entries). `zeros`: every payload of "w" travels as zeros (quick for many chunks of zeros)."""
    header = PREFIX_BYTES
    for name, src, _, _ in chunks:
        header += 2 + len(name.encode()) + 2 + 8 * src.dim() + 24
    offset = align(header)
    header_bytes = offset
    places = []
    for _, src, _, n in chunks:
        offset = -(-offset // src.element_size()) * src.element_size()
        places.append(offset)
        nbytes = max(n, 0) * src.element_size()
        offset += nbytes if tight else align(nbytes)
    total = offset
    head = bytearray(BUCKET_PREFIX.pack(BUCKET_MAGIC, BUCKET_FORMAT, int(index + 1 == count), len(chunks), header_bytes,
                                        total, version, index, count))
    for (name, src, off, n), place in zip(chunks, places):
        head += NAME_LEN.pack(len(name.encode())) + name.encode() + DTYPE_NDIM.pack(dtype_code(src.dtype), src.dim())
        head += struct.pack(f"<{src.dim()}q", *src.shape) + ENTRY_PLACE.pack(off, n, place)
    out = bytearray(total)
    data = torch.frombuffer(out, dtype=torch.uint8)
    data[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    for (name, src, off, n), place in zip(chunks, places):
        if n > 0 and off >= 0 and off + n <= src.numel() and not (zeros and name == "w"):
            piece = src.reshape(-1)[off : off + n].contiguous().view(torch.uint8)
            data[place : place + piece.numel()] = piece
    return out


def version_frames(version: int, buckets: Sequence[Sequence[Chunk]], run: str = "fake", tight: bool = False,
                   zeros: bool = False) -> bytes:
    """The frames of a version whose buckets hold exactly `buckets` (lists of chunks), as a server sends them."""
    crafted = [craft_bucket(version, i, len(buckets), b, tight, zeros) for i, b in enumerate(buckets)]
    return frame(SNAPSHOT_BEGIN, version, len(crafted), run.encode()) + b"".join(
        frame(BUCKET, version, i, b) for i, b in enumerate(crafted))


def manifest_chunk(version: int, sources: dict[str, torch.Tensor]) -> Chunk:
    """The chunk of a version's manifest (protocol 4: every version starts with it) for these tensors."""
    m = full_manifest(version, list(sources.items())).encode()
    return (MANIFEST_NAME, m, 0, m.numel())


def empty_tensors(first: int, count: int) -> list[Chunk]:
    """Chunks of `count` distinct empty tensors named t<first>, t<first + 1>, ...: what a bucket of many
    entries and no bytes holds."""
    empty = torch.empty(0)
    return [(f"t{i}", empty, 0, 0) for i in range(first, first + count)]


# ---- a fake synchronizer --------------------------------------------------------------------------------


class FakeServer:
    """A fake synchronizer without a secret on 127.0.0.1: each connection gets the handshake, then
    `serve(conn, fetch)` for each fetch frame it sends. `threaded`: each connection on its own thread
    (else one at a time)."""

    def __init__(self, serve: Callable[[socket.socket, Frame], None] | None = None, threaded: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop, self.threaded, self.conns = False, threaded, []
        if serve is not None:
            self.serve = serve
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def serve(self, conn: socket.socket, fetch: Frame) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.conns.append(conn)
            if self.threaded:
                threading.Thread(target=self._session, args=(conn,), daemon=True).start()
            else:
                self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                conn.sendall(frame(HELLO, -1, PROTOCOL, bytes(NONCE)))
                auth = recv_frame(conn)
                assert auth is not None
                conn.sendall(frame(WELCOME, -1, auth[0][6], bytes(MAC_BYTES)))
                while (fetch := recv_frame(conn)) is not None:
                    self.serve(conn, fetch)
            except OSError:
                pass

    def close(self) -> None:
        self.stop = True
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)  # a client that stays connected ends its session
        self.thread.join()
        self.sock.close()


def expect_error(fn: Callable[[], object], *needles: str) -> str:
    """The text of the SyncError fn() raises, which must contain every needle."""
    try:
        fn()
    except SyncError as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in: {e}"
        return str(e)
    raise AssertionError(f"no SyncError (expected one with {needles})")
