"""The progress bar of ``python -m training eval`` and ``text-eval``: tqdm on stderr, at a terminal only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

TICK_S = 1.0


@contextmanager
def progress_bar(progress: bool, **options: Any) -> Iterator[tqdm]:
    """A tqdm bar (``options``: tqdm's) on stderr where it is a terminal, none elsewhere or when ``progress`` is
    false; closed at the end. Its elapsed time moves every ``TICK_S`` even while one call runs long and nothing is
    counted (the first batch of a model compiles its CPU kernels: 20-60 s on a loaded 2-core machine)."""
    bar = tqdm(disable=None if progress else True, **options)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(TICK_S):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="progress-tick", daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()
        bar.close()
