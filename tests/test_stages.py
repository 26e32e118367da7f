"""The pass's stage clock (dymem_tf.planning.stages): exclusive times of nested stages, nothing without a clock."""
from __future__ import annotations

import time

from dymem_tf.planning import stages


def test_nested_stages_are_exclusive_and_add_up():
    clock = stages.StageClock()
    with clock.active():
        with stages.stage("search"):
            time.sleep(0.02)
            for _ in range(3):
                with stages.stage("simulate"):
                    time.sleep(0.01)
        with stages.stage("capture"):
            time.sleep(0.01)
    t = clock.times()
    assert [n for n, _ in t.seconds] == ["capture", "search", "simulate"]  # STAGES order, not call order
    assert 0.03 <= t.get("simulate") < 0.2
    assert 0.02 <= t.get("search") < 0.2  # without the simulations inside it
    assert t.get("search") < 0.02 + t.get("simulate")
    assert abs(t.total - sum(s for _, s in t.seconds)) < 1e-12
    assert t.get("rewrite") == 0.0
    assert "search" in t.summary() and "rewrite" not in t.summary()
    assert set(t.as_dict()) == {"capture", "search", "simulate"}


def test_without_a_clock_nothing_is_recorded_and_timed_functions_still_run():
    calls = []

    @stages.timed("placement")
    def work(x):
        calls.append(x)
        return x * 2

    assert work(3) == 6 and calls == [3]
    clock = stages.StageClock()
    with clock.active():
        assert work(4) == 8
    assert work(5) == 10  # recorded nowhere once the clock is closed
    assert list(clock.times().as_dict()) == ["placement"]


def test_a_stage_that_raises_is_still_counted():
    clock = stages.StageClock()
    with clock.active():
        try:
            with stages.stage("rewrite"):
                raise ValueError("plan did not fit")
        except ValueError:
            pass
        with stages.stage("read"):
            pass
    assert [n for n, _ in clock.times().seconds] == ["read", "rewrite"]
    assert stages.StageTimes().summary() == "no stage timed"
