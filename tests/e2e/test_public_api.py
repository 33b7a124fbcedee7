"""What `help()` shows a user of the public API: every exported class and its public methods
and properties have docstrings, and the calls' docstrings say what they raise."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import broker
import gpu_worker
from broker.client_settings import ClientSettings

EXPORTED = [
    *(getattr(broker, name) for name in broker.__all__),
    *(getattr(gpu_worker, name) for name in gpu_worker.__all__),
    ClientSettings,
]
CLASSES = [obj for obj in EXPORTED if inspect.isclass(obj)]


def _public(cls: type) -> list[tuple[str, Any]]:
    return [
        (name, member)
        for name, member in vars(cls).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    ]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_public_member_of_an_exported_class_has_a_docstring(cls: type) -> None:
    assert inspect.getdoc(cls)
    assert [name for name, member in _public(cls) if not member.__doc__] == []


@pytest.mark.parametrize("method", ["predict", "submit", "apredict", "astart"])
def test_the_calls_docstrings_say_what_timeout_is_and_what_they_raise(method: str) -> None:
    doc = inspect.getdoc(getattr(broker.Streamer, method)) or ""
    for said in ("timeout", "TypeError", "ValueError", "MicrobatchError", "index"):
        assert said in doc, (method, said)
