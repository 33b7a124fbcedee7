"""Every Python block of the README and docs/examples.md runs as written.

A block runs in a fresh interpreter (cwd: the repository, ``REDIS_URL``: a private
redis-server, which is also what the commands read by default). A block whose surrounding text
says to start something first is preceded in the markdown by that command::

    <!-- stack: worker start --model examples.mlp:MLP -->

which the test runs (``worker start``/``gateway start``/``broker`` as their modules; the gateway
port comes from ``MICROBATCH_GATEWAY_PORT``) until a worker is live, before running the blocks
that need it. A block that cannot run on its own (a bare ``await``, an excerpt) is marked
``<!-- fragment -->``: it is only compiled. Keep those few.

On every page (README.md and docs/*.md), the Python blocks that are not marked fragments use
no name that neither they nor the page's earlier blocks define (ruff's F821), and every
``worker``/``gateway``/``broker`` command shown (shell blocks, `code spans`) has the
subcommands and options it shows.
"""

from __future__ import annotations

import ast
import itertools
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


RUFF_F821 = [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select"]
RUFF_F821 += ["F821", "--output-format", "concise", "--stdin-filename"]
EVERY_DOCUMENT = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]


def test_python_blocks_of_every_page_use_no_undefined_name() -> None:
    # A reader copies one block, after the page's earlier ones: each name it uses must come
    # from an import or a definition there (ruff's F821), unless the block is a marked fragment.
    undefined = []
    for document in EVERY_DOCUMENT:
        earlier = ""
        for block in python_blocks(document):
            if block.fragment:
                continue
            source = earlier + block.code
            done = subprocess.run(
                [*RUFF_F821, "block.py", "-"],
                input=source,
                capture_output=True,
                text=True,
                timeout=60,
            )
            offset = earlier.count("\n")
            for row in re.findall(r"^block\.py:(\d+):\d+: (.*)$", done.stdout, flags=re.M):
                if int(row[0]) > offset:
                    undefined.append(
                        f"{document}:{block.line + int(row[0]) - offset - 1}: {row[1]}"
                    )
            earlier = source
    assert not undefined, "\n".join(undefined)


COMMAND_WORDS = re.compile(  # where a command starts: a line, a `span`, after exec, $ or &&
    r"(?:^\s*|`|\bexec\s+\w+\s+|\$\s+|&&\s+)(?:\.venv/bin/)?(?P<command>worker|gateway|broker)"
    r"(?P<rest>\s+(?:[a-z]|--[a-z])[^`\n]*)"
)
END_OF_COMMAND = re.compile(r"\s(?:#|\||>|&|;|-->)|`")


def shown_command_lines(document: str) -> Iterator[tuple[int, str]]:
    """The lines of shell blocks and the `code spans` of the prose, continuations joined (after
    a backslash, or a line of only options: `worker start --model M` then `    [--workers N]`)."""
    fenced = shell = False
    lines = re.sub(r"\\\n", " ", (ROOT / document).read_text()).splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            shell = line.strip()[3:] in ("", "sh", "bash", "text", "console")
            continue
        if fenced:
            if shell and not re.match(r"\s+[\[-]", line):
                more = itertools.takewhile(lambda next: re.match(r"\s+[\[-]", next), lines[number:])
                yield number, " ".join([line, *more])
        else:
            yield from ((number, f"`{span}`") for span in re.findall(r"`([^`]+)`", line))


def command_flaws(root: Any, words: list[str]) -> Iterator[str]:
    """Options and subcommands of `words` that the command `root` does not have."""
    command, allowed = root, {}
    allowed = {name: p for p in command.params for name in (*p.opts, *p.secondary_opts)}
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word.startswith("--"):
            for name in word.split("=")[0].split("/"):
                if name.startswith("--") and name not in allowed and name != "--help":
                    yield f"no option {name}"
            option = allowed.get(word.split("=")[0])
            if option is not None and "=" not in word and not option.is_flag:
                index += 1  # its value
        elif hasattr(command, "commands") and not word.startswith("-"):
            alternatives = [command.commands.get(name) for name in word.split("|")]
            if None in alternatives:
                yield f"no command {word!r}"
                return
            command = alternatives[0]
            allowed |= {name: p for p in command.params for name in (*p.opts, *p.secondary_opts)}


def test_the_commands_shown_have_the_options_shown() -> None:
    import typer

    import broker.cli
    import gpu_worker.cli
    import web_gateway.cli

    roots: dict[str, Any] = {
        "worker": typer.main.get_command(gpu_worker.cli.app),
        "gateway": typer.main.get_command(web_gateway.cli.app),
        "broker": typer.main.get_command(broker.cli.app),
    }
    flaws, seen = [], 0
    for document in EVERY_DOCUMENT:
        for number, line in shown_command_lines(document):
            for match in COMMAND_WORDS.finditer(line):
                rest = END_OF_COMMAND.split(match["rest"], maxsplit=1)[0]
                words = rest.replace("[", " ").replace("]", " ").split()
                root = roots[match["command"]]
                if line.startswith("`") and not (words[0] in root.commands or words[0][0] == "-"):
                    continue  # prose quoting a log line (`broker available again`), say
                seen += 1
                flaws += [
                    f"{document}:{number}: {match['command']} {rest.strip()}: {flaw}"
                    for flaw in command_flaws(root, words)
                ]
    assert seen > 50
    assert not flaws, "\n".join(flaws)
