"""Ctrl-C without torn state: ``deferred_interrupts`` holds a SIGINT back while the engine
updates its bookkeeping (a scheduling decision and its tracking, or applying a
micro-batch's tokens and stop checks) or hands a micro-batch to the stages (every stage
gets it or none does: their activation channels stay in step), then raises
``KeyboardInterrupt`` at the end of the block (on one process the hand-over is the forward
pass itself: Ctrl-C lands when it ends). Waiting for the stages' results may be
interrupted: the engine then abandons the micro-batches in flight and recomputes their
sequences (``Scheduler.on_microbatches_lost``), so no state is left half-updated.

Only in the main thread (Python delivers signals there) and only when SIGINT has Python's
default handler (a program with its own handler keeps it). Note [handler swaps]: two handler
swaps per block, through ``_signal`` (the C module under ``signal``, whose wrappers turn
every handler into an enum and back: a cost per block that a simulated run of hundreds of
thousands of steps would feel; the figure: the lab notebook's "Figures moved out of the
code", Note [handler swaps]).
"""

from __future__ import annotations

import _signal
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SIGINT = int(signal.SIGINT)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    if (
        threading.current_thread() is not threading.main_thread()
        or _signal.getsignal(_SIGINT) is not _signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    _signal.signal(_SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        _signal.signal(_SIGINT, _signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
