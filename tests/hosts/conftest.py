"""Fixtures of the namespace-host tests: a :class:`~tests.hosts.netns.Network` per test, torn
down (every process killed, every namespace deleted) whatever the test did, with the end of
every host's logs shown when the test failed (or always, with MB_SHOW_LOGS=1 in the
environment)."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.hosts.netns import Network


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def network(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Network]:
    """A network with no hosts yet. Its first ``host()`` call checks that namespaces can be
    made here and fails the test, saying why, if not (never a skip)."""
    net = Network(tmp_path / "hosts")
    try:
        yield net
    finally:
        if (
            request.node.stash.get(_FAILED, False) or os.environ.get("MB_SHOW_LOGS")
        ) and net.workdir.exists():
            print("\n" + net.log_tails())
        net.close()
