"""The Python checkpoint watcher (fsdpx_sync.CheckpointWatcher) against a C++ trainer (label "sync"):
2 fsdpx ranks save every step's weights with the CheckpointCoordinator, keeping 2 steps (rotation
deletes older ones while Python may be reading them; every fourth step is saved again with the
optimizer, rewriting its commit record). Python follows the root: every version it returns is newer
than the last, equals the trainer's side file of that step bit for bit, loads into a module by name
(strict), and it reaches the last step. Then, on a copy of a committed step: a corrupted model file,
a missing one and an uncommitted step are refused with errors naming them.

    python_watcher_test.py --package <python/> --program <python_peer_program> --mpiexec <mpiexec> --work <dir> [-- flags]
"""

import os
import shutil
import subprocess
import sys

from peer_support import build_module, peer_args

STEPS = 24


def main() -> int:
    args = peer_args()
    sys.path.insert(0, args.package)  # the package's sources as they are (sync_python_receiver pip-installs it)
    import torch
    from safetensors.torch import load_file

    from fsdpx_sync import CheckpointWatcher, SyncError
    from fsdpx_sync.checkpoint import read_step

    root = os.path.join(args.work, "ckpt")
    trainer = subprocess.Popen([args.mpiexec, *args.mpiexec_flags, "-n", "2", args.program, args.work, str(STEPS),
                                "--checkpoints"])
    watcher = CheckpointWatcher(root, poll_interval=0.01)
    seen = []
    module = None
    try:
        have = -1
        while have < STEPS:
            if trainer.poll() not in (None, 0):
                raise RuntimeError(f"the trainer exited with {trainer.returncode}")
            w = watcher.wait_newer(have, timeout=120)
            assert w.version > have, (w.version, have)
            side = load_file(os.path.join(args.work, f"side_{w.version}.safetensors"))
            got = w.named()
            assert sorted(got) == sorted(side), (sorted(got), sorted(side))
            for name, t in side.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"step {w.version}: {name} differs"
            if module is None:
                module = build_module(torch, side, fill=0.0)
            w.load_into(module)
            assert all(torch.equal(t, side[n]) for n, t in module.state_dict().items())
            seen.append(w.version)
            have = w.version
        assert trainer.wait(timeout=120) == 0, "the trainer failed"
    except BaseException:
        trainer.kill()
        raise
    assert len(seen) >= 2, seen
    print(f"python watcher: {len(seen)} of {STEPS} committed steps read while the trainer saved and rotated "
          f"({seen[:6]}{' ...' if len(seen) > 6 else ''}), each bit-exact")

    # Bad steps, on a copy of the last committed one.
    bad_root = os.path.join(args.work, "bad")
    src = os.path.join(root, f"global_step_{STEPS}")
    shutil.copytree(src, os.path.join(bad_root, f"global_step_{STEPS}"), ignore=shutil.ignore_patterns(".leases"))
    actor = os.path.join(bad_root, f"global_step_{STEPS}", "actor")
    victim = os.path.join(actor, "model_world_size_2_rank_1.pt")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))

    def refused(fragment):
        try:
            read_step(bad_root, STEPS)
        except SyncError as e:
            assert fragment in str(e), (fragment, str(e))
            return
        raise AssertionError(f"a bad step was read ({fragment})")

    refused(f"'{victim}' does not match the CRC-32C")
    os.remove(victim)
    refused(f"'{victim}' is missing")
    os.remove(os.path.join(actor, "fsdp_config.json"))
    refused(f"step {STEPS} of '{bad_root}' is not committed")
    with open(os.path.join(bad_root, "latest_state_dict_iteration.txt"), "w") as f:
        f.write(f"{STEPS}\n")
    try:
        CheckpointWatcher(bad_root).wait_newer(-1, timeout=0.3)
        raise AssertionError("an uncommitted step was returned")
    except SyncError as e:
        assert "not (or no longer) committed" in str(e), e
    print("python watcher: a corrupted, a missing and an uncommitted step are refused, naming the cause")
    hostile_steps(args, src, torch)
    print("PASSED")
    return 0


