"""loopfile's own records (written out, not dataclasses: a mount imports no ``dataclasses``)
behave as the frozen dataclasses they replaced: copy, deepcopy and pickle give an equal
record, and a field can be neither assigned nor deleted."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
from flexhub_loopfile import _Created
from flexhub_loopfile._loop import LoopDevice
from flexhub_loopfile._room import Room

RECORDS = [LoopDevice("loop3", 3), Room(1, 2, 3), _Created((1, 2), 4096, (Path("/srv/a"),))]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_copy_deepcopy_and_pickle_give_an_equal_record(record: object) -> None:
    assert copy.copy(record) == record
    assert copy.deepcopy(record) == record
    assert pickle.loads(pickle.dumps(record)) == record


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_field_can_be_neither_assigned_nor_deleted(record: object) -> None:
    field = type(record).__slots__[0]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        setattr(record, field, None)
    with pytest.raises(AttributeError):
        delattr(record, field)
