"""The server's frozen heap: what was loaded is out of the collector's walks while serving, what is made
then is collected as before, and the heap is whole again afterwards (even after an error)."""

import gc
import weakref

import pytest

from dsv3.infer.heap import loaded_heap_frozen


class Node:
    def __init__(self):
        self.me = self  # a cycle: only the cyclic collector frees it


def test_what_was_loaded_is_frozen_and_what_comes_later_is_collected():
    loaded = Node()
    with loaded_heap_frozen():
        assert gc.get_freeze_count() > 0
        assert not any(obj is loaded for obj in gc.get_objects())  # out of every generation the collector walks
        later = weakref.ref(Node())
        gc.collect()
        assert later() is None
    assert gc.get_freeze_count() == 0
    assert any(obj is loaded for obj in gc.get_objects())


def test_the_heap_is_unfrozen_when_serving_fails():
    with pytest.raises(RuntimeError), loaded_heap_frozen():
        raise RuntimeError("the server stopped")
    assert gc.get_freeze_count() == 0
