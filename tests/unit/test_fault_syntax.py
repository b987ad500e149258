"""``parallel.inject_fault`` (testing only): parsing, which faults fire where, and what the
stages that replace lost ones keep (``after_restart``)."""

from __future__ import annotations

import pytest

from sarathi_pp.fault_injection import Fault, after_restart, parse_faults


def test_parse_and_applies():
    seq, step = parse_faults("raise@stage=1,seq=2; exit@stage=0,step=3")
    assert seq == Fault("raise", 1, seq=2) and step == Fault("exit", 0, step=3)
    assert (
        seq.applies(1, 7, [0, 2]) and not seq.applies(1, 7, [0, 1]) and not seq.applies(0, 7, [2])
    )
    assert step.applies(0, 3, []) and not step.applies(0, 4, []) and not step.applies(1, 3, [])


@pytest.mark.parametrize(
    "text, match",
    [
        ("boom@stage=1,seq=2", "expected ACTION@KEY=VALUE"),
        ("raise@stage=1", "needs stage= and one of seq= or step="),
        ("raise@stage=1,seq=2,step=3", "needs stage= and one of seq= or step="),
        ("exit@stage=1,seq=2", "exit takes step=, not seq="),
        ("raise@stage=x,seq=2", "stage='x' is not a number"),
        ("raise@stage=1,when=2", "unknown key"),
    ],
)
def test_bad_faults_name_the_part(text, match):
    with pytest.raises(ValueError, match=match):
        parse_faults(text)


def test_replacement_stages_keep_only_the_poisoned_requests():
    """A step fault is the first stages' event: an ``exit`` kept would take every
    replacement down at its own K-th micro-batch, and recovery could never be shown."""
    assert after_restart("exit@stage=1,step=5") is None
    assert after_restart("raise@stage=1,seq=2; stall@stage=0,step=3,seconds=1") == (
        "raise@stage=1,seq=2"
    )
    assert after_restart(None) is None and after_restart("") == ""
