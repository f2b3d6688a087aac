"""What the Python tests against a C++ trainer share (python_receiver_test.py, python_watcher_test.py):
their command line, a fresh work folder, and a module with a tensor at every dotted name."""

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
