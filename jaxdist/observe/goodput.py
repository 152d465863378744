"""Where a run's wall time goes: the steps at their steady rate, and everything else by cause.

Goodput is the share of a run's wall time its steps took at their steady rate. The steady step
time is the median over the logging intervals of each interval's time per step, measured without
the saves, evaluations and logging inside it; MFU and tokens/s in the summary are that rate's. An
interval's steps count at the steady time each, or at their own where they ran faster: a step is
never counted as more than it took, so the steps' part of any stretch of wall time is at most that
stretch (a median of intervals of different lengths can lie above their mean). What the rest of
the wall time went to is accounted by cause: start-up (data, init, restore, trace, compile, the
first step's one-time costs), saves (the loop's blocking part), evaluation, logging, steps slower
than steady (of which the loop waited on input), the last checkpoint's write, and what is left
over. The summary also gives goodput between the first step and the last: without the costs a run
pays once, however long it is (start-up, the last write).
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
_LABELS = {"process": "process start", "warm_up": "eval, save and log programs", "first_step": "first step",
           "last_write": "the last checkpoint's write"}


class RunTime:
    """Accounts a run's wall time from `started` (a `time.perf_counter()` reading) on."""

    def __init__(self, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self.parts: dict[str, float] = {}
        self._intervals: list[tuple[int, float]] = []  # (steps, seconds per step without saves, evals, logging)
        self._first_step_s: float | None = None  # the run's first step, alone in its interval
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

    def interval(self, steps: int, step_time_s: float, input_wait_s: float, first: bool = False) -> None:
        """Records a logging interval: `steps` steps at `step_time_s` each (saves, evals and logging
        left out), of which the loop waited `input_wait_s` in all for input. `first`: the run's
        first step, whose time over the steady step's is a start-up cost (its first run of each
        kernel, allocations)."""
        if first and steps == 1:
            self._first_step_s = step_time_s
        else:
            self._intervals.append((steps, step_time_s))
        self.input_wait_s += input_wait_s

    @property
    def steps(self) -> int:
        return sum(steps for steps, _ in self._intervals) + (self._first_step_s is not None)

    def steady_step_s(self) -> float | None:
        """The median interval's time per step (intervals of more than one step where there are
        any: a step logged alone is noisier)."""
        longer = [seconds for steps, seconds in self._intervals if steps > 1]
        times = longer or [seconds for _, seconds in self._intervals] or (
            [] if self._first_step_s is None else [self._first_step_s])
        return statistics.median(times) if times else None

    def startup_s(self) -> float:
        return sum(self.parts.get(name, 0.0) for name in STARTUP)

    def productive_s(self, steady: float) -> float:
        """The steps' time at the `steady` step time: each interval's steps at `steady`, or at their
        own time where that is shorter (so never more than the steps took)."""
        first = [] if self._first_step_s is None else [(1, self._first_step_s)]
        return sum(steps * min(seconds, steady) for steps, seconds in first + self._intervals)

    def slower_s(self, steady: float) -> float:
        """What the intervals' steps took beyond the `steady` step time (the first step's excess is
        start-up, not counted here)."""
        return sum(steps * max(0.0, seconds - steady) for steps, seconds in self._intervals)

    def goodput(self, now: float | None = None) -> float | None:
        """The steps' time at the steady rate over the wall time so far (None before any step)."""
        steady = self.steady_step_s()
        wall = (time.perf_counter() if now is None else now) - self.started
        return None if steady is None or wall <= 0 else self.productive_s(steady) / wall

    def startup_line(self) -> str:
        """The start-up's parts in words: `ready to train after 12.3 s: data 0.4 s, init 1.1 s, ...`."""
        parts = ", ".join(f"{_LABELS.get(name, name)} {self.parts[name]:.1f} s" for name in STARTUP
                          if self.parts.get(name, 0.0) >= 0.05)
        return f"ready to train after {time.perf_counter() - self.started:.1f} s" + (f": {parts}" if parts else "")

    def summary(self, now: float | None = None) -> str:
        """Goodput and what the rest of the wall time went to, by cause, at `now` (default: the present)."""
        wall = (time.perf_counter() if now is None else now) - self.started
        steady = self.steady_step_s()
        if steady is None:
            return f"no step trained in {wall:.1f} s"
        productive = self.productive_s(steady)
        first_step = 0.0 if self._first_step_s is None else max(0.0, self._first_step_s - steady)
        once = [(_LABELS.get(name, name), self.parts.get(name, 0.0)) for name in STARTUP]
        once += [(_LABELS["first_step"], first_step), (_LABELS["last_write"], self.parts.get("last_write", 0.0))]
        running = [(name, self.parts.get(name, 0.0)) for name in ("saves", "eval", "logging")]
        running.append((f"steps slower than steady (input waits {self.input_wait_s:.1f} s)", self.slower_s(steady)))
        accounted = productive + sum(seconds for _, seconds in once + running)
        running.append(("other", max(0.0, wall - accounted)))
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in once + running if seconds >= 0.05)
        between = wall - sum(seconds for _, seconds in once)
        steady_share = f"; {productive / between:.1%} from the first step to the last" if between > 0 else ""
        return (f"goodput {productive / wall:.1%} ({productive:.1f} s of steps in {wall:.1f} s{steady_share}, "
                f"start-up and the last checkpoint's write left out)" + (f"; the rest: {shown}" if shown else ""))
