"""Preemption: a SIGTERM or SIGINT asks the loop to stop at the next step boundary.

In one process, Python handlers record the first signal (a second one acts as outside the steps:
SIGINT raises KeyboardInterrupt, SIGTERM `Terminated`, and the loop leaves at once). With several
processes, the signal may reach only some of them, and stopping must happen at the same step
everywhere because saving is collective:
there JAX's preemption service (started by `jax.distributed.initialize`) catches SIGTERM, tells
every process, and `reached_preemption_sync_point` names the step at which all of them stop.
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils

from jaxdist import runtime

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager that turns SIGTERM/SIGINT into a stop request read at step boundaries."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if runtime.interrupted():
            raise runtime.interruption()  # a Ctrl-C before the steps that was dropped (runtime.remember_interrupts)
        # Handlers can only be installed from the main thread; with several processes JAX's own
        # SIGTERM notifier must stay in place (a Python handler would replace it).
        if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _record(self, signum: int, frame) -> None:
        self.received = signal.Signals(signum).name
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def requested(self, step: int) -> str | None:
        """The reason to stop after `step` (e.g. 'SIGTERM'), or None to go on.

        With several processes, call it at every step: every process gets the same answer.
        """
        if jax.process_count() > 1:
            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        return self.received
