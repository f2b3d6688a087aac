"""Delta versions and proof of arrival in the Python receiver (protocol 4; docs/sync.md, "Delta
versions and proof of arrival"), against a fake protocol-4 synchronizer in this process that serves what
fsdpx_sync.delta's encoder cuts and chooses full or delta by each fetch's flags and digest, as the
server does.

1. A tiny transformers Qwen2 (tied head) trained with torch.optim.AdamW (lr 1e-5, then 1e-3), its
   weights cast to bfloat16 for the wire: after every version the receivers hold the trainer's bits
   exactly: fetch_newer with keep_base (copy-on-write: earlier versions never change), fetch_newer_into
   (in place, a second Qwen2 in bfloat16), and rollout models loaded through a fake vLLM
   (model.load_weights) and a fake SGLang (update_weights_from_tensor, "flattened_bucket").
2. A missed version, no base, a restarted client, another module: the server sends a full version,
   exact.
3. Corrupted deltas (a sparse value, the xor stream, the base digest, an index out of range, indices
   not ascending, a truncated payload, a zip bomb, bad manifest counts) and corrupted full versions:
   each a SyncError naming the tensor or the manifest; the kept version and the module keep their
   bits; the next fetch asks for a full version.
4. verify(): True on an exact copy, a SyncError naming a flipped tensor.
5. The manifest parser on hostile bytes, and the time a 1%-changed delta of a large bfloat16 model
   takes to apply and verify (FSDPX_DELTA_PERF_MB, 256 by default).

    python -m pytest tests/sync/python_delta_test.py [--package <python/>]
    (without transformers every test is skipped: exit status 77)
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import fsdpx_sync as fs
from frame_support import FakeServer, Frame, align, craft_bucket, expect_error, frame
from fsdpx_sync import codec
from fsdpx_sync.codec import bits_of
from fsdpx_sync.manifest import ENCODING_CODES
from fsdpx_sync.wire import BUCKET, FETCH, FETCH_HOLDS_BASE, SNAPSHOT_BEGIN, SPARSE, TIMEOUT, UNCHANGED, XOR

# The trainer and the rollouts are transformers' Qwen2: without transformers every test here is skipped (77).
pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

RUN = "0123456789abcdef0123456789abcdef"
Named = Sequence[tuple[str, torch.Tensor]]


# ---- a fake protocol-4 synchronizer ---------------------------------------------------------------


def pack_version(version: int, named: Named, limit: int = 24 << 10) -> list[bytearray]:
    """The buckets of a version: its tensors (the manifest first) in buckets of about ``limit`` bytes,
    a tensor larger than what is left of a bucket split over the next ones."""
    buckets: list[list[Any]] = []
    cur: list[Any] = []
    used = 0
    for name, tensor in named:
        t = tensor.detach().contiguous()
        n, es, off = t.numel(), t.element_size(), 0
        if n == 0:
            cur.append((name, t, 0, 0))
            continue
        while off < n:
            room = (limit - used) // es
            if room <= 0:
                buckets.append(cur)
                cur, used = [], 0
                continue
            k = min(room, n - off)
            cur.append((name, t, off, k))
            used += align(k * es)
            off += k
    if cur:
        buckets.append(cur)
    return [craft_bucket(version, i, len(buckets), b) for i, b in enumerate(buckets)]


class Published:
    def __init__(self, version: int, full: list[bytearray], delta: list[bytearray] | None,
                 base: tuple[int, int] | None) -> None:
        self.version, self.full, self.delta, self.base = version, full, delta, base


class FakeSynchronizer(FakeServer):
    """Serves the newest published version like the C++ server: to a fetch whose flags say the reader
    holds `have` of digest D, the delta when it was cut from exactly (have, D), else the full version;
    nothing newer: waits (the fetch's aux, ms), then a timeout frame. Records every fetch."""

    def __init__(self) -> None:
        self.newest: Published | None = None
        self.fetches: list[tuple[int, int, int, str]] = []  # (have, flags, digest, what was served)
        self.cond = threading.Condition()
        super().__init__(threaded=True)

    def publish(self, published: Published) -> None:
        with self.cond:
            self.newest = published
            self.cond.notify_all()

    def serve(self, conn: socket.socket, fetch: Frame) -> None:
        h, payload = fetch
        assert h[1] == FETCH and len(payload) >= 8, h
        flags, digest = struct.unpack_from("<II", payload)
        run = bytes(payload[8:]).decode()
        have, wait_ms = h[3], h[6]

        def newer() -> bool:
            return self.newest is not None and (self.newest.version > have or bool(run and run != RUN))

        with self.cond:
            self.cond.wait_for(newer, timeout=wait_ms / 1000)
            p = self.newest if newer() else None
        if p is None:
            self.fetches.append((have, flags, digest, "timeout"))
            conn.sendall(frame(TIMEOUT, -1 if self.newest is None else self.newest.version, 0))
            return
        delta = bool(flags & FETCH_HOLDS_BASE) and p.delta is not None and p.base == (have, digest)
        self.fetches.append((have, flags, digest, "delta" if delta else "full"))
        buckets = p.delta if delta and p.delta is not None else p.full
        conn.sendall(frame(SNAPSHOT_BEGIN, p.version, len(buckets), RUN.encode()))
        for i, b in enumerate(buckets):
            conn.sendall(frame(BUCKET, p.version, i, b))


class Publisher:
    """The trainer's side: fsdpx_sync's encoder (a VersionStore) cuts each version against the one
    before; the server gets the delta and the full version, either maybe tampered with."""

    def __init__(self, server):
        self.server, self.store = server, fs.VersionStore()
        self.counts = {"unchanged": 0, "sparse": 0, "full": 0, "xor": 0}
        self.sent = {"delta": 0, "full": 0}

    def publish(self, version, named, tamper_delta=None, tamper_full=None, force=None):
        enc = self.store.cut(version, named, force=force)
        full = fs.VersionStore().cut(version, named)
        assert not full.manifest.is_delta and full.manifest.digest == enc.manifest.digest
        base = (enc.manifest.base_version, enc.manifest.base_digest) if enc.manifest.is_delta else None
        delta_tensors = full_tensors = None
        if enc.manifest.is_delta:
            for k, v in enc.counts().items():
                self.counts[k] += v
            self.sent["delta"] += enc.bytes
            self.sent["full"] += full.bytes
            delta_tensors = [(n, t.clone()) for n, t in enc.tensors]
            if tamper_delta is not None:
                delta_tensors = tamper_delta(delta_tensors)
        full_tensors = [(n, t.clone()) for n, t in full.tensors]
        if tamper_full is not None:
            full_tensors = tamper_full(full_tensors)
        self.store.commit(enc)
        self.server.publish(Published(version, pack_version(version, full_tensors),
                                      None if delta_tensors is None else pack_version(version, delta_tensors), base))
        return enc


# ---- the trainer and the rollouts ------------------------------------------------------------------


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg)


