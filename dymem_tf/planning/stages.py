"""Wall time of each stage of the Dymem pass, for ``DymemCallback(verbose=2)`` and ``bench/pass_time.py``.

The pass (:mod:`dymem_tf.passes.step_pass`) opens a :class:`StageClock` for each instantiation; the stages it runs
through mark themselves with :func:`stage`, which costs nothing when no clock is open (the dry run, the tests).
Stages nest (the planner's search simulates many swap sets): each stage's time is *exclusive*, the time of the
stages inside it is counted only for those, so the stages add up to the clock's total.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
from typing import Iterator

#: The stages in pipeline order (the order :meth:`StageTimes.summary` prints them in); others follow in first-use order.
STAGES = ("read", "capture", "offload", "defer", "order", "hold", "recompute", "stream", "candidates", "search",
          "simulate", "triggers", "sequence", "placement", "rewrite")

_clock: contextvars.ContextVar["StageClock | None"] = contextvars.ContextVar("dymem_stage_clock", default=None)


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Exclusive wall seconds per stage of one pass, in :data:`STAGES` order."""

    seconds: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return sum(s for _, s in self.seconds)

    def get(self, name: str) -> float:
        """Seconds of stage ``name`` (0 when it did not run)."""
        return next((s for n, s in self.seconds if n == name), 0.0)

    def as_dict(self) -> dict[str, float]:
        return {n: round(s, 4) for n, s in self.seconds}

    def summary(self) -> str:
        """``"capture 1.20 s, hold 0.10 s, ..."``: the stages that took at least a millisecond."""
        return ", ".join(f"{n} {s:.2f} s" for n, s in self.seconds if s >= 1e-3) or "no stage timed"


class StageClock:
    """Accumulates exclusive seconds per stage while it is :meth:`active`."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._stack: list[list] = []  # [name, start, seconds of nested stages]

    @contextlib.contextmanager
    def active(self) -> Iterator["StageClock"]:
        """Make this the clock that :func:`stage` records into (for the current thread or task)."""
        token = _clock.set(self)
        try:
            yield self
        finally:
            _clock.reset(token)

    def _enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def _exit(self) -> None:
        name, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._seconds[name] = self._seconds.get(name, 0.0) + elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed

    def times(self) -> StageTimes:
        """What was recorded so far."""
        known = [n for n in STAGES if n in self._seconds] + [n for n in self._seconds if n not in STAGES]
        return StageTimes(tuple((n, self._seconds[n]) for n in known))


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the enclosed code as stage ``name`` of the active clock (nothing without one)."""
    clock = _clock.get()
    if clock is None:
        yield
        return
    clock._enter(name)
    try:
        yield
    finally:
        clock._exit()


def timed(name: str):
    """Decorator: count every call of the function as stage ``name`` (see :func:`stage`)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with stage(name):
                return fn(*args, **kwargs)
        return inner
    return wrap
