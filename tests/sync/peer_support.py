"""What the Python sync tests against a C++ trainer share (python_receiver_test.py, python_watcher_test.py):
the peer program under mpiexec (conftest.py's `peer` fixture) and a module with a tensor at every dotted
name. Nothing here imports fsdpx_sync: the receiver's test imports it only once it is pip-installed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Peer:
    """The C++ peer (python_peer_program.cpp) and how to start it: 2 ranks under mpiexec, with a work folder."""

    program: str
    mpiexec: str
    work: str
    mpiexec_flags: list[str] = field(default_factory=list)

    def command(self, *args: object) -> list[str]:
        """mpiexec [flags] -n 2 <program> <work> args..."""
        return [self.mpiexec, *self.mpiexec_flags, "-n", "2", self.program, self.work, *map(str, args)]


def build_module(tensors: dict[str, torch.Tensor], buffers: tuple[str, ...] | set[str] = (),
                 fill: float = -1.0) -> torch.nn.Module:
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
