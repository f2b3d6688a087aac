"""The Python receiver against a C++ trainer (label "sync"): fsdpx_sync is pip-installed into a
temporary directory, then receives every version a 2-rank fsdpx trainer publishes, with its secret,
bit-exact against what the trainer wrote, buffers included, and loads each into a torch module by
name with the strict check. A wrong secret is refused. With --hf-model, a second trainer fine-tunes
that Hugging Face model (fsdpx's decoder, loaded with models::from_pretrained) and Python receives every
version into transformers' own class of the model, by name, strict (its tied head needs no copy of its
own), bit-exact.

    python_receiver_test.py --package <python/> --program <python_peer_program> --mpiexec <mpiexec>
                            --work <dir> [--hf-model <folder>] [-- mpiexec flags...]
"""

import os
import shutil
import subprocess
import sys
import time

from peer_support import build_module, peer_args

VERSIONS = 4


def main() -> int:
    args = peer_args(lambda ap: ap.add_argument("--hf-model"))
    # Installable with pip, offline, depending on torch only.
    # From a copy: pip's build leaves its build/ and egg-info beside the sources.
    source = os.path.join(args.work, "package")
    shutil.copytree(args.package, source)
    site = os.path.join(args.work, "site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", site, source], check=True)
    sys.path.insert(0, site)
    import torch
    from safetensors.torch import load_file

    import fsdpx_sync
    from fsdpx_sync import SyncClient, SyncError

    assert fsdpx_sync.__file__.startswith(site), fsdpx_sync.__file__
    from fsdpx_sync.checksum import crc32c_torch
    assert fsdpx_sync.crc32c(b"123456789") == 0xE3069283 == crc32c_torch(b"123456789")
    # The torch fallback and the native CRC-32C (when installed) equal the bytewise definition.
    from fsdpx_sync.checksum import _TABLE
    for n in (0, 1, 63, 64, 65, 4095, 70001):
        data = bytearray(os.urandom(n))
        c = 0xFFFFFFFF
        for b in data:
            c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
        assert crc32c_torch(data) == fsdpx_sync.crc32c(data) == c ^ 0xFFFFFFFF, n
        assert crc32c_torch(data[n // 2:], crc32c_torch(data[: n // 2])) == crc32c_torch(data), n

    secret = "python-receiver-test-secret"
    env = dict(os.environ, FSDPX_SYNC_SECRET=secret)
    state = {"module": None}

    def check_gpt(v, weights, expected):
        got = weights.named()
        assert got["step_count"].dtype == torch.float32 and torch.all(got["step_count"] == v)
        if state["module"] is None:
            module = state["module"] = build_module(torch, expected, buffers={"step_count"})
            # Strict: a name the module lacks is named in the error, and nothing is copied.
            extra = torch.nn.Module()
            extra.register_parameter("not_sent", torch.nn.Parameter(torch.zeros(1)))
            module.add_module("extra", extra)
            try:
                weights.load_into(module)
                raise AssertionError("a missing name was not reported")
            except SyncError as e:
                assert "missing: extra.not_sent" in str(e), e
            del module.extra
        module = state["module"]
        weights.load_into(module)  # vLLM's load_weights takes the same pairs: iter(weights)
        for name, t in module.state_dict().items():
            assert torch.equal(t, expected[name].to(t.dtype)), f"version {v}: {name} was not loaded"

    receive(args, [], env, secret, SyncClient, SyncError, load_file, torch, check_gpt, "a GPT")

    # TLS: a self-signed certificate for 127.0.0.1; the client verifies it, and refuses another.
    cert, key, other = (os.path.join(args.work, f) for f in ("cert.pem", "key.pem", "other.pem"))
    for c, k in ((cert, key), (other, other + ".key")):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                        "-days", "2", "-subj", "/CN=fsdpx-test", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", k, "-out", c], check=True, capture_output=True)
    tls_env = dict(env, FSDPX_TEST_TLS_CERT=cert, FSDPX_TEST_TLS_KEY=key)
    state["module"] = None

    def refusals(port):
        try:
            SyncClient("127.0.0.1", port, secret=secret, tls=True, tls_ca_file=other).fetch_newer(-1, timeout=5)
            raise AssertionError("a server whose certificate is signed by someone else was trusted")
        except SyncError as e:
            assert "TLS handshake" in str(e) and "certificate" in str(e), e
        try:
            SyncClient("127.0.0.1", port, secret=secret, io_timeout=3, connect_timeout=3).fetch_newer(-1, timeout=2)
            raise AssertionError("a plain client was served by a TLS server")
        except SyncError:
            pass

    receive(args, [], tls_env, secret, SyncClient, SyncError, load_file, torch, check_gpt, "a GPT over TLS",
            client_options=dict(tls=True, tls_ca_file=cert), before=refusals)

    if args.hf_model:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(args.hf_model, dtype=torch.float32)
        tied = hf.config.tie_word_embeddings

        def check_hf(v, weights, expected):
            assert "lm_head.weight" not in weights.named() or not tied, "a tied head was sent twice"
            weights.load_into(hf)  # strict, by transformers' own names
            for name, t in hf.state_dict().items():
                source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
                assert torch.equal(t, expected[source].to(t.dtype)), f"version {v}: {name} was not loaded"

        receive(args, [args.hf_model], env, secret, SyncClient, SyncError, load_file, torch, check_hf,
                f"transformers' {type(hf).__name__}")
    return 0


def receive(args, program_args, env, secret, SyncClient, SyncError, load_file, torch, check, what, client_options=None,
            before=None):
    """Starts the trainer, receives every version, checks it bit-exact against what the trainer wrote,
    then `check(version, weights, expected)`. `before(port)` runs once the server listens."""
    client_options = client_options or {}
    for f in os.listdir(args.work):
        if f == "port" or f.startswith("ack_") or f.startswith("expected_") or f == "abort":
            os.remove(os.path.join(args.work, f))
    trainer = subprocess.Popen([args.mpiexec, *args.mpiexec_flags, "-n", "2", args.program, args.work, str(VERSIONS),
                                *program_args], env=env)
    try:
        port_file = os.path.join(args.work, "port")
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file):
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trainer did not start its synchronizer")
            time.sleep(0.05)
        port = int(open(port_file).read())

        try:
            SyncClient("127.0.0.1", port, secret="wrong", **client_options).fetch_newer(-1, timeout=5)
            raise AssertionError("a wrong secret was accepted")
        except SyncError as e:
            assert "refused to let this client fetch" in str(e) and "authentication failed" in str(e), e
        if before is not None:
            before(port)

        client = SyncClient("127.0.0.1", port, secret=secret, **client_options)
        have = -1
        for v in range(1, VERSIONS + 1):
            weights = client.fetch_newer(have, timeout=120)
            assert weights.version == v, f"version {weights.version} arrived where {v} was expected"
            expected = load_file(os.path.join(args.work, f"expected_{v}.safetensors"))
            got = weights.named()
            assert list(got) == list(expected), (list(got), list(expected))
            for name, t in expected.items():
                r = got[name]
                assert r.dtype == t.dtype and r.shape == t.shape, (name, r.dtype, t.dtype, r.shape, t.shape)
                assert torch.equal(r.view(torch.uint8), t.view(torch.uint8)), f"version {v}: {name} differs"
            assert any(n.endswith("weight") and t.dtype == torch.bfloat16 for n, t in got.items())
            check(v, weights, expected)
            have = v
            open(os.path.join(args.work, f"ack_{v}"), "w").close()
        client.close()
        rc = trainer.wait(timeout=120)
        assert rc == 0, f"the trainer exited with {rc}"
    except BaseException:
        open(os.path.join(args.work, "abort"), "w").close()
        try:
            trainer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            trainer.kill()
        raise
    from fsdpx_sync import checksum
    print(f"python receiver, {what}: {VERSIONS} versions received bit-exact (CRC-32C: "
          f"{checksum.implementation()})")


if __name__ == "__main__":
    sys.exit(main())
