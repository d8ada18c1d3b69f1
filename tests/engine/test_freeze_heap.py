"""`freeze_heap`: one collection, then the objects alive stay out of the collector's later passes."""

import gc
import subprocess
import sys
import weakref

import pytest

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


def test_a_frozen_heap_is_collected_at_exit():
    """The frozen objects go back to the collector at exit: frozen, the cycles among Triton's module objects
    outlived the interpreter's last collection, and its bindings printed dozens of leak lines after every
    `tandem generate`."""
    pytest.importorskip("triton")
    script = "import triton.language\nfrom tandem.engine import freeze_heap\nfreeze_heap()\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr
