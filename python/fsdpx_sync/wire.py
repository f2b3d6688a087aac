"""Every number this package and fsdpx's C++ side must agree on, defined once: the synchronizer's frames
and handshake (docs/sync.md, "Frames", "Authentication"), the weight bucket ("The weight bucket"), the
receivers' bounds on bookkeeping ("Bounds on bookkeeping"), the manifest and the delta encodings ("Delta
versions and proof of arrival"), and the bounds of the checkpoint readers (docs/checkpoint.md).

``CONSTANTS`` lists each number under a stable name, ``STRINGS`` each text: a test compares them with
what the C++ headers define. No torch here: the dtypes are named by their torch names.
"""

from __future__ import annotations

import struct

# ---- frames (fsdpx/sync/detail/frame.hpp) ---------------------------------------------------------------

FRAME_MAGIC = 0x32535846  # "FXS2"
PROTOCOL = 4
HEADER = struct.Struct("<IHHqQQQ")  # magic, kind, flags, version, length, checksum, aux
(PUBLISH_BEGIN, BUCKET, PUBLISH_END, ACK, FETCH, SNAPSHOT_BEGIN, TIMEOUT, ERROR, GOODBYE, HELLO, AUTH,
 WELCOME) = range(1, 13)
KIND_NAMES = {PUBLISH_BEGIN: "publish_begin", BUCKET: "bucket", PUBLISH_END: "publish_end", ACK: "ack",
              FETCH: "fetch", SNAPSHOT_BEGIN: "snapshot_begin", TIMEOUT: "timeout", ERROR: "error",
              GOODBYE: "goodbye", HELLO: "hello", AUTH: "auth", WELCOME: "welcome"}
FETCH_HOLDS_BASE = 1  # a fetch's flags: the reader holds version `have` exactly, of the digest that follows
MAX_TEXT = 64 << 10  # an error's text (and a handshake frame's payload)
MAX_RUN = 256  # a run's identity, or its label
REFUSED_BUSY = 1  # an error frame's aux: refused at accept for a limit, try again later
# What a client accepts by default (both clients: the shared receiver cases quote them).
MAX_BUCKET_BYTES = 1 << 30
MAX_VERSION_BYTES = 64 << 30

# ---- the handshake (fsdpx/sync/detail/handshake.hpp, auth.hpp) -------------------------------------------

NONCE = 32
MAC_BYTES = 32
CLIENT_LABEL = b"fsdpx-sync-2 client"
SERVER_LABEL = b"fsdpx-sync-2 server"
ROLE_PUBLISH, ROLE_FETCH = 1, 2

# ---- the weight bucket (fsdpx/sync/detail/wire.hpp) ------------------------------------------------------

BUCKET_MAGIC = 0x42535846  # "FXSB"
BUCKET_FORMAT = 1
# magic, format, flags (bit 0: the version's last bucket), entry count, header bytes, total bytes, version, index, count
BUCKET_PREFIX = struct.Struct("<IHHIIQqII")
PREFIX_BYTES = BUCKET_PREFIX.size  # 40
# An entry (and a manifest entry's identity): u16 name length, the name, u8 dtype code, u8 rank, i64 shape[rank];
# then a bucket entry's place: element offset, element count, byte offset.
NAME_LEN = struct.Struct("<H")
DTYPE_NDIM = struct.Struct("<BB")
ENTRY_PLACE = struct.Struct("<qqQ")
ALIGNMENT = 64  # a sender's payloads start at multiples of it (a receiver does not rely on it)
MAX_NDIM = 16
# Bytes an entry takes in a header at the least: a count the header cannot hold is refused at once.
MIN_ENTRY_BYTES = 2 + 1 + 1 + 3 * 8
# Our own codes, by torch's dtype names (bucket.DTYPES maps them to torch dtypes).
DTYPE_CODES = {"float32": 1, "float64": 2, "bfloat16": 3, "float16": 4, "int8": 5, "uint8": 6, "int32": 7,
               "int64": 8, "bool": 9}

# A receiver's bookkeeping costs memory whatever the bytes that came with it: a bucket's parsed entries may
# exceed the bytes at hand by at most HEADER_BOOKKEEPING_FLOOR, a version's tensors and manifest entries the
# bytes that arrived by at most VERSION_BOOKKEEPING_FLOOR: the C++ receivers' rule with the same per-tensor
# cost, so that what the server commits, every receiver accepts (upper bounds of Python's costs).
HEADER_BOOKKEEPING_FLOOR = 64 << 20
VERSION_BOOKKEEPING_FLOOR = 256 << 20
PARSED_ENTRY_BYTES = 256  # what the C++ reader holds per parsed entry: the same counts are refused here
TENSOR_BOOKKEEPING = 2048  # a received tensor besides its elements (two tensor objects, three dict entries)
RANGE_BOOKKEEPING = 64  # a range of received elements (chunks out of order)
MANIFEST_ENTRY_BOOKKEEPING = 512  # a decoded entry, its name and its place in the name set (about 275 in Python)

