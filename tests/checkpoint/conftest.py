"""pytest's setup of the Python checkpoint tests (python_*_test.py here; tests/checkpoint/CMakeLists.txt runs
each module as one CTest entry): their options and the work folder.

    python -m pytest tests/checkpoint/python_dcp_metadata_test.py --tool <fsdpx_dcp_metadata_tool> [--work <dir>]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

# tests/support's Python helpers (gloo_ranks: torch's own FSDP2 on gloo ranks), for the test modules here
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdpx", "fsdpx's Python checkpoint tests")
    group.addoption("--tool", help="the C++ side: fsdpx_dcp_metadata_tool (dump / write a DCP .metadata), "
                    "fsdpx_dcp_load_program (load a DCP checkpoint)")
    group.addoption("--work", help="a work folder, emptied first (default: a temporary one)")
    group.addoption("--job", help="fsdpx_checkpoint_job (its dcp-save and dcp-cover modes)")
    group.addoption("--merge", help="fsdpx-merge (its DCP input)")
    group.addoption("--inspect", help="fsdpx-inspect (its DCP input; built only with CLI11: skipped without)")
    group.addoption("--mpiexec", help="the MPI launcher and its flags, one string (\"mpiexec --oversubscribe\")")


def required(request: pytest.FixtureRequest, option: str) -> str:
    value = request.config.getoption(option)
    if not value:
        pytest.fail(f"this test needs --{option} (tests/checkpoint/conftest.py)", pytrace=False)
    return str(value)


@pytest.fixture(scope="session")
def tool(request: pytest.FixtureRequest) -> str:
    return required(request, "tool")


@pytest.fixture(scope="session")
def job(request: pytest.FixtureRequest) -> str:
    return required(request, "job")


@pytest.fixture(scope="session")
def merge(request: pytest.FixtureRequest) -> str:
    return required(request, "merge")


@pytest.fixture(scope="session")
def inspect(request: pytest.FixtureRequest) -> str:
    value = request.config.getoption("inspect")
    if not value:
        pytest.skip("no --inspect: fsdpx-inspect is built only where CLI11 is found (tools/setup.sh installs it)")
    return str(value)


@pytest.fixture(scope="session")
def mpiexec(request: pytest.FixtureRequest) -> list[str]:
    return required(request, "mpiexec").split()


@pytest.fixture(scope="session")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """--work, emptied, or a fresh temporary folder."""
    path = request.config.getoption("work")
    if not path:
        return tmp_path_factory.mktemp("work")
    shutil.rmtree(path, ignore_errors=True)
    Path(path).mkdir(parents=True)
    return Path(path)
