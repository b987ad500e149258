"""Reads that wait for nothing: CUDA events read once complete (``CudaEventClock``, Note
[compute spans from CUDA events]) and received headers checked once copied
(``HeaderChecks``, Note [header without a device sync]), with fake events."""

from __future__ import annotations

import pytest
import torch

from sarathi_pp.comm.p2p import HeaderChecks, StageMismatchError
from sarathi_pp.stages.worker.timing import CudaEventClock, WallClock


class FakeEvent:
    """An event on a fake stream: recorded at ``recorded_ms`` of the device's timeline,
    complete once the device has reached it (``Device.now_ms``)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.recorded_ms: float | None = None
        self.waits = 0

    def record(self) -> None:
        self.recorded_ms = self.device.queue_ms

    def query(self) -> bool:
        assert self.recorded_ms is not None
        return self.device.now_ms >= self.recorded_ms

    def synchronize(self) -> None:
        self.waits += 1
        assert self.recorded_ms is not None
        self.device.now_ms = max(self.device.now_ms, self.recorded_ms)

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.query() and other.query(), "elapsed_time of an event still running"
        assert self.recorded_ms is not None and other.recorded_ms is not None
        return other.recorded_ms - self.recorded_ms


class Device:
    def __init__(self) -> None:
        self.queue_ms = 0.0  # where the next recorded event lands on the device's timeline
        self.now_ms = 0.0  # how far the device has run
        self.events: list[FakeEvent] = []

    def event(self) -> FakeEvent:
        e = FakeEvent(self)
        self.events.append(e)
        return e


def test_event_spans_are_read_only_once_complete_and_without_a_wait():
    dev = Device()
    clock = CudaEventClock(1, dev.event, now=lambda: 100.0)  # anchor: device 0 ms = host 100 s
    assert dev.events[0].waits == 1  # the anchor's one wait, at set-up
    dev.queue_ms = 5.0
    clock.begin(7)
    dev.queue_ms = 25.0
    clock.end(7)
    assert clock.read(7) is None  # still running: nothing read, nothing waited for
    dev.now_ms = 10.0
    assert clock.read(7) is None and 7 in clock.pending
    dev.now_ms = 30.0
    start, end = clock.read(7)
    assert (start, end) == pytest.approx((100.005, 100.025))
    assert 7 not in clock.pending
    assert all(e.waits == 0 for e in dev.events[1:])  # no read waited


def test_a_span_reported_before_its_events_complete_is_the_hosts_and_counted():
    dev = Device()
    recorded: list[str] = []
    clock = CudaEventClock(0, dev.event, now=lambda: 50.0, record=recorded.append)
    dev.queue_ms = 1.0
    clock.begin(3)
    dev.queue_ms = 2.0
    clock.end(3)
    assert clock.span(3, 50.0005, 50.0007) == (50.0005, 50.0007)  # host times
    assert (clock.host_spans, clock.gpu_spans) == (1, 0) and not clock.pending
    assert len(recorded) == 1 and recorded[0].startswith("timing: compute spans from the host")
    dev.queue_ms = 3.0
    clock.begin(4)
    dev.queue_ms = 9.0
    clock.end(4)
    dev.now_ms = 9.0  # the last stage: its token copy waited for the device
    # the GPU's span, kept within the host's reads around the micro-batch
    assert clock.span(4, 50.0, 50.02) == pytest.approx((50.003, 50.009))
    assert (clock.host_spans, clock.gpu_spans) == (1, 1) and len(recorded) == 1


def test_the_wall_clock_keeps_the_hosts_span():
    c = WallClock()
    c.begin(1)
    c.end(1)
    assert c.span(1, 2.0, 3.5) == (2.0, 3.5)


def test_headers_are_checked_once_copied_and_a_mismatch_still_raises():
    dev = Device()
    checks = HeaderChecks(2, dev.event)
    checks.add([5, 4, 8, 0], torch.tensor([5, 4, 8, 0]))
    dev.queue_ms = 1.0
    checks.add([6, 4, 8, 0], torch.tensor([7, 4, 8, 0]))  # the sender sent micro-batch 7
    dev.now_ms = 0.5
    checks.poll()  # the first is copied and fine; the second not yet copied: not read
    assert len(checks.pending) == 1
    with pytest.raises(StageMismatchError) as info:
        checks.poll(block=True)
    msg = str(info.value)
    assert msg.startswith("stage 2: expected micro-batch 6 hidden [4, 8] float32 from stage 1")
    assert "received micro-batch 7" in msg and "checked after the receive" in msg
