"""``EngineLoop``: the one thread that owns the ``LLMEngine``.

Every engine call (add, abort, the chat template and tokenizer, step) runs on this thread,
so the engine stays the synchronous object the offline API drives. The HTTP side talks to
it in two ways:

- ``call(fn)``: run ``fn(engine)`` on the engine thread between steps; the result (or
  exception) comes back as a ``concurrent.futures.Future`` (await it with
  ``asyncio.wrap_future``);
- a ``Sink`` per request: each ``RequestOutput`` of the request is handed to the sink's
  asyncio queue with ``loop.call_soon_threadsafe``; the last one has ``finished`` set.

A step that fails for good (the engine is dead) hands an ``EngineFailure`` to every sink.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sarathi_pp.engine import LLMEngine, ReplicatedEngine
from sarathi_pp.serve.bubble_window import BubbleWindow
from sarathi_pp.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# How long the idle loop sleeps waiting for a command (seconds): bounds the delay of
# noticing ``stop`` only; commands wake it at once.
_IDLE_WAIT_S = 0.1


class EngineFailure(Exception):
    """The engine could not go on (dead pipeline or a bug in a step): the request ends."""


@dataclass
class Sink:
    """Where one request's outputs go: an asyncio queue read by its HTTP handler."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _bubble_window(engine: LLMEngine) -> BubbleWindow:
    """The bubble window of one pipeline, told what its loop does; on its run dir's clock
    when it has one, so /metrics' interval reads against it."""
    events = getattr(engine.recorder, "events", None)
    t0 = events.t0 if events is not None else engine.now()
    window = BubbleWindow(engine.config.parallel.pipeline_parallel_size, t0, engine.now)
    engine.add_observer(window)
    return window


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        # Observers of the loop: stage times and finished requests, and the bubble window of
        # each pipeline (with replicas, one each: the classes are per pipeline; the gauges
        # without a replica label are replica 0's).
        engine.add_observer(self.metrics)
        pipelines = engine.engines if isinstance(engine, ReplicatedEngine) else [engine]
        windows = [_bubble_window(e) for e in pipelines]
        self.metrics.watch_bubbles(windows[0])
        if len(windows) > 1:
            self.metrics.watch_replica_bubbles(windows)
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], Future]] = queue.Queue()
        self._sinks: dict[str, Sink] = {}  # request id -> sink; engine thread only
        self._stop = threading.Event()
        self.accepting = True  # false once a stop began: new requests get a 503
        self._thread = threading.Thread(target=self._run, name="sarathi-pp-engine", daemon=True)

    # --- the HTTP side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread; its result or exception in the future."""
        future: Future = Future()
        if not self._thread.is_alive():
            future.set_exception(EngineFailure("the engine loop is not running"))
        else:
            self._commands.put((fn, future))
        return future

    def add(self, request_ids: list[str], sink: Sink, add: Callable[[LLMEngine], Any]) -> Future:
        """Run ``add(engine)`` (which adds ``request_ids``, all or none); on success their
        outputs go to ``sink``."""

        def fn(engine: LLMEngine) -> Any:
            result = add(engine)
            for request_id in request_ids:
                self._sinks[request_id] = sink
            return result

        return self.call(fn)

    def abort(self, request_id: str) -> None:
        """End the request (a client gone): its blocks are freed, its sink gets the last
        output (``finish_reason="abort"``) and is dropped."""
        self.call(lambda engine: engine.abort(request_id))

    def abort_all(self) -> Future:
        """Stop accepting and abort every request in flight (the start of a graceful stop)."""
        self.accepting = False

        def fn(engine: LLMEngine) -> None:
            for request_id in list(self._sinks):
                engine.abort(request_id)

        return self.call(fn)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, let the engine hand out the final outputs, write the run's
        records (with a run dir) and shut the engine down; joins the thread."""
        self.accepting = False
        if self._thread.is_alive():
            self.abort_all()
            self._stop.set()
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout_s)

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    # --- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.metrics.engine_state(self.engine)  # the KV blocks before any request
            while not self._stop.is_set() or self._sinks:
                self._run_commands(block=not self._has_work())
                if self._has_work():
                    self._step()
                elif self._stop.is_set():
                    break
        finally:
            self._drain_commands()
            self._finish()

    def _has_work(self) -> bool:
        # A sink whose request is no longer unfinished awaits its last output (an abort's
        # comes with the next step).
        engine = self.engine
        return engine.is_alive() and (engine.has_unfinished_requests() or bool(self._sinks))

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._get()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    future.set_exception(e)
            try:
                fn, future = self._get()
            except queue.Empty:
                return

    def _get(self) -> tuple[Callable[[LLMEngine], Any], Future]:
        return self._commands.get_nowait()

    def _drain_commands(self) -> None:
        while True:
            try:
                _, future = self._get()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineFailure("the server is stopping"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the server stays up to say so
            logger.exception("engine step failed")
            self._fail_all(e)
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                sink.put(out)
        self.metrics.engine_state(self.engine)

    def _fail_all(self, error: Exception) -> None:
        reason = self.engine.dead_reason or f"{type(error).__name__}: {error}"
        sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            self.engine.abort(request_id)  # bookkeeping only: recorded even on a dead engine
            sink.put(EngineFailure(reason))
        if self.engine.is_alive():
            try:
                self.engine.step()  # hands out (and drops) the aborted requests' outputs
            except Exception:  # noqa: BLE001 - already reported
                logger.exception("engine step after a failure failed")

    def _finish(self) -> None:
        for sink in self._sinks.values():
            sink.put(EngineFailure("the server is stopping"))
        self._sinks.clear()
        try:
            self.engine.write_run_records()
        except Exception:  # noqa: BLE001 - the shutdown matters more
            logger.exception("writing the run's records failed")
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("engine shutdown failed")
