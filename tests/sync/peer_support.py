"""What the Python sync tests share: for those against a C++ trainer (python_receiver_test.py,
python_watcher_test.py) their command line, a fresh work folder and a module with a tensor at every dotted
name; for those playing a synchronizer (python_security_test.py, receiver_cases.py) frames and crafted
buckets, right or wrong."""

import argparse
import struct
import os
import shutil


def peer_args(extra=None):
    """--package <python/> --program <python_peer_program> --mpiexec <mpiexec> --work <dir> [-- mpiexec flags];
    `extra(parser)` adds a test's own options. The work folder is emptied."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--work", required=True)
    if extra is not None:
        extra(ap)
    ap.add_argument("mpiexec_flags", nargs="*")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    return args


def build_module(torch, tensors, buffers=(), fill=-1.0):
    """A module tree with a parameter (or, for names in `buffers`, a buffer) at every dotted name of
    `tensors`, as a model would have, each filled with `fill`."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        if leaf in buffers:
            m.register_buffer(leaf, torch.full_like(t, fill))
        else:
            m.register_parameter(leaf, torch.nn.Parameter(torch.full_like(t, fill)))
    return root


# ---- frames, for the tests' fake synchronizers (docs/sync.md, "Frames") -------------------------------

HEADER = struct.Struct("<IHHqQQQ")  # magic, kind, flags, version, length, checksum, aux
MAGIC, PROTOCOL = 0x32535846, 4
BUCKET, FETCH, SNAPSHOT_BEGIN, HELLO, WELCOME = 2, 5, 6, 10, 12


def frame(kind, version, aux, payload=b""):
    from fsdpx_sync import crc32c  # after the test put the package on the path
    return HEADER.pack(MAGIC, kind, 0, version, len(payload), crc32c(payload) if payload else 0, aux) + bytes(payload)


def recv_exact(conn, n):
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def recv_frame(conn):
    raw = recv_exact(conn, HEADER.size)
    if raw is None:
        return None
    h = HEADER.unpack(raw)
    payload = recv_exact(conn, h[4]) if h[4] else bytearray()
    return None if payload is None else (h, payload)


def align(n):
    return (n + 63) // 64 * 64


def craft_bucket(torch, version, index, count, chunks, tight=False, zeros=False):
    """A bucket holding exactly `chunks` [(name, source, offset, numel)], right or wrong; chunks outside
    their source travel as zeros. `tight`: payloads packed without padding beyond each element's size
    (many tiny entries). `zeros`: every payload travels as zeros (quick for many chunks of zeros)."""
    from fsdpx_sync.bucket import BUCKET_FORMAT, BUCKET_MAGIC, DTYPES, PREFIX_BYTES
    header = PREFIX_BYTES
    for name, src, _, _ in chunks:
        header += 2 + len(name.encode()) + 2 + 8 * src.dim() + 24
    offset = align(header)
    header_bytes = offset
    places = []
    for name, src, off, n in chunks:
        offset = -(-offset // src.element_size()) * src.element_size()
        places.append(offset)
        nbytes = max(n, 0) * src.element_size()
        offset += nbytes if tight else align(nbytes)
    total = offset
    head = bytearray(struct.pack("<IHHIIQqII", BUCKET_MAGIC, BUCKET_FORMAT, int(index + 1 == count), len(chunks),
                                 header_bytes, total, version, index, count))
    for (name, src, off, n), place in zip(chunks, places):
        code = next(c for c, dtype in DTYPES.items() if dtype == src.dtype)
        head += struct.pack("<H", len(name.encode())) + name.encode() + struct.pack("<BB", code, src.dim())
        head += struct.pack(f"<{src.dim()}q", *src.shape) + struct.pack("<qqQ", off, n, place)
    out = bytearray(total)
    data = torch.frombuffer(out, dtype=torch.uint8)
    data[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    for (name, src, off, n), place in zip(chunks, places):
        if n > 0 and off >= 0 and off + n <= src.numel() and not (zeros and name == "w"):
            piece = src.reshape(-1)[off: off + n].contiguous().view(torch.uint8)
            data[place: place + piece.numel()] = piece
    return out


def version_frames(torch, version, buckets, run="fake", **craft):
    """The frames of a version whose buckets hold exactly `buckets` (lists of chunks), as a server sends them."""
    crafted = [craft_bucket(torch, version, i, len(buckets), b, **craft) for i, b in enumerate(buckets)]
    return frame(SNAPSHOT_BEGIN, version, len(crafted), run.encode()) + b"".join(
        frame(BUCKET, version, i, b) for i, b in enumerate(crafted))


def send_version(torch, conn, version, buckets, run="fake"):
    conn.sendall(version_frames(torch, version, buckets, run))


def manifest_chunk(version, sources):
    """The chunk of a version's manifest (protocol 4: every version starts with it) for these tensors."""
    from fsdpx_sync.delta import MANIFEST_NAME, full_manifest
    m = full_manifest(version, list(sources.items())).encode()
    return (MANIFEST_NAME, m, 0, m.numel())


def empty_tensors(torch, first, count):
    """Chunks of `count` distinct empty tensors named t<first>, t<first + 1>, ...: what a bucket of many
    entries and no bytes holds."""
    empty = torch.empty(0)
    return [(f"t{i}", empty, 0, 0) for i in range(first, first + count)]
