"""Delta versions vs full versions, end to end: a C++ trainer (build/benchmarks/bench_delta_sync, a
Qwen2.5-0.5B-shaped model in float32 with AdamW) publishes every version in bfloat16 through the TCP
synchronizer twice, once cutting deltas and once full, and this script receives both into Python
(python/fsdpx_sync: `fetch_newer_into` a transformers Qwen2ForCausalLM in bfloat16, as a rollout loads
its weights: a delta lands in place, a full version is copied in; every written tensor is checked
against its CRC-32C).

    .venv/bin/python benchmarks/delta_sync_bench.py build/benchmarks/bench_delta_sync [--steps 10] [--layers 24]

Per version it prints the fraction of elements and of bytes that changed, the bytes each way sent, and
the end-to-end time of each (from the trainer's publish() call to the Python receiver holding the checked
version); the two go in alternating order, version by version. Phases: --steps AdamW steps at lr 1e-6,
then at 1e-5, then 2 versions where every weight moves (the delta's worst case).
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch  # noqa: E402
from fsdpx_sync import SyncClient  # noqa: E402
from fsdpx_sync import checksum as crc_module  # noqa: E402


class Trainer:
    def __init__(self, program, layers):
        self.p = subprocess.Popen([program, "--layers", str(layers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        words = self.p.stdout.readline().split()
        assert words[0] == "ports", words
        self.ports = int(words[1]), int(words[2])

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        reply = self.p.stdout.readline().split()
        if not reply or reply[0] == "error":
            raise RuntimeError(f"trainer: {line!r} -> {reply}")
        return reply

    def close(self):
        self.ask_nowait("quit")
        self.p.wait(timeout=60)

    def ask_nowait(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()


def changed_fraction(version):
    """Elements and bytes whose bits changed in this version, as fractions of the whole (from its manifest)."""
    m = version.manifest
    total_elems = total_bytes = changed_elems = changed_bytes = 0
    for e in m.entries:
        numel = 1
        for s in e.shape:
            numel *= s
        esize = torch.empty((), dtype=e.dtype).element_size()
        total_elems += numel
        total_bytes += numel * esize
        k = numel if e.changed < 0 else e.changed
        changed_elems += k
        changed_bytes += k * esize
    return changed_elems / total_elems, changed_bytes / total_bytes


def rollout_model(layers):
    """Qwen2.5-0.5B's shape in bfloat16, memory not initialised (the first full version fills it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    return model


def sync_once(trainer, client, module, how, version, have):
    """Publishes `version` one way and fetches it into `module`; (seconds end to end, bytes sent, version)."""
    result = {}

    def fetch():
        result["weights"] = client.fetch_newer_into(module, have, timeout=600)
        result["done"] = time.monotonic()

    reader = threading.Thread(target=fetch)
    reader.start()  # the reader waits at the server before the publish begins, as a rollout would
    time.sleep(0.05)
    reply = trainer.ask(f"publish {how} {version}")
    reader.join()
    t0, t1, sent, full = float(reply[1]), float(reply[2]), int(reply[3]), int(reply[4])
    if os.environ.get("DELTA_BENCH_VERBOSE"):
        print(f"    {how}: publish {t1 - t0:.3f} s, then the receiver {result['done'] - t1:.3f} s", flush=True)
    return result["done"] - t0, sent, full, result["weights"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("program")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(args.program, args.layers)
    delta_client = SyncClient("127.0.0.1", trainer.ports[0])
    full_client = SyncClient("127.0.0.1", trainer.ports[1])
    delta_model, full_model = rollout_model(args.layers), rollout_model(args.layers)
    print(f"machine: {os.cpu_count()} cores; Python CRC-32C: {crc_module.implementation()}; loopback TCP")
    version = 0
    have_delta = have_full = -1
    rows = []
    phases = [("warm-up", None, 1)] + [("lr 1e-6", 1e-6, args.steps), ("lr 1e-5", 1e-5, args.steps),
                                        ("every weight changes", "perturb", 2)]
    print(f"{'phase':22} {'v':>3} {'elems chg':>9} {'bytes chg':>9} {'delta MB':>9} {'full MB':>8} "
          f"{'delta s':>8} {'full s':>8} {'full/delta':>10}")
    for phase, lr, steps in phases:
        for _ in range(steps):
            version += 1
            if lr == "perturb":
                trainer.ask("perturb")
            elif lr is not None:
                trainer.ask(f"train {lr}")
            order = ["delta", "full"] if version % 2 else ["full", "delta"]
            got = {}
            for how in order:
                if how == "delta":
                    got[how] = sync_once(trainer, delta_client, delta_model, "delta", version, have_delta)
                    have_delta = version
                else:
                    got[how] = sync_once(trainer, full_client, full_model, "full", version, have_full)
                    have_full = version
            dt, dsent, full_bytes, dw = got["delta"]
            ft, fsent, _, fw = got["full"]
            assert dw.version == fw.version == version
            fsd = full_model.state_dict()
            for name, a in delta_model.state_dict().items():  # the two ways end with the same bits
                assert torch.equal(a.view(torch.int16), fsd[name].view(torch.int16)), name
            elems, nbytes = changed_fraction(dw) if dw.is_delta else (1.0, 1.0)
            rows.append((phase, version, elems, nbytes, dsent, fsent, dt, ft))
            print(f"{phase:22} {version:3d} {elems:9.4f} {nbytes:9.4f} {dsent / 1e6:9.1f} {fsent / 1e6:8.1f} "
                  f"{dt:8.3f} {ft:8.3f} {ft / dt:10.2f}", flush=True)
    trainer.close()
    print()
    for phase in ("lr 1e-6", "lr 1e-5", "every weight changes"):
        r = [row for row in rows if row[0] == phase]
        ratios = [row[7] / row[6] for row in r]
        print(f"{phase:22}: full/delta time median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-"
              f"{max(ratios):.2f}), bytes sent median {statistics.median(row[4] / row[5] for row in r):.4f} of full, "
              f"elements changed median {statistics.median(row[2] for row in r):.4f}")


if __name__ == "__main__":
    main()
