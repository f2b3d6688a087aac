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
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
