"""Where a run's wall time goes: the steps at their steady rate, and everything else by cause.

Goodput is what a run trained per second of wall time, as a share of what its steady step rate
would train in that time: `steps x steady step time / wall time`. The steady step time is the
median over the logging intervals of each interval's time per step, measured without the saves,
evaluations and logging inside it; MFU and tokens/s in the summary are that rate's. What the rest
of the wall time went to is accounted by cause: start-up (data, init, restore, trace, compile),
saves (the loop's blocking part, and the wait for the last write), evaluation, logging, steps
slower than steady (of which the loop waited on input), and what is left over.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

# The parts of a run's start, in the order the loop goes through them: the process's own start
# (imports, joining the other processes), reading the data, checking the config, data and
# checkpoints against each other, building kernels, creating the state, restoring it, tracing and
# compiling the step, compiling what a save runs.
STARTUP = ("process", "data", "checks", "kernels", "init", "restore", "trace", "compile", "warm_up")
_LABELS = {"process": "process start", "warm_up": "checkpoint programs"}


class RunTime:
    """Accounts a run's wall time from `started` (a `time.perf_counter()` reading) on."""

    def __init__(self, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self.parts: dict[str, float] = {}
        self._intervals: list[tuple[int, float]] = []  # (steps, seconds per step without saves, evals, logging)
        self.input_wait_s = 0.0

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Adds the time spent in the block to part `name` (a `STARTUP` part, "saves", "eval", "logging")."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def interval(self, steps: int, step_time_s: float, input_wait_s: float) -> None:
        """Records a logging interval: `steps` steps at `step_time_s` each (saves, evals and logging
        left out), of which the loop waited `input_wait_s` in all for input."""
        self._intervals.append((steps, step_time_s))
        self.input_wait_s += input_wait_s

    @property
    def steps(self) -> int:
        return sum(steps for steps, _ in self._intervals)

    def steady_step_s(self) -> float | None:
        """The median interval's time per step (intervals of more than one step where there are
        any: the first step after a start runs alone and pays one-time costs)."""
        longer = [seconds for steps, seconds in self._intervals if steps > 1]
        times = longer or [seconds for _, seconds in self._intervals]
        return statistics.median(times) if times else None

    def startup_s(self) -> float:
        return sum(self.parts.get(name, 0.0) for name in STARTUP)

    def goodput(self, now: float | None = None) -> float | None:
        """Steps x steady step time over the wall time so far (None before any step)."""
        steady = self.steady_step_s()
        wall = (time.perf_counter() if now is None else now) - self.started
        return None if steady is None or wall <= 0 else min(1.0, self.steps * steady / wall)

    def startup_line(self) -> str:
        """The start-up's parts in words: `ready to train after 12.3 s: data 0.4 s, init 1.1 s, ...`."""
        parts = ", ".join(f"{_LABELS.get(name, name)} {self.parts[name]:.1f} s" for name in STARTUP
                          if self.parts.get(name, 0.0) >= 0.05)
        return f"ready to train after {time.perf_counter() - self.started:.1f} s" + (f": {parts}" if parts else "")

    def summary(self) -> str:
        """Goodput and what the rest of the wall time went to, by cause."""
        now = time.perf_counter()
        wall = now - self.started
        steady = self.steady_step_s()
        if steady is None:
            return f"no step trained in {wall:.1f} s"
        productive = self.steps * steady
        stepping = sum(steps * seconds for steps, seconds in self._intervals)
        causes = [(_LABELS.get(name, name), self.parts.get(name, 0.0)) for name in STARTUP]
        causes += [(name, self.parts.get(name, 0.0)) for name in ("saves", "eval", "logging")]
        slower = max(0.0, stepping - productive)
        causes.append((f"steps slower than steady (input waits {self.input_wait_s:.1f} s)", slower))
        causes.append(("other", max(0.0, wall - productive - sum(seconds for _, seconds in causes))))
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in causes if seconds >= 0.05)
        after_start = wall - self.startup_s()
        after = f", {productive / after_start:.1%} after start-up" if after_start > 0 else ""
        return (f"goodput {productive / wall:.1%} ({productive:.1f} s of steps in {wall:.1f} s{after})"
                + (f"; the rest: {shown}" if shown else ""))
