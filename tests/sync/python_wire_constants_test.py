"""One source per constant across languages: every number and text of weight sync's wire (and of the
checkpoints the Python watcher reads) that fsdpx's C++ headers define, printed by
fsdpx_sync_wire_constants, against the Python package's fsdpx_sync.wire.CONSTANTS and STRINGS, name by
name: a constant changed, added or dropped on one side only fails here.

    python -m pytest tests/sync/python_wire_constants_test.py --program <fsdpx_sync_wire_constants>
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import required


@pytest.fixture(scope="module")
def cpp(request: pytest.FixtureRequest) -> dict[str, dict[str, object]]:
    out = subprocess.run([required(request.config, "program")], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_every_constant_agrees(cpp: dict[str, dict[str, object]]) -> None:
    from fsdpx_sync import wire

    for kind, python in (("constants", wire.CONSTANTS), ("strings", wire.STRINGS)):
        theirs = cpp[kind]
        only_cpp, only_python = sorted(set(theirs) - set(python)), sorted(set(python) - set(theirs))
        assert not only_cpp and not only_python, f"{kind} only in C++: {only_cpp}; only in Python: {only_python}"
        differ = {name: (theirs[name], python[name]) for name in python if theirs[name] != python[name]}
        assert not differ, f"{kind} that differ (C++, Python): {differ}"
    print(f"{len(wire.CONSTANTS)} constants and {len(wire.STRINGS)} texts agree")
