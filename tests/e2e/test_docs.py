"""Every Python block of the README and docs/examples.md runs as written.

A block runs in a fresh interpreter (cwd: the repository, ``REDIS_URL``: a private
redis-server, which is also what the commands read by default). A block whose surrounding text
says to start something first is preceded in the markdown by that command::

    <!-- stack: worker start --model examples.mlp:MLP -->

which the test runs (``worker start``/``gateway start``/``broker`` as their modules; the gateway
port comes from ``MICROBATCH_GATEWAY_PORT``) until a worker is live, before running the blocks
that need it. A block that cannot run on its own (a bare ``await``, an excerpt) is marked
``<!-- fragment -->``: it is only compiled. Keep those few.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys
from broker.liveness import live_consumers
from tests.conftest import ROOT, stop_process

DOCUMENTS = ["README.md", "docs/examples.md"]
MAX_FRAGMENTS = 2
DIRECTIVE = re.compile(r"^<!--\s*(fragment|stack:\s*(?P<command>.+?))\s*-->$")
COMMANDS = {"worker": "gpu_worker.cli", "gateway": "web_gateway.cli", "broker": "broker.cli"}
STACK_READY_S = 300.0  # a cold start of the heavier examples on a shared machine


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    code: str
    stack: str | None
    fragment: bool

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def python_blocks(document: str) -> list[Block]:
    """The ```python blocks of a markdown file, with the directives just above each."""
    lines = (ROOT / document).read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        start = index + 1
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == "```")
        stack, fragment = None, False
        above = index - 1
        while above >= 0 and (match := DIRECTIVE.match(lines[above].strip())):
            if match["command"]:
                stack = match["command"]
            else:
                fragment = True
            above -= 1
        code = "\n".join(lines[start:end]) + "\n"
        found.append(Block(document, start, code, stack, fragment))
        index = end + 1
    return found


ALL_BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]
STACKS = sorted({block.stack or "" for block in ALL_BLOCKS if not block.fragment})


def test_blocks_are_found_and_compile() -> None:
    assert len(ALL_BLOCKS) >= 5, [block.name for block in ALL_BLOCKS]
    assert {block.document for block in ALL_BLOCKS} == set(DOCUMENTS)
    fragments = [block.name for block in ALL_BLOCKS if block.fragment]
    assert len(fragments) <= MAX_FRAGMENTS, f"fragments are for exceptions: {fragments}"
    for block in ALL_BLOCKS:
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT if block.fragment else 0
        compile(block.code, block.name, "exec", flags=flags, dont_inherit=True)


def stack_command(command: str) -> list[str]:
    """The documented command as this test runs it (the console scripts as their modules)."""
    words = shlex.split(command)
    if words[0] in COMMANDS:
        return [sys.executable, "-m", COMMANDS[words[0]], *words[1:]]
    if words[:2] == ["python", "-m"]:
        return [sys.executable, *words[1:]]
    raise AssertionError(f"the test does not know how to run {command!r}")


def wait_for_a_worker(url: str, process: subprocess.Popen[bytes]) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + STACK_READY_S
    try:
        while True:
            for key in client.scan_iter(match="mb:{*}:consumers"):
                prefix, model = key.decode()[4:].split("}", 1)[0].split(":", 1)
                if live_consumers(client, ModelKeys(model, prefix)):
                    return
            assert process.poll() is None, f"the stack exited with code {process.returncode}"
            assert time.monotonic() < deadline, "no worker became live"
            time.sleep(0.2)
    finally:
        client.close()


@pytest.fixture
def environment(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A private Redis (the blocks' prefix is the default one) and the blocks' environment."""
    with RedisServer() as server:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_")}
        yield {
            **clean,
            "PYTHONPATH": str(ROOT),
            "REDIS_URL": server.url,
            "MICROBATCH_GATEWAY_PORT": str(free_port()),
        }


def stack_param(stack: str) -> Any:
    """The blocks of one stack; the embedder's loads real weights in two processes: slow."""
    marks = [pytest.mark.slow] if "examples.embedder" in stack else []
    return pytest.param(stack, id=stack or "no stack", marks=marks)


@pytest.mark.parametrize("stack", [stack_param(stack) for stack in STACKS])
def test_python_blocks_run_as_written(
    stack: str, environment: dict[str, str], tmp_path: Path
) -> None:
    blocks = [b for b in ALL_BLOCKS if not b.fragment and (b.stack or "") == stack]
    with ExitStack() as cleanup:
        if stack:
            log = cleanup.enter_context(open(tmp_path / "stack.log", "wb"))
            process = subprocess.Popen(
                stack_command(stack), cwd=ROOT, env=environment, stdout=log, stderr=log
            )
            cleanup.callback(stop_process, process)
            try:
                wait_for_a_worker(environment["REDIS_URL"], process)
            except AssertionError:
                raise AssertionError((tmp_path / "stack.log").read_text()[-3000:]) from None
        for block in blocks:
            done = subprocess.run(
                [sys.executable, "-c", block.code],
                cwd=ROOT,
                env=environment,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{block.name} failed:\n{done.stderr[-3000:]}"


def test_the_key_constants_of_the_protocol_are_those_of_broker_keys() -> None:
    # docs/protocol.md, section 3, says it copies them verbatim: other clients follow it.
    import broker.keys

    (block,) = [block for block in python_blocks("docs/protocol.md") if "TEMPLATE" in block.code]
    documented: dict[str, Any] = {"re": re}
    exec(block.code, documented)
    names = [name for name in documented if name.isupper()]
    assert len(names) > 20
    assert {name: documented[name] for name in names} == {
        name: getattr(broker.keys, name, None) for name in names
    }
