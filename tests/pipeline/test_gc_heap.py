"""The startup heap frozen (pipeline/gc_heap.py): what lives at start-up is
left out of every later collection; what is made afterwards is collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from pipeline.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_the_startup_heap_is_left_out_and_later_garbage_still_collected(unfrozen: None) -> None:
    startup = Node()
    assert any(o is startup for o in gc.get_objects())
    assert freeze_startup_heap() >= 1
    # Frozen: a full collection no longer walks it.
    assert not any(o is startup for o in gc.get_objects())
    # A cycle made after start-up is garbage as before.
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
