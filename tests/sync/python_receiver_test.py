"""The Python receiver against a C++ trainer (label "sync"): fsdpx_sync is pip-installed into a
temporary directory, then receives every version a 2-rank fsdpx trainer publishes, with its secret,
bit-exact against what the trainer wrote, buffers included, and loads each into a torch module by
name with the strict check. A wrong secret is refused. With --hf-model, a second trainer fine-tunes
that Hugging Face model (fsdpx's decoder, loaded with models::from_pretrained) and Python receives every
version into transformers' own class of the model, by name, strict (its tied head needs no copy of its
own), bit-exact.

    python -m pytest python_receiver_test.py --package <python/> --program <python_peer_program>
           --mpiexec <mpiexec> --work <dir> [--hf-model <folder>] [--mpiexec-flag=<flag> ...]

fsdpx_sync is imported only from the installed copy (the `package` fixture), never from the sources.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from peer_support import Peer, build_module

VERSIONS = 4
SECRET = "python-receiver-test-secret"
Check = Callable[[int, Any, dict[str, torch.Tensor]], None]  # (version, WeightVersion, what the trainer wrote)


@pytest.fixture(scope="module")
def package(request: pytest.FixtureRequest, work: str) -> ModuleType:
    """fsdpx_sync, pip-installed (offline, depending on torch only) from a copy of --package (pip's build
    leaves its build/ and egg-info beside the sources) into <work>/site, and imported from there."""
    assert "fsdpx_sync" not in sys.modules, "fsdpx_sync was imported before it was installed"
    source = os.path.join(work, "package")
    shutil.copytree(request.config.getoption("package"), source)
    site = os.path.join(work, "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", site, source], check=True)
    sys.path.insert(0, site)
    import fsdpx_sync

    assert fsdpx_sync.__file__ is not None and fsdpx_sync.__file__.startswith(site), fsdpx_sync.__file__
    return fsdpx_sync


def test_installed(package: ModuleType, work: str) -> None:
    """The version is the package's one (pyproject reads fsdpx_sync.__version__), its annotations typed (PEP 561)."""
    assert importlib.metadata.version("fsdpx-sync") == package.__version__
    assert os.path.isfile(os.path.join(os.path.dirname(package.__file__), "py.typed"))


