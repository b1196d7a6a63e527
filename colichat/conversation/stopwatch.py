"""How long a prefill or an answer took, without the time colichat was stopped (Ctrl-Z until `fg`),
so that the footer's speeds are the model's and not the length of a pause.

Only the end of a stop can be seen (SIGCONT): catching its start (SIGTSTP) would race with the shell
that continues the job. So on SIGCONT the stop is taken as the wall time since the last tick (the
last token, or piece of prompt) less the CPU time the main thread had meanwhile: what is left out is
the stop, plus at most the waits of that one step.
"""

from __future__ import annotations

import time


def _now() -> tuple[float, float]:
    """(wall, CPU time of this thread); the ticks and the SIGCONT handler both run on the main thread."""
    return time.perf_counter(), time.thread_time()


class Stopwatch:
    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.began = time.perf_counter()
        self.last = _now()
        self.stopped = 0.0  # seconds left out

    def tick(self) -> None:
        """A step is done (a token, a piece of the prompt)."""
        self.last = _now()

    def continued(self) -> None:
        """The process was continued after a stop (from a SIGCONT handler)."""
        wall, cpu = _now()
        self.stopped += max(0.0, (wall - self.last[0]) - (cpu - self.last[1]))
        self.last = (wall, cpu)

    def elapsed(self) -> float:
        """Seconds since start(), the stops left out."""
        return max(0.0, time.perf_counter() - self.began - self.stopped)