# ---- the manifest and the delta encodings (fsdpx/sync/manifest.hpp) --------------------------------------

MANIFEST_NAME = ".fsdpx.manifest"
MANIFEST_MAGIC = 0x4D535846  # "FXSM"
MANIFEST_FORMAT = 1
MANIFEST_PREFIX = struct.Struct("<IHHqqIIIIQ")  # magic, format, flags, version, base, base digest, digest, count, 0, 0
MANIFEST_TAIL = struct.Struct("<BBHIq")  # an entry after its identity: encoding, index bytes, zero, crc, changed
# An entry's fixed fields: a count the bytes cannot hold is refused before anything is parsed.
MANIFEST_MIN_ENTRY_BYTES = 2 + 1 + 1 + 1 + 1 + 2 + 4 + 8
UNCHANGED, SPARSE, FULL, XOR = 0, 1, 2, 3
ENCODING_NAMES = {UNCHANGED: "unchanged", SPARSE: "sparse", FULL: "full", XOR: "xor"}
NARROW_INDEX_LIMIT = 1 << 32  # sparse indices take 4 bytes in a tensor of at most this many elements, else 8

# ---- CRC-32C (fsdpx/detail/crc32c.hpp) -------------------------------------------------------------------

CRC32C_POLYNOMIAL = 0x82F63B78  # reflected Castagnoli

# ---- checkpoints (fsdpx/checkpoint/format.hpp, fsdpx/detail/file_io.hpp) ---------------------------------

STATE_DICT_ITERATION_FILE = "latest_state_dict_iteration.txt"
COMMIT_RECORD = "fsdp_config.json"
CHECKPOINT_FORMAT_VERSION = 1
MAX_WORLD_SIZE = 1 << 17  # a record cannot make a reader allocate without bound
MAX_RECORD_FILE_BYTES = 16 << 20  # the most bytes read from an iteration file or commit record

CONSTANTS: dict[str, int] = {
    "frame_magic": FRAME_MAGIC,
    "protocol_version": PROTOCOL,
    "frame_header_bytes": HEADER.size,
    **{f"msg_{name}": kind for kind, name in KIND_NAMES.items()},
    "fetch_holds_base": FETCH_HOLDS_BASE,
    "max_error_bytes": MAX_TEXT,
    "max_run_bytes": MAX_RUN,
    "refused_busy": REFUSED_BUSY,
    "default_max_bucket_bytes": MAX_BUCKET_BYTES,
    "default_max_version_bytes": MAX_VERSION_BYTES,
    "nonce_bytes": NONCE,
    "mac_bytes": MAC_BYTES,
    "role_publish": ROLE_PUBLISH,
    "role_fetch": ROLE_FETCH,
    "bucket_magic": BUCKET_MAGIC,
    "bucket_format": BUCKET_FORMAT,
    "bucket_prefix_bytes": PREFIX_BYTES,
    "bucket_alignment": ALIGNMENT,
    "max_ndim": MAX_NDIM,
    "bucket_min_entry_bytes": MIN_ENTRY_BYTES,
    **{f"dtype_code_{name}": code for name, code in DTYPE_CODES.items()},
    "header_bookkeeping_floor": HEADER_BOOKKEEPING_FLOOR,
    "version_bookkeeping_floor": VERSION_BOOKKEEPING_FLOOR,
    "parsed_entry_bytes": PARSED_ENTRY_BYTES,
    "tensor_bookkeeping_bytes": TENSOR_BOOKKEEPING,
    "range_bookkeeping_bytes": RANGE_BOOKKEEPING,
    "manifest_entry_bookkeeping_bytes": MANIFEST_ENTRY_BOOKKEEPING,
    "manifest_magic": MANIFEST_MAGIC,
    "manifest_format": MANIFEST_FORMAT,
    "manifest_prefix_bytes": MANIFEST_PREFIX.size,
    "manifest_min_entry_bytes": MANIFEST_MIN_ENTRY_BYTES,
    "encoding_unchanged": UNCHANGED,
    "encoding_sparse": SPARSE,
    "encoding_full": FULL,
    "encoding_xor_zlib": XOR,
    "sparse_narrow_index_limit": NARROW_INDEX_LIMIT,
    "crc32c_polynomial": CRC32C_POLYNOMIAL,
    "checkpoint_format_version": CHECKPOINT_FORMAT_VERSION,
    "checkpoint_max_world_size": MAX_WORLD_SIZE,
    "max_record_file_bytes": MAX_RECORD_FILE_BYTES,
}

STRINGS: dict[str, str] = {
    "handshake_client_label": CLIENT_LABEL.decode(),
    "handshake_server_label": SERVER_LABEL.decode(),
    "manifest_name": MANIFEST_NAME,
    "state_dict_iteration_file": STATE_DICT_ITERATION_FILE,
    "commit_record": COMMIT_RECORD,
}
