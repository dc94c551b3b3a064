"""A progress line for waits longer than two seconds (profiling, the comm sweep, the search).

Shown on rank 0 only, on stderr (like any progress bar), updated in place when stderr is a
terminal and every few seconds as a log line otherwise.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from ._log import logger

SHOW_AFTER_S = 2.0


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
        last_log = 0.0
        while not done.wait(0.25 if tty else 1.0):
            elapsed = time.monotonic() - t0
            if tty:
                sys.stderr.write(f"\rautodist: {label} {frames[i % 4]} {elapsed:4.0f} s")
                sys.stderr.flush()
                i += 1
            elif elapsed - last_log >= 5.0:
                logger.info("autodist: %s ... %.0f s", label, elapsed)
                last_log = elapsed
        if tty:
            sys.stderr.write(f"\rautodist: {label} done in {time.monotonic() - t0:.1f} s\n")
            sys.stderr.flush()

    th = threading.Thread(target=run, daemon=True, name="autodist-progress")
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join(timeout=1.0)
