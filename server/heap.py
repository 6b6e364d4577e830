"""The garbage collector of a serving process (the API process and the engine process alike)."""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 20)  # the collector's generations 0, 1, 2 (tune_garbage_collector)


def tune_garbage_collector() -> None:
    """A serving process's collector: thresholds higher than CPython's (every generated token allocates a few objects),
    and the start-up heap frozen once loaded (:func:`freeze_startup_heap`) so that full collections do not walk it."""
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_startup_heap() -> None:
    """Move everything alive now out of the collector's reach (``gc.freeze``). Models added later at runtime are not
    frozen: they can be deleted again."""
    gc.collect()
    gc.freeze()
