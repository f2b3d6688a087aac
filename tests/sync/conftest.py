"""pytest's setup of the Python sync tests (python_*_test.py; tests/sync/CMakeLists.txt runs each module as
one CTest entry): their options, the fsdpx_sync package's sources first on sys.path, the fixtures they
share, and exit status 77 (CTest's SKIP_RETURN_CODE) when every test was skipped, so that a module skipped
whole (transformers missing, say) is reported skipped rather than passed.

    python -m pytest tests/sync/python_delta_test.py [--package python/]
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from peer_support import Peer

HERE = os.path.dirname(os.path.abspath(__file__))
SKIPPED = 77  # CTest's SKIP_RETURN_CODE of these tests


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdpx", "fsdpx's Python sync tests")
    group.addoption("--package", default=os.path.join(HERE, "..", "..", "python"),
                    help="the folder holding the fsdpx_sync package (python/): put first on sys.path")
    group.addoption("--program", help="the C++ peer the receiver and the watcher follow (fsdpx_sync_python_peer)")
    group.addoption("--mpiexec", default=shutil.which("mpiexec"), help="mpiexec, to start the peer's 2 ranks")
    group.addoption("--mpiexec-flag", action="append", default=[], dest="mpiexec_flags",
                    help="a flag for mpiexec, such as --mpiexec-flag=--oversubscribe (repeat for more)")
    group.addoption("--work", help="a work folder, emptied first (default: a temporary one)")
    group.addoption("--server", help="the C++ server driven over stdin (fsdpx_sync_server_program)")
    group.addoption("--cases", help="the folder receiver_cases.py wrote the shared receiver cases to")
    group.addoption("--hf-model", help="a Hugging Face model folder for the receiver (tests/models' qwen2_tied)")


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, os.path.abspath(config.getoption("package")))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every test skipped (or the module skipped whole, which collects none): 77, CTest's "skipped"."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    if (exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and stats.get("skipped")
            and not stats.get("passed")):
        session.exitstatus = SKIPPED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    checksum = sys.modules.get("fsdpx_sync.checksum")
    if checksum is not None:
        terminalreporter.write_line(f"fsdpx_sync from {os.path.dirname(checksum.__file__ or '')} (CRC-32C: "
                                    f"{checksum.implementation()})")


def required(config: pytest.Config, name: str) -> str:
    """The value of option --<name>, which this test needs."""
    value = config.getoption(name)
    if not value:
        pytest.fail(f"this test needs --{name.replace('_', '-')} (tests/sync/conftest.py)", pytrace=False)
    return str(value)


@pytest.fixture(scope="session", autouse=True)
def no_secrets() -> None:
    """The fake servers run without a secret: no client here takes one from the environment."""
    for key in ("FSDPX_SYNC_SECRET", "FSDPX_SYNC_FETCH_SECRET", "FSDPX_SYNC_PUBLISH_SECRET"):
        os.environ.pop(key, None)


@pytest.fixture(scope="session")
def work(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """--work, emptied, or a fresh temporary folder."""
    path = request.config.getoption("work")
    if not path:
        return str(tmp_path_factory.mktemp("work"))
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return str(path)


@pytest.fixture(scope="session")
def peer(request: pytest.FixtureRequest, work: str) -> Peer:
    return Peer(required(request.config, "program"), required(request.config, "mpiexec"), work,
                list(request.config.getoption("mpiexec_flags")))


@pytest.fixture(scope="session")
def server_program(request: pytest.FixtureRequest) -> str:
    return required(request.config, "server")


@pytest.fixture(scope="session")
def cases_folder(request: pytest.FixtureRequest) -> str:
    return required(request.config, "cases")


@pytest.fixture(scope="session")
def hf_model(request: pytest.FixtureRequest) -> str:
    path = request.config.getoption("hf_model")
    if not path:
        pytest.skip("no --hf-model (the hf tests' models: tests/models)")
    return str(path)
