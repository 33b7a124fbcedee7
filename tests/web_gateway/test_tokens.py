"""web_gateway.tokens: a tokens file read again once it has changed and settled, without a
restart; a change that cannot be used leaves the tokens in force."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from web_gateway.settings import GatewaySettings
from web_gateway.tokens import CHECK_EVERY_S, Tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += CHECK_EVERY_S


def replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a Secret's update does: a new file renamed over it."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# comment\nold-token\n")
    return path


def test_a_rotated_file_is_read_once_it_has_settled(tokens_file: Path) -> None:
    """Tokens were read as each gateway process started: a rotated Secret took a restart."""
    clock = Clock()
    just_written = lambda: os.stat(tokens_file).st_mtime  # noqa: E731 (the wall clock)
    tokens = Tokens(GatewaySettings(auth_tokens_file=tokens_file), clock, just_written)
    assert tokens.get() == [b"old-token"]
    replace(tokens_file, "new-token\n")
    clock.tick()
    assert tokens.get() == [b"old-token"]  # changed a moment ago: it may still be written
    clock.tick()
    assert tokens.get() == [b"new-token"]
    clock.tick()
    assert tokens.get() == [b"new-token"]


def test_a_change_that_cannot_be_used_keeps_the_tokens_in_force(
    tokens_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    tokens = Tokens(GatewaySettings(auth_tokens_file=tokens_file, auth_tokens=["env"]), clock)
    for broken in ("# emptied\n", b"\xff\xfe secret-looking bytes"):
        if isinstance(broken, bytes):
            fresh = tokens_file.with_suffix(".new")
            fresh.write_bytes(broken)
            os.replace(fresh, tokens_file)
        else:
            replace(tokens_file, broken)
        with caplog.at_level(logging.WARNING, logger="microbatch.gateway"):
            for _ in range(4):
                clock.tick()
                assert sorted(tokens.get()) == [b"env", b"old-token"]  # auth never turns off
    tokens_file.unlink()
    for _ in range(4):
        clock.tick()
        assert sorted(tokens.get()) == [b"env", b"old-token"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 3, said  # once a change
    assert "holds no token" in said[0] and "not UTF-8 text" in said[1]
    assert "No such file" in said[2]
    assert not any("secret" in message for message in said)


def test_without_a_file_nothing_is_looked_at(tmp_path: Path) -> None:
    clock = Clock()
    tokens = Tokens(GatewaySettings(auth_tokens=["a"]), clock)
    clock.tick()
    assert tokens.get() == [b"a"]
    assert Tokens(GatewaySettings(), clock).get() == []


def test_a_change_made_while_no_request_came_is_in_force_at_the_next(tokens_file: Path) -> None:
    """A process looks only on some request's way: the first requests after a quiet spell were
    let in by a token removed minutes before (the change had not been seen to settle yet)."""
    clock = Clock()
    tokens = Tokens(GatewaySettings(auth_tokens_file=tokens_file), clock)
    replace(tokens_file, "new-token\n")
    changed = os.stat(tokens_file).st_mtime - 600  # the Secret was rotated 10 minutes ago
    os.utime(tokens_file, (changed, changed))
    for _ in range(600):  # quiet: no request, so no look
        clock.tick()
    assert tokens.get() == [b"new-token"]
