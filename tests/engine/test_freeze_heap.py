"""`freeze_heap`: one collection, then the objects alive stay out of the collector's later passes."""

import gc
import weakref

from tandem.engine import freeze_heap


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_heap_collects_garbage_first_then_freezes_what_lives():
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the steps below
    try:
        garbage = _Node()
        dead = weakref.ref(garbage)
        del garbage
        kept = _Node()
        assert dead() is not None  # a cycle waits for the collector
        freeze_heap()
        assert dead() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        alive = weakref.ref(kept)
        del kept
        gc.collect()
        assert alive() is not None  # frozen: later collections leave it alone
        gc.unfreeze()
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