def test_crc32c(package: ModuleType) -> None:
    """The torch fallback and the native CRC-32C (when installed) equal the bytewise definition."""
    from fsdpx_sync.checksum import _TABLE, crc32c_torch

    assert package.crc32c(b"123456789") == 0xE3069283 == crc32c_torch(b"123456789")
    for n in (0, 1, 63, 64, 65, 4095, 70001):
        data = bytearray(os.urandom(n))
        c = 0xFFFFFFFF
        for b in data:
            c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
        assert crc32c_torch(data) == package.crc32c(data) == c ^ 0xFFFFFFFF, n
        assert crc32c_torch(data[n // 2 :], crc32c_torch(data[: n // 2])) == crc32c_torch(data), n


def gpt_check() -> Check:
    """Each version of the GPT loaded into a module of its names (the step counter a buffer), strict: the
    first version also shows that a name the module has and the version lacks is reported."""
    from fsdpx_sync import SyncError

    module: torch.nn.Module | None = None

    def check(v: int, weights: Any, expected: dict[str, torch.Tensor]) -> None:
        nonlocal module
        got = weights.named()
        assert got["step_count"].dtype == torch.float32 and torch.all(got["step_count"] == v)
        if module is None:
            module = build_module(expected, buffers={"step_count"})
            # Strict: a name the module lacks is named in the error, and nothing is copied.
            extra = torch.nn.Module()
            extra.register_parameter("not_sent", torch.nn.Parameter(torch.zeros(1)))
            module.add_module("extra", extra)
            with pytest.raises(SyncError, match="missing: extra.not_sent"):
                weights.load_into(module)
            del module.extra
        weights.load_into(module)  # vLLM's load_weights takes the same pairs: iter(weights)
        for name, t in module.state_dict().items():
            assert torch.equal(t, expected[name].to(t.dtype)), f"version {v}: {name} was not loaded"

    return check


def test_gpt(package: ModuleType, peer: Peer) -> None:
    receive(peer, [], dict(os.environ, FSDPX_SYNC_SECRET=SECRET), gpt_check(), "a GPT")


def test_gpt_over_tls(package: ModuleType, peer: Peer) -> None:
    """A self-signed certificate for 127.0.0.1: the client verifies it, and refuses another."""
    from fsdpx_sync import SyncClient, SyncError

    cert, key, other = (os.path.join(peer.work, f) for f in ("cert.pem", "key.pem", "other.pem"))
    for c, k in ((cert, key), (other, other + ".key")):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "2", "-subj", "/CN=fsdpx-test", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", k, "-out", c], check=True, capture_output=True)

    def refusals(port: int) -> None:
        with pytest.raises(SyncError) as refused:
            SyncClient("127.0.0.1", port, secret=SECRET, tls=True, tls_ca_file=other).fetch_newer(-1, timeout=5)
        assert "TLS handshake" in str(refused.value) and "certificate" in str(refused.value), refused.value
        with pytest.raises(SyncError):  # a plain client is not served by a TLS server
            SyncClient("127.0.0.1", port, secret=SECRET, io_timeout=3, connect_timeout=3).fetch_newer(-1, timeout=2)

    env = dict(os.environ, FSDPX_SYNC_SECRET=SECRET, FSDPX_TEST_TLS_CERT=cert, FSDPX_TEST_TLS_KEY=key)
    receive(peer, [], env, gpt_check(), "a GPT over TLS", {"tls": True, "tls_ca_file": cert}, before=refusals)


def test_hf_model(package: ModuleType, peer: Peer, hf_model: str) -> None:
    """The trainer fine-tunes the Hugging Face model; every version loads into transformers' own class."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    tied = hf.config.tie_word_embeddings

    def check(v: int, weights: Any, expected: dict[str, torch.Tensor]) -> None:
        assert "lm_head.weight" not in weights.named() or not tied, "a tied head was sent twice"
        weights.load_into(hf)  # strict, by transformers' own names
        for name, t in hf.state_dict().items():
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            assert torch.equal(t, expected[source].to(t.dtype)), f"version {v}: {name} was not loaded"

    receive(peer, [hf_model], dict(os.environ, FSDPX_SYNC_SECRET=SECRET), check,
            f"transformers' {type(hf).__name__}")


def receive(peer: Peer, program_args: list[str], env: dict[str, str], check: Check, what: str,
            client_options: dict[str, Any] | None = None, before: Callable[[int], None] | None = None) -> None:
    """Starts the trainer, receives every version, checks it bit-exact against what the trainer wrote,
    then `check(version, weights, expected)`. `before(port)` runs once the server listens."""
    from fsdpx_sync import SyncClient, SyncError, checksum

    client_options = client_options or {}
    for f in os.listdir(peer.work):
        if f == "port" or f.startswith("ack_") or f.startswith("expected_") or f == "abort":
            os.remove(os.path.join(peer.work, f))
    trainer = subprocess.Popen(peer.command(VERSIONS, *program_args), env=env)
    try:
        port_file = os.path.join(peer.work, "port")
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file):
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trainer did not start its synchronizer")
            time.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())

        with pytest.raises(SyncError) as refused:
            SyncClient("127.0.0.1", port, secret="wrong", **client_options).fetch_newer(-1, timeout=5)
        text = str(refused.value)
        assert "refused to let this client fetch" in text and "authentication failed" in text, text
        if before is not None:
            before(port)

        client = SyncClient("127.0.0.1", port, secret=SECRET, **client_options)
        have = -1
        for v in range(1, VERSIONS + 1):
            weights = client.fetch_newer(have, timeout=120)
            assert weights.version == v, f"version {weights.version} arrived where {v} was expected"
            expected = load_file(os.path.join(peer.work, f"expected_{v}.safetensors"))
            got = weights.named()
            assert list(got) == list(expected), (list(got), list(expected))
            for name, t in expected.items():
                r = got[name]
                assert r.dtype == t.dtype and r.shape == t.shape, (name, r.dtype, t.dtype, r.shape, t.shape)
                assert torch.equal(r.view(torch.uint8), t.view(torch.uint8)), f"version {v}: {name} differs"
            assert any(n.endswith("weight") and t.dtype == torch.bfloat16 for n, t in got.items())
            check(v, weights, expected)
            have = v
            open(os.path.join(peer.work, f"ack_{v}"), "w").close()
        client.close()
        rc = trainer.wait(timeout=120)
        assert rc == 0, f"the trainer exited with {rc}"
    except BaseException:
        open(os.path.join(peer.work, "abort"), "w").close()
        try:
            trainer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            trainer.kill()
        raise
    print(f"python receiver, {what}: {VERSIONS} versions received bit-exact (CRC-32C: {checksum.implementation()})")
