"""The command lines agree: plain help with nothing cut, -h, --version, --log-level, log format."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from importlib import import_module

import click
import pytest
import typer
from click.testing import CliRunner, Result

from broker.cli_common import version
from broker.devserver import RedisServer
from broker.logs import TEXT_FORMAT, configure_logging
from tests.conftest import ROOT

# (module, the command's name); each module has ``app``, a Typer app.
CLIS = [("gpu_worker.cli", "worker"), ("broker.cli", "broker"), ("web_gateway.cli", "gateway")]
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters: rich's panels


def run_cli(module: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def commands(group: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of a click group: (), ("start",), ("dead-letters", "list"), ..."""
    found = [path]
    if isinstance(group, click.Group):
        for name, command in group.commands.items():
            found += commands(command, (*path, name))
    return found


def find(group: click.Command, path: tuple[str, ...]) -> click.Command:
    for name in path:
        assert isinstance(group, click.Group)
        group = group.commands[name]
    return group


def invoke(module: str, prog: str, *args: str) -> Result:
    """The command line run in this process (as its process runs it, at 80 columns)."""
    command = typer.main.get_command(import_module(module).app)
    return CliRunner().invoke(command, list(args), prog_name=prog, env={"COLUMNS": "80"})


@pytest.mark.parametrize(("module", "prog"), CLIS)
def test_help_is_plain_whole_and_answers_to_h(module: str, prog: str) -> None:
    root = typer.main.get_command(import_module(module).app)
    # the command itself once; every subcommand's help in this process (a process each is
    # seconds of interpreter start-ups for the same text)
    assert run_cli(module, "--help").stdout == invoke(module, prog, "--help").stdout
    for path in commands(root):
        long = invoke(module, prog, *path, "--help")
        short = invoke(module, prog, *path, "-h")
        assert long.exit_code == short.exit_code == 0, long.output
        assert short.stdout == long.stdout
        assert long.stdout.startswith(f"Usage: {' '.join((prog, *path))} ")
        assert not BOX.search(long.stdout), f"{prog} {' '.join(path)}: rich boxes"
        body = long.stdout.split("\n", 1)[1]  # after "Usage: ... [ARGS]..."
        assert "..." not in body, f"{prog} {' '.join(path)}: a help text was cut"
        for param in find(root, path).params:
            for envvar in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
                found = re.search(rf"\b{envvar}\b", long.stdout)
                assert found, f"{envvar} is missing or cut in {prog} {' '.join(path)}"


@pytest.mark.parametrize(("module", "prog"), CLIS)
def test_version_prints_microbatch_and_its_version(module: str, prog: str) -> None:
    done = run_cli(module, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"microbatch {version()}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("gpu_worker.cli", ("start", "--model", "tests.models:Toy", "--log-level")),
        ("broker.cli", ("--log-level",)),
    ],
)
def test_log_levels_any_case_and_nothing_else(
    module: str, args: tuple[str, ...], redis_server: RedisServer
) -> None:
    tail = ("status", "--redis", redis_server.url) if module == "broker.cli" else ()
    prog = dict(CLIS)[module]
    for bad in ("verbose", "warn", "10", ""):  # refused while the options are read
        refused = invoke(module, prog, *args, bad, *tail)
        assert refused.exit_code == 2, (bad, refused.output)
        assert refused.stderr.splitlines() == [
            f"Error: --log-level must be one of debug, info, warning, error, critical, not {bad!r}"
        ]
    for good in ("WARNING", "Error", "critical"):
        if module == "broker.cli":
            done = run_cli(module, *args, good, *tail)
            assert done.returncode == 0, (good, done.stderr)
        else:  # accepted: the worker goes on to its model (which does not exist)
            done = run_cli(module, "start", "--model", "tests.models:Missing", "--log-level", good)
            assert done.returncode == 2
            assert done.stderr.splitlines()[-1].startswith("Error: ")
            assert "Missing" in done.stderr and "--log-level" not in done.stderr


def test_every_process_logs_in_one_format(capfd: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "text")
    try:
        logging.getLogger("microbatch.test").info("hello %s", "there")
        line = capfd.readouterr().err.strip().splitlines()[-1]
        # one line per event, whatever a message holds (a client's value, say)
        logging.getLogger("microbatch.test").info("a %s b", "\n2026-01-01 fake\r\n")
        injected = capfd.readouterr().err
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("microbatch.test").exception("failed")
        traceback = capfd.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    assert injected.count("\n") == 1 and injected.endswith("a \\n2026-01-01 fake\\r\\n b\n")
    assert traceback.splitlines()[1] == "Traceback (most recent call last):"
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
    assert re.fullmatch(
        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} INFO microbatch.test \[{os.getpid()}\] "
        r"hello there",
        line,
    )
    # the compat supervisor uses the shared set-up too (no format string of its own)
    compat = (ROOT / "gpu_worker" / "compat.py").read_text()
    assert "configure_logging(" in compat and "basicConfig" not in compat


FORGED = "\n2026-01-01 00:00:00,000 ERROR microbatch.gateway [1] forged\r\x1b[1A\x1b[2K\u2028x"


def test_no_client_value_forges_a_line_of_a_text_log(capfd: pytest.CaptureFixture[str]) -> None:
    """A message, and an exception's in a traceback (a model's, quoting its input, and the
    exceptions it was raised from), start no line of their own and hold no terminal escape
    nor other control character: each is written escaped."""
    configure_logging("info", "text")
    try:
        logging.getLogger("microbatch.test").warning("model said %s", f"bad input{FORGED}")
        message = capfd.readouterr().err
        try:
            try:
                raise KeyError(f"cause{FORGED}")
            except KeyError as cause:
                raise ValueError(f"bad input{FORGED}") from cause
        except ValueError:
            logging.getLogger("microbatch.test").exception("the model raised")
        traceback = capfd.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    for text in (message, traceback):
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", text), text
        lines = text.splitlines()
        assert re.match(r"\d{4}-", lines[0]) and not any(re.match(r"\d", x) for x in lines[1:])
    escaped = r"\n2026-01-01 00:00:00,000 ERROR microbatch.gateway [1] forged" + (
        r"\r\x1b[1A\x1b[2K\u2028x"
    )
    assert message.endswith(f"model said bad input{escaped}\n")
    assert traceback.splitlines()[1] == "Traceback (most recent call last):"
    assert "ValueError: bad input\\n2026-01-01 00:00:00,000 ERROR" in traceback
    assert "KeyError: 'cause\\n2026-01-01" in traceback


def test_no_client_value_breaks_or_forges_a_line_of_a_json_log(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """JSON escapes the C0 controls, but wrote DEL, the C1 controls (CSI, 0x9b, starts a
    terminal sequence as ESC [ does; NEL, 0x85, breaks a line for str.splitlines) and the line
    and paragraph separators raw: a client's value split one event into lines a log reader
    took for more. They are written as JSON escapes, and the line reads back the same."""
    configure_logging("info", "json")
    hostile = f"bad input{FORGED}\x7f\x85\x9b2J\u2029end"
    try:
        logging.getLogger("microbatch.test").warning("model said %s", hostile)
        line = capfd.readouterr().err
    finally:
        logging.getLogger().handlers.clear()
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]", line), line
    assert len(line.splitlines()) == 1
    assert json.loads(line)["message"] == f"model said {hostile}"
