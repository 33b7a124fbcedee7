"""broker.errors: what callers see of the typed errors, and what survives a pickle (futures of
process pools and multiprocessing queues pickle exceptions)."""

from __future__ import annotations

import pickle

import pytest

import broker
from broker.errors import WIRE_ERRORS, MicrobatchError

ERRORS = [MicrobatchError, *WIRE_ERRORS.values()]


def test_every_wire_error_is_exported_by_broker() -> None:
    assert {cls.__name__ for cls in ERRORS} <= set(broker.__all__)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_error_pickles_whole_and_its_repr_names_the_item(cls: type[MicrobatchError]) -> None:
    error = cls("the model raised", index=3)
    assert str(error) == "item 3: the model raised"
    assert repr(error) == f"{cls.__name__}('the model raised', index=3)"
    assert repr(cls("late")) == f"{cls.__name__}('late')"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert (copy.message, copy.index, str(copy)) == (error.message, 3, str(error))
