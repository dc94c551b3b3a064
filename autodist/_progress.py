"""A progress line for waits longer than two seconds (profiling, the comm sweep, the search).

Shown on rank 0 only, on stderr (like any progress bar), updated in place when stderr is a
terminal; otherwise as a few log lines: one when the wait has lasted two seconds, then at 30 s,
60 s, 120 s, ... (each interval twice the last, so a wait of minutes takes a handful of lines, not
one every few seconds), and one with the time it took.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from ._log import logger

SHOW_AFTER_S = 2.0
FIRST_LOG_S = 30.0


@contextlib.contextmanager
def progress(label: str, *, enabled: bool = True) -> Iterator[None]:
    if not enabled:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()
    tty = sys.stderr.isatty()

    def run() -> None:
        if done.wait(SHOW_AFTER_S):
            return
        frames = "|/-\\"
        i = 0
        next_log = FIRST_LOG_S
        if not tty:
            logger.info("autodist: %s ...", label)
        while not done.wait(0.25 if tty else 1.0):
            elapsed = time.monotonic() - t0
            if tty:
                sys.stderr.write(f"\rautodist: {label} {frames[i % 4]} {elapsed:4.0f} s")
                sys.stderr.flush()
                i += 1
            elif elapsed >= next_log:
                logger.info("autodist: %s ... %.0f s", label, elapsed)
                next_log *= 2
        if tty:
            sys.stderr.write(f"\rautodist: {label} done in {time.monotonic() - t0:.1f} s\n")
            sys.stderr.flush()
        else:
            logger.info("autodist: %s done in %.1f s", label, time.monotonic() - t0)

    th = threading.Thread(target=run, daemon=True, name="autodist-progress")
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=1.0)