class Trainer:
    def __init__(self):
        torch.manual_seed(20261126)
        self.model = qwen2()
        assert self.model.lm_head.weight is self.model.model.embed_tokens.weight
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    def step(self, lr, steps=2):
        for g in self.opt.param_groups:
            g["lr"] = lr
        for _ in range(steps):
            ids = torch.randint(0, 128, (4, 16))
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()

    def wire(self):
        """What the trainer sends: its parameters in bfloat16 (a tied head once, as named_parameters has it)."""
        return [(n, p.detach().to(torch.bfloat16)) for n, p in self.model.named_parameters()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return bits_of(t.detach().cpu().contiguous())


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_exact(got, expected, what):
    """Every (name, tensor) of `expected` is in `got` (pairs, a mapping or a module's state_dict), bit for bit."""
    if isinstance(got, torch.nn.Module):
        got = got.state_dict()
    got = dict(got)
    for name, t in expected:
        assert name in got, f"{what}: '{name}' is missing"
        assert same(got[name], t), f"{what}: '{name}' differs from the trainer's bits"


def snapshot(pairs):
    return [(n, t.detach().clone()) for n, t in pairs]


class FakeVllm:
    """vLLM's side: model.load_weights(weights: Iterable[Tuple[str, Tensor]]) on each worker; Qwen2's
    skips lm_head.weight when the head is tied, and copies by name (default_weight_loader)."""

    def __init__(self):
        self.model = qwen2().to(torch.bfloat16)
        self.loads = 0

    def load_weights(self, weights):
        params = dict(self.model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, t in weights:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue
                params[name].data.copy_(t)
                loaded.add(name)
        self.loads += len(loaded)
        return loaded


class FakeSglang:
    """SGLang's side (its model runner): update_weights_from_tensor(named_tensors, load_format=None |
    "flattened_bucket", flush_cache=True): a bucket is turned back into tensors, then model.load_weights."""

    def __init__(self):
        self.vllm_like = FakeVllm()
        self.model = self.vllm_like.model
        self.calls = self.flushes = 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls += 1
        if load_format == "flattened_bucket":
            named_tensors = fs.unflatten_bucket(named_tensors)
        elif load_format is not None:
            raise NotImplementedError(load_format)
        self.vllm_like.load_weights(named_tensors)
        self.flushes += bool(flush_cache)
        return True, "Success"


# ---- 1. exact deltas through training --------------------------------------------------------------


class Rig:
    """The trainer, the fake server, and the receivers: c1 (fetch_newer, keep_base) feeding a fake vLLM
    and a fake SGLang; c2 (fetch_newer_into) into a bfloat16 Qwen2."""

    def __init__(self):
        self.server = FakeSynchronizer()
        self.pub = Publisher(self.server)
        self.trainer = Trainer()
        self.version = 0
        self.c1 = fs.SyncClient("127.0.0.1", self.server.port, io_timeout=10)
        self.c2 = fs.SyncClient("127.0.0.1", self.server.port, io_timeout=10)
        self.rollout = qwen2().to(torch.bfloat16)
        self.vllm, self.sglang = FakeVllm(), FakeSglang()
        self.w1 = None  # c1's last version
        self.have2 = -1

    def publish(self, lr=None, **kw):
        if lr is not None:
            self.trainer.step(lr)
        self.version += 1
        return self.pub.publish(self.version, self.trainer.wire(), **kw)

    def last_fetch(self):
        return self.server.fetches[-1]

    def fetch1(self):
        have = -1 if self.w1 is None else self.w1.version
        w = self.c1.fetch_newer(have, timeout=10)
        self.w1 = w
        return w

    def fetch2(self):
        w = self.c2.fetch_newer_into(self.rollout, self.have2, timeout=10)
        self.have2 = w.version
        return w

    def close(self):
        for c in (self.c1, self.c2):
            c.close()
        self.server.close()


@pytest.fixture(scope="module")
def rig():
    """One training run that the tests below follow, each from where the one before left it."""
    r = Rig()
    yield r
    r.close()


def test_exact_deltas(rig):
    expected_encodings = set()
    rig.publish()
    w = rig.fetch1()
    assert not w.is_delta and w.version == 1 and rig.last_fetch()[1] == 0
    assert w.changed_names == [n for n, _ in rig.trainer.wire()]
    rig.vllm.load_weights(w.for_vllm())
    for b in w.for_sglang(bucket_bytes=16 << 10):
        rig.sglang.update_weights_from_tensor(b, load_format="flattened_bucket", flush_cache=False)
    w2 = rig.fetch2()
    assert not w2.is_delta and rig.c2.verify(rig.rollout)
    # The returned version's tensors are the module's own (it holds the wire dtype).
    assert w2.named()["model.norm.weight"].data_ptr() == rig.rollout.model.norm.weight.data_ptr()
    schedule = [1e-5, 1e-5, 1e-5, 1e-3, 1e-3, 1e-3, None]  # None: no step, every tensor unchanged
    for lr in schedule:
        prev, prev_bits = rig.w1, snapshot(rig.w1.tensors)
        enc = rig.publish(lr)
        expected_encodings |= {k for k, v in enc.counts().items() if v}
        wire = rig.trainer.wire()
        w = rig.fetch1()
        have, flags, digest, served = rig.last_fetch()
        assert (have, flags & FETCH_HOLDS_BASE, digest, served) == (prev.version, 1, prev.digest, "delta"), \
            rig.last_fetch()
        assert w.is_delta and w.version == rig.version and w.digest == enc.manifest.digest
        assert_exact(w.tensors, wire, f"fetch_newer, version {w.version}")
        assert w.verify(wire) and w.checksums == enc.manifest.checksums
        # Copy-on-write: the version before keeps its bits; untouched tensors are shared, touched ones new.
        assert_exact(prev.tensors, prev_bits, f"version {prev.version} after version {w.version} arrived")
        before, now = prev.named(), w.named()
        assert set(w.changed_names) == {e.name for e in enc.manifest.entries if e.encoding != UNCHANGED}
        for name in now:
            shared = now[name] is before[name]
            assert shared == (name not in w.changed_names), (name, shared)
        # The rollout engines load only what changed.
        loaded = rig.vllm.load_weights(w.for_vllm())
        assert loaded == set(w.changed_names), (loaded, w.changed_names)
        assert len(w.for_vllm(changed_only=False)) == len(wire)
        buckets = w.for_sglang(bucket_bytes=16 << 10)
        for b in buckets:
            flat, meta = b["flattened_tensor"], b["metadata"]
            assert flat.dim() == 1 and len({m.dtype for m in meta}) == 1 and flat.dtype == meta[0].dtype
            assert flat.numel() * flat.element_size() <= 16 << 10 or len(meta) == 1
            rig.sglang.update_weights_from_tensor(b, load_format="flattened_bucket", flush_cache=False)
        assert sum(len(b["metadata"]) for b in buckets) == len(w.changed_names)
        rig.sglang.update_weights_from_tensor([], flush_cache=True)
        assert_exact(rig.vllm.model, wire, f"vLLM rollout, version {w.version}")
        assert_exact(rig.sglang.model, wire, f"SGLang rollout, version {w.version}")
        # In place into the second Qwen2.
        w2 = rig.fetch2()
        assert rig.last_fetch()[1] & FETCH_HOLDS_BASE and rig.last_fetch()[3] == "delta" and w2.is_delta
        assert_exact(rig.rollout, wire, f"fetch_newer_into, version {w2.version}")
        assert rig.c2.verify(rig.rollout) and w.verify(rig.rollout) and w2.verify(w)
        # The tied head follows the embedding everywhere.
        for m in (rig.rollout, rig.vllm.model, rig.sglang.model):
            assert same(m.lm_head.weight, dict(wire)["model.embed_tokens.weight"])
        counts = ", ".join(f"{k} {v}" for k, v in enc.counts().items() if v)
        print(f"version {w.version} (lr {lr}): delta of {enc.bytes} bytes for {enc.full_bytes} ({counts}), "
              f"{len(w.changed_names)} tensors changed; fetch_newer, fetch_newer_into, vLLM, SGLang: bit-exact")
    assert expected_encodings >= {"unchanged", "sparse", "full", "xor"}, expected_encodings
    print(f"exact deltas: every encoding seen ({rig.pub.counts}); {rig.pub.sent['delta']} bytes sent as deltas where "
          f"full versions take {rig.pub.sent['full']}")


def test_load_newer_into(rig):
    """The verb every receiver shares: fetch_newer_into from the version fetched last, a delta in place."""
    assert rig.c2.last_version() == rig.have2
    rig.publish(1e-5)
    version = rig.c2.load_newer_into(rig.rollout, timeout=10)
    assert version == rig.version == rig.c2.last_version() and rig.c2.last_was_delta()
    assert_exact(rig.rollout, rig.trainer.wire(), f"load_newer_into, version {version}")
    assert rig.c2.verify(rig.rollout)
    rig.have2 = version


# ---- 2. a missed version, no base, a restarted client ---------------------------------------------


def test_full_when_needed(rig):
    port = rig.server.port
    have = rig.w1.version
    rig.publish(1e-5)
    rig.publish(1e-5)  # c1 missed the version the newest delta was cut from
    w = rig.fetch1()
    h, flags, digest, served = rig.last_fetch()
    assert (h, flags & 1, served) == (have, 1, "full") and not w.is_delta, rig.last_fetch()
    assert_exact(w.tensors, rig.trainer.wire(), "after a missed version")
    print(f"a missed version: the client held {have}, the newest delta starts at {rig.version - 1}: full, exact")

    # A restarted client (a new process) knows the version number, not the weights: full.
    restarted = fs.SyncClient("127.0.0.1", port)
    rig.publish(1e-5)
    w = restarted.fetch_newer(rig.version - 1, timeout=10)
    assert rig.last_fetch()[1:] == (0, 0, "full") and not w.is_delta, rig.last_fetch()
    assert_exact(w.tensors, rig.trainer.wire(), "a restarted client")
    # keep_base=False: never a delta.
    plain = fs.SyncClient("127.0.0.1", port, keep_base=False)
    got = plain.fetch_newer(-1, timeout=10)
    rig.publish(1e-5)
    w = plain.fetch_newer(got.version, timeout=10)
    assert rig.last_fetch()[1] == 0 and not w.is_delta and plain.base_version == -1
    assert_exact(w.tensors, rig.trainer.wire(), "keep_base=False")
    # fetch_newer_into another module than the one that holds the base: full; then the first one: full too.
    other = qwen2().to(torch.bfloat16)
    w = rig.c2.fetch_newer_into(other, rig.have2, timeout=10)
    assert rig.last_fetch()[1] == 0 and not w.is_delta
    assert_exact(other, rig.trainer.wire(), "fetch_newer_into another module")
    rig.publish(1e-5)
    w = rig.fetch2()
    assert rig.last_fetch()[1] == 0 and not w.is_delta  # its base is `other` now
    assert_exact(rig.rollout, rig.trainer.wire(), "fetch_newer_into, back to the first module")
    # A float32 module takes the version cast, and cannot hold a delta: the next fetch is full.
    wide = qwen2()
    client = fs.SyncClient("127.0.0.1", port)
    w = client.fetch_newer_into(wide, -1, timeout=10)
    assert client.base_version == -1
    for n, t in rig.trainer.wire():
        assert torch.equal(wide.state_dict()[n], t.float()), n
    expect_error(lambda: client.verify(wide), "model.embed_tokens.weight' is torch.float32")
    rig.publish(1e-5)
    client.fetch_newer_into(wide, w.version, timeout=10)
    assert rig.last_fetch()[1] == 0
    for c in (restarted, plain, client):
        c.close()
    # c1 missed versions: full; c2 holds the base of the newest delta (into the module it loaded last).
    assert not rig.fetch1().is_delta and rig.fetch2().is_delta
    rig.publish(1e-5)
    assert rig.fetch1().is_delta and rig.fetch2().is_delta
    assert_exact(rig.rollout, rig.trainer.wire(), "back on deltas")
    print("no base / a restarted client / keep_base=False / another module / a float32 module: full, exact; "
          "then deltas again")


# ---- 3. corruption: refused, nothing changes, the next fetch is full ------------------------------


LATE = "model.layers.1.mlp.down_proj.weight"  # late in the order: the tensors before it are applied, then undone


def travelling(tensors, encoding):
    """Names of the travelling tensors of an encoding in a delta's tensors, in order; LATE last when
    it is one of them (a large tensor near the end)."""
    m = fs.Manifest.decode(tensors[0][1])
    kinds = {e.name: e.encoding for e in m.entries}
    names = [n for n, _ in tensors[1:] if kinds[n] == encoding]
    if LATE in names:
        names = [n for n in names if n != LATE] + [LATE]
    return names, m


def replace(tensors, name, new):
    return [(n, new if n == name else t) for n, t in tensors]


def flip_last_sparse_value(tensors):
    names, _ = travelling(tensors, SPARSE)
    name = names[-1]
    t = dict(tensors)[name].clone()
    t[-1] ^= 0x40
    return replace(tensors, name, t), name


def flip_xor_byte(tensors):
    names, _ = travelling(tensors, XOR)
    name = names[-1]
    t = dict(tensors)[name].clone()
    t[t.numel() // 2] ^= 0xFF
    return replace(tensors, name, t), name


def wrong_base_digest(tensors):
    _, m = travelling(tensors, SPARSE)
    m.base_digest ^= 1  # the digest covers the entries: still consistent
    return replace(tensors, fs.MANIFEST_NAME, m.encode()), "delta from version"


def sparse_indices(tensors, edit):
    names, m = travelling(tensors, SPARSE)
    name = next(n for n in reversed(names) if m.index()[n].changed >= 2)
    e = m.index()[name]
    t = dict(tensors)[name].clone()
    idx = t[: e.changed * 4].view(torch.int32)
    edit(idx, e)
    return replace(tensors, name, t), name


def index_out_of_range(tensors):
    def edit(idx, e):
        idx[-1] = e.numel
    return sparse_indices(tensors, edit)


def indices_not_ascending(tensors):
    def edit(idx, e):
        idx[0], idx[1] = int(idx[1]), int(idx[0])
    return sparse_indices(tensors, edit)


def truncated(tensors):
    names, _ = travelling(tensors, SPARSE)
    name = names[-1]
    return replace(tensors, name, dict(tensors)[name][:-1].clone()), name


def zip_bomb(tensors):
    names, m = travelling(tensors, XOR)
    name = names[-1]
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros, for a tensor of 16 KiB
    return replace(tensors, name, torch.frombuffer(bytearray(bomb), dtype=torch.uint8)), name


def short_xor(tensors):
    names, m = travelling(tensors, XOR)
    name = names[-1]
    short = zlib.compress(bytes(m.index()[name].nbytes - 2))
    return replace(tensors, name, torch.frombuffer(bytearray(short), dtype=torch.uint8)), name


def manifest_count(change):
    def tamper(tensors):
        raw = bytearray(tensors[0][1].numpy().tobytes())
        count = struct.unpack_from("<I", raw, 32)[0]
        struct.pack_into("<I", raw, 32, change(count))
        return replace(tensors, fs.MANIFEST_NAME, torch.frombuffer(raw, dtype=torch.uint8)), "manifest"
    return tamper


def wrong_changed_count(tensors):
    names, m = travelling(tensors, SPARSE)
    name = names[-1]
    m.index()[name].changed += 1  # the digest does not cover it: the payload's size says it is wrong
    return replace(tensors, fs.MANIFEST_NAME, m.encode()), name


def full_flipped(tensors):
    name = tensors[3][0]
    t = tensors[3][1].clone()
    bits(t)[7] ^= 1
    return replace(tensors, name, t), name


def full_extra(tensors):
    return tensors + [("model.extra.weight", torch.zeros(3, dtype=torch.bfloat16))], "model.extra.weight"


def full_missing(tensors):
    return tensors[:5] + tensors[6:], tensors[5][0]


CORRUPT_DELTAS = [
    ("a sparse value flipped", 1e-5, "sparse", flip_last_sparse_value, ["does not match its checksum"]),
    ("a byte of the xor stream flipped", 1e-3, "xor", flip_xor_byte, ["(xor)"]),
    ("the wrong base digest", 1e-5, None, wrong_base_digest, ["nothing was applied"]),
    ("an index out of range", 1e-5, "sparse", index_out_of_range, ["lies outside its"]),
    ("indices not ascending", 1e-5, "sparse", indices_not_ascending, ["indices do not ascend"]),
    ("a truncated sparse payload", 1e-5, "sparse", truncated, ["bytes where"]),
    ("an xor stream inflating beyond its tensor (zip bomb)", 1e-3, "xor", zip_bomb, ["inflates beyond"]),
    ("an xor stream ending short", 1e-3, "xor", short_xor, ["(xor)", "the stream inflates to"]),
    ("a manifest count too large", 1e-5, None, manifest_count(lambda c: 0xFFFFFFF0), ["cannot fit in"]),
    ("a manifest count one short", 1e-5, None, manifest_count(lambda c: c - 1), ["follow the last of its"]),
    ("a changed count the payload does not have", 1e-5, "sparse", wrong_changed_count, ["bytes where"]),
]


@pytest.mark.parametrize(("what", "lr", "force", "tamper", "needles"), CORRUPT_DELTAS,
                         ids=[c[0] for c in CORRUPT_DELTAS])
def test_corrupt_delta(rig, what, lr, force, tamper, needles):
    """Refused by both receivers, naming the tensor; the kept version and the module keep their bits; the
    next fetch asks for a full version and gets it exactly."""
    # Both receivers hold the newest version, with a base.
    assert rig.c1.base_version == rig.w1.version == rig.have2 == rig.c2.base_version == rig.version
    kept1, kept2 = snapshot(rig.w1.tensors), snapshot(rig.rollout.state_dict().items())
    held1 = rig.w1
    named = {}

    def tamper_delta(tensors):
        tampered, name = tamper(tensors)
        named["name"] = name
        return tampered

    rig.publish(lr, tamper_delta=tamper_delta, force=force)
    started = time.monotonic()
    e1 = expect_error(lambda: rig.c1.fetch_newer(held1.version, 10), named["name"], *needles)
    assert rig.last_fetch()[1] & FETCH_HOLDS_BASE and rig.last_fetch()[3] == "delta"
    e2 = expect_error(lambda: rig.c2.fetch_newer_into(rig.rollout, rig.have2, 10), named["name"], *needles)
    took = time.monotonic() - started
    assert_exact(held1.tensors, kept1, f"{what}: the kept version")
    assert_exact(rig.rollout, kept2, f"{what}: the module")
    assert rig.c1.base_version == -1 and rig.c2.base_version == -1
    # The next fetch asks for a full version, and gets the version exactly.
    w = rig.fetch1()
    assert rig.last_fetch()[1] == 0 and rig.last_fetch()[3] == "full" and not w.is_delta, rig.last_fetch()
    w2 = rig.fetch2()
    assert rig.last_fetch()[1] == 0 and not w2.is_delta
    assert_exact(w.tensors, rig.trainer.wire(), f"{what}: the full version after")
    assert_exact(rig.rollout, rig.trainer.wire(), f"{what}: the module after")
    assert e1.split(": ", 2)[-1] == e2.split(": ", 2)[-1], (e1, e2)
    print(f"refused in {took:.2f}s, {what}: {e2}")


CORRUPT_FULL_VERSIONS = [
    ("a full version with a flipped bit", full_flipped, ["does not match its checksum"]),
    ("a full version with a tensor its manifest does not list", full_extra, ["its manifest does not list it"]),
    ("a full version with a tensor missing", full_missing, ["never arrived"]),
]


@pytest.mark.parametrize(("what", "tamper", "needles"), CORRUPT_FULL_VERSIONS,
                         ids=[c[0] for c in CORRUPT_FULL_VERSIONS])
def test_corrupt_full_version(rig, what, tamper, needles):
    """Refused by both receivers, naming the tensor; the module keeps its bits."""
    kept2 = snapshot(rig.rollout.state_dict().items())
    named = {}

    def tamper_full(tensors):
        tampered, name = tamper(tensors)
        named["name"] = name
        return tampered

    rig.publish(1e-5, tamper_full=tamper_full)
    rig.c2.forget_base()
    text = expect_error(lambda: rig.c2.fetch_newer_into(rig.rollout, rig.have2, 10), named["name"], *needles)
    assert rig.last_fetch()[1] == 0 and rig.last_fetch()[3] == "full"
    assert_exact(rig.rollout, kept2, f"{what}: the module")
    rig.c1.forget_base()
    expect_error(lambda: rig.c1.fetch_newer(rig.w1.version, 10), named["name"], *needles)
    print(f"refused, {what}: {text}")
    rig.publish(1e-5)
    rig.fetch1()
    rig.fetch2()
    assert_exact(rig.rollout, rig.trainer.wire(), f"{what}: the module after")


# ---- 4. verify --------------------------------------------------------------------------------------


def test_verify(rig):
    assert rig.c2.verify(rig.rollout) and rig.w1.verify(rig.rollout) and rig.c1.verify(rig.w1)
    copy = qwen2().to(torch.bfloat16)
    copy.load_state_dict(rig.rollout.state_dict())
    assert rig.w1.verify(copy)
    name = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        bits(copy.state_dict()[name])[100] ^= 1  # one element, one bit
    text = expect_error(lambda: rig.w1.verify(copy), f"'{name}' differs")
    assert text.count(" differs") == 1 and "missing" not in text and "not in version" not in text, text
    print(f"verify: an exact copy holds version {rig.w1.version}; one bit flipped: {text}")
    pairs = [(n, t) for n, t in rig.w1.tensors if n != "model.norm.weight"] + [("model.unexpected", torch.zeros(1))]
    text = expect_error(lambda: rig.c1.verify(pairs), "'model.norm.weight' is missing", "'model.unexpected' is not in")
    print(f"verify: missing and unexpected: {text}")


def test_cuda(rig):
    """With a GPU: deltas land in place in a CUDA module (sparse and xor, on the device), exact and
    verified; a corrupted one is undone there, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU here: the device paths were not run")
    model = qwen2().to(torch.bfloat16).cuda()
    client = fs.SyncClient("127.0.0.1", rig.server.port)
    have = client.fetch_newer_into(model, -1, timeout=10).version
    for lr, force in ((1e-5, "sparse"), (1e-3, "xor"), (1e-3, None), (1e-5, None)):
        rig.publish(lr, force=force)
        w = client.fetch_newer_into(model, have, timeout=10)
        assert w.is_delta and rig.last_fetch()[1] & FETCH_HOLDS_BASE and rig.last_fetch()[3] == "delta", \
            rig.last_fetch()
        assert model.model.embed_tokens.weight.is_cuda and w.named()["model.norm.weight"].is_cuda
        assert_exact(model, rig.trainer.wire(), f"CUDA module, version {w.version}")
        assert client.verify(model) and w.verify(model)
        have = w.version
    for what, force, tamper in (("a sparse value flipped", "sparse", flip_last_sparse_value),
                                ("a byte of the xor stream flipped", "xor", flip_xor_byte)):
        kept = snapshot(model.state_dict().items())
        rig.publish(1e-3 if force == "xor" else 1e-5, force=force, tamper_delta=lambda t, tamper=tamper: tamper(t)[0])
        text = expect_error(lambda have=have: client.fetch_newer_into(model, have, timeout=10), LATE)
        assert_exact(model, kept, f"CUDA module after {what}")
        w = client.fetch_newer_into(model, have, timeout=10)
        assert rig.last_fetch()[1] == 0 and not w.is_delta
        assert_exact(model, rig.trainer.wire(), f"CUDA module, full after {what}")
        have = w.version
        print(f"CUDA: refused, {what}, undone on the device: {text}")
    client.close()
    print(f"CUDA ({torch.cuda.get_device_name()}): deltas applied in place on the device, exact, verified")


# ---- 5. the manifest parser on hostile bytes, and speed ---------------------------------------------


def test_manifest_parser():
    m = fs.full_manifest(3, [("a.weight", torch.ones(4, 5, dtype=torch.bfloat16)), ("b", torch.zeros(7))])
    good = bytes(m.encode().numpy())
    assert fs.Manifest.decode(good).digest == m.digest
    name_at = 48 + 2  # the first entry's name

    def at(pos, fmt, value, raw=good):
        out = bytearray(raw)
        struct.pack_into(fmt, out, pos, value)
        return bytes(out)

    dtype_at = name_at + len("a.weight")
    cases = [
        ("magic", at(0, "<I", 0x12345678), "bad magic"),
        ("format", at(4, "<H", 2), "format 2"),
        ("a full version's base", at(16, "<q", 5), "with base 5"),
        ("count", at(32, "<I", 0xFFFFFFFF), "cannot fit"),
        ("name length", at(48, "<H", 60000), "ends inside a name"),
        ("dtype code", at(dtype_at, "<B", 42), "unknown dtype code 42"),
        ("rank", at(dtype_at + 1, "<B", 17), "17 dimensions"),
        ("shape overflow", at(dtype_at + 2, "<q", 1 << 62), "overflowing"),
        ("negative shape", at(dtype_at + 2, "<q", -4), "negative"),
        ("encoding", at(dtype_at + 2 + 16, "<B", 7), "unknown encoding 7"),
        ("sparse in a full version", at(dtype_at + 2 + 16, "<B", 1), "sparse in a full version"),
        ("the digest", at(28, "<I", m.digest ^ 1), "digest does not match"),
        ("truncated", good[:-3], "ends inside"),
        ("trailing bytes", good + b"\0", "1 bytes follow"),
    ]
    for _, raw, needle in cases:
        expect_error(lambda raw=raw: fs.Manifest.decode(raw, "a test"), needle, "manifest")
    twice = fs.Manifest(1, [m.entries[0], m.entries[0]])
    twice.digest = twice.compute_digest()
    expect_error(lambda: fs.Manifest.decode(twice.encode()), "listed twice")
    # A version without a manifest (an older sender) is refused, naming it.
    store = fs.VersionStore()
    expect_error(lambda: store.accept([("a", torch.zeros(2))]), "does not start with its manifest")
    print(f"manifest parser: {len(cases) + 2} hostile manifests refused, each naming the field")


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "without numpy"])
def test_layouts(use_numpy, monkeypatch):
    """Every dtype, odd shapes, empty tensors, each encoding forced, 8-byte indices, with and without
    numpy (the receiver's host paths): applied in place and copy-on-write, exact, verified."""
    if not use_numpy:
        monkeypatch.setattr(codec, "_np", None)
    gen = torch.Generator().manual_seed(7)
    base = [
        ("f32", torch.randn(3, 5, 7, generator=gen)),
        ("f64", torch.randn(1001, generator=gen, dtype=torch.float64)),
        ("bf16", torch.randn(64, 33, generator=gen).to(torch.bfloat16)),
        ("f16", torch.randn(17, generator=gen).to(torch.float16)),
        ("i8", torch.randint(-100, 100, (40,), generator=gen, dtype=torch.int8)),
        ("u8", torch.randint(0, 255, (9, 9), generator=gen, dtype=torch.uint8)),
        ("i32", torch.randint(0, 1 << 30, (50,), generator=gen, dtype=torch.int32)),
        ("i64", torch.randint(0, 1 << 40, (3, 3), generator=gen)),
        ("bool", torch.rand(100, generator=gen) > 0.5),
        ("empty", torch.zeros(4, 0)),
        ("scalar", torch.tensor(3.5)),
    ]

    def changed(step):
        out = []
        for k, (name, t) in enumerate(base):
            t = t.clone()
            if t.numel() and (k + step) % 4:
                flat = bits(t)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // (2 + step)),), generator=gen)
                flat[idx] = flat[idx] ^ 1
            out.append((name, t))
        return out

    runs = 0
    for force in (None, "sparse", "xor", "full"):
        pub, cow, module = fs.VersionStore(), fs.VersionStore(), fs.VersionStore()
        full = pub.cut(1, base)
        pub.commit(full)
        cow.accept(full.tensors)
        held = snapshot(base)
        module.adopt(held, full.manifest)
        current = base
        for step in (1, 2):
            current = changed(step)
            enc = pub.cut(1 + step, current, force=force)
            if force == "sparse" and step == 2:  # 8-byte indices, allowed for any tensor
                m = enc.manifest
                tensors = dict(enc.tensors)
                for e in m.entries:
                    if e.encoding == SPARSE:
                        p = tensors[e.name]
                        idx = p[: e.changed * 4].view(torch.int32).to(torch.int64)
                        tensors[e.name] = torch.cat([idx.view(torch.uint8), p[e.changed * 4 :]])
                        e.index_bytes = 8
                tensors[fs.MANIFEST_NAME] = m.encode()
                enc.tensors = [(n, tensors[n]) for n, _ in enc.tensors]
            pub.commit(enc)
            module.accept(enc.tensors, in_place=True)
            cow.accept(enc.tensors)
            assert_exact(held, current, f"layouts ({force}, numpy {use_numpy}): in place")
            assert_exact(cow.named(), current, f"layouts ({force}, numpy {use_numpy}): copy-on-write")
            assert fs.verify(held, enc.manifest) and fs.verify(cow.named(), enc.manifest)
            if force is not None:
                kinds = {e.encoding for e in enc.manifest.entries}
                assert kinds <= {UNCHANGED, ENCODING_CODES[force]} and ENCODING_CODES[force] in kinds, kinds
            runs += 1
    print(f"layouts: {len(base)} tensors of every dtype (empty and 0-d included), each encoding forced, 8-byte "
          f"indices, {'with' if use_numpy else 'without'} numpy: {runs} deltas exact in place and copy-on-write")


def test_engine_buckets():
    """for_sglang's buckets: grouped by dtype, within bucket_bytes (a larger tensor alone), in order;
    unflatten_bucket reads them and SGLang's newer byte layout alike."""
    ts = [("a", torch.randn(10, 10)), ("b", torch.randn(3).to(torch.bfloat16)), ("c", torch.randn(2000)),
          ("d", torch.randn(5)), ("e", torch.randn(4, 4).to(torch.bfloat16))]
    w = fs.WeightVersion(1, ts)
    buckets = w.for_sglang(bucket_bytes=1000)
    assert [[m.name for m in b["metadata"]] for b in buckets] == [["a"], ["c"], ["d"], ["b", "e"]], buckets
    for b in buckets:
        assert all(m.dtype == b["flattened_tensor"].dtype for m in b["metadata"])
    assert dict(p for b in w.for_sglang(metadata_class=dict) for p in fs.unflatten_bucket(b)).keys() == dict(ts).keys()
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in ts])
    meta, at = [], 0
    for n, t in ts:
        k = t.numel() * t.element_size()
        meta.append(fs.FlattenedTensorMetadata(n, t.shape, t.dtype, at, at + k, k))
        at += k
    for layout in (buckets, [{"flattened_tensor": flat, "metadata": meta}]):
        got = dict(p for b in layout for p in fs.unflatten_bucket(b))
        assert all(same(got[n], t) for n, t in ts)
    print("SGLang buckets: grouped by dtype, within bucket_bytes, both SGLang layouts read back exactly")


def test_speed():
    """A 1%-changed delta of FSDPX_DELTA_PERF_MB (256 by default) MiB of bfloat16 (8 tensors; 1% of each
    one's elements get a new value), as the encoder picks it (sparse) and forced xor: applied in place and
    copy-on-write, exact, then verified; the times of each printed."""
    mb = int(os.environ.get("FSDPX_DELTA_PERF_MB", "256"))
    n_tensors = 8
    per = (mb << 20) // 2 // n_tensors
    gen = torch.Generator().manual_seed(1)
    base = [(f"layers.{i}.weight", (torch.randn(per, generator=gen) * 0.02).to(torch.bfloat16).view(1024, -1))
            for i in range(n_tensors)]
    new = []
    for name, t in base:
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 100,), generator=gen)
        flat[idx] = (flat[idx].float() + torch.randn(idx.numel(), generator=gen) * 0.001).to(torch.bfloat16)
        new.append((name, t))
    for force in (None, "xor"):
        pub = fs.VersionStore()
        full = pub.cut(1, base)
        pub.commit(full)
        cow, module = fs.VersionStore(), fs.VersionStore()
        cow.accept(full.tensors)
        held = snapshot(base)
        module.adopt(held, full.manifest)
        enc = pub.cut(2, new, force=force)
        started = time.perf_counter()
        module.accept(enc.tensors, in_place=True)
        applied = time.perf_counter()
        fs.verify(held, enc.manifest)
        in_place = (applied - started, time.perf_counter() - applied)
        started = time.perf_counter()
        cow.accept(enc.tensors)
        applied = time.perf_counter()
        fs.verify(cow.named(), enc.manifest)
        copied = (applied - started, time.perf_counter() - applied)
        assert_exact(held, new, "speed: in place")
        assert_exact(cow.named(), new, "speed: copy-on-write")
        kinds = ", ".join(f"{k} {v}" for k, v in enc.counts().items() if v)
        print(f"speed, {mb} MiB of bfloat16, 1% changed, {'forced ' + force if force else 'as the encoder picks'} "
              f"({kinds}; {enc.bytes >> 10} KiB): in place {in_place[0]:.2f}s + verify {in_place[1]:.2f}s; "
              f"copy-on-write {copied[0]:.2f}s + verify {copied[1]:.2f}s (torch threads {torch.get_num_threads()})")
        del pub, full, cow, module, held, enc
    # The times are printed, not asserted: a test holds on a loaded machine; how fast the receiver applies a
    # delta is measured side by side by benchmarks/delta_sync_bench.py (docs/benchmarks.md).