def hostile_steps(args, src, torch):
    """Files a hostile or unlucky writer leaves: special files, huge files, rank files whose slices
    overlap, are malformed or declare a tensor no file holds. Each is a SyncError naming the cause,
    at once (no hang) and without allocating what the files claim."""
    import json
    import time

    from fsdpx_sync import CheckpointWatcher, SyncError
    from fsdpx_sync.checkpoint import read_iteration_file, read_step
    from fsdpx_sync.checksum import crc32c

    n = 0

    def fresh():
        nonlocal n
        n += 1
        root = os.path.join(args.work, f"hostile{n}")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(src, os.path.join(root, f"global_step_{STEPS}"), ignore=shutil.ignore_patterns(".leases"))
        return root, os.path.join(root, f"global_step_{STEPS}", "actor")

    def refused(fn, fragment):
        start = time.monotonic()
        try:
            fn()
        except SyncError as e:
            assert fragment in str(e), (fragment, str(e))
            assert time.monotonic() - start < 10, "refused, but slowly"
            return
        raise AssertionError(f"accepted: {fragment}")

    # A FIFO as the iteration file or the commit record: refused at once, never opened for a blocking read.
    root, actor = fresh()
    os.mkfifo(os.path.join(root, "latest_state_dict_iteration.txt"))
    refused(lambda: read_iteration_file(root), "is not a regular file")
    refused(lambda: CheckpointWatcher(root).poll(), "is not a regular file")
    os.remove(os.path.join(actor, "fsdp_config.json"))
    os.mkfifo(os.path.join(actor, "fsdp_config.json"))
    refused(lambda: read_step(root, STEPS), "is not a regular file")
    # A 2 GiB commit record (NUL-padded, sparse): refused by its size, not read.
    root, actor = fresh()
    os.truncate(os.path.join(actor, "fsdp_config.json"), 2 << 30)
    refused(lambda: read_step(root, STEPS), "has 2147483648 bytes; it may have at most 16777216")

    def crafted(edit, fragment):
        """Rank 1's file rewritten by `edit(state dict of rank 0, state dict of rank 1)` with a record that matches it."""
        root, actor = fresh()
        files = [os.path.join(actor, f"model_world_size_2_rank_{r}.pt") for r in range(2)]
        sds = [torch.load(f, weights_only=True) for f in files]
        edit(sds[0], sds[1])
        torch.save(sds[1], files[1])
        record_path = os.path.join(actor, "fsdp_config.json")
        record = json.load(open(record_path))
        data = open(files[1], "rb").read()
        record["files"][os.path.basename(files[1])] = {"bytes": len(data), "crc32c": crc32c(data)}
        json.dump(record, open(record_path, "w"))
        refused(lambda: read_step(root, STEPS), fragment)

    def overlap(sd0, sd1):  # rank 1 also holds rank 0's first slice of a tensor
        name = next(k for k, e in sd0["entries"].items() if e["end"] > e["begin"])
        sd1["entries"][name] = sd0["entries"][name]
    crafted(overlap, "some of which another rank's file holds too")

    def malformed(sd0, sd1):
        name = next(iter(sd1["entries"]))
        del sd1["entries"][name]["data"]
    crafted(malformed, "is malformed")

    def huge(sd0, sd1):  # a tensor of 2^40 elements that no file holds: named, never allocated
        sd1["entries"]["crafted.weight"] = {"shape": [1 << 20, 1 << 20], "begin": 0, "end": 0, "data": torch.zeros(0)}
    crafted(huge, "elements [0, 1099511627776) of 'crafted.weight' are in no rank's file")
    print("python watcher: FIFOs, a 2 GiB record, overlapping, malformed and oversized slices are refused, naming the cause")


if __name__ == "__main__":
    sys.exit(main())
