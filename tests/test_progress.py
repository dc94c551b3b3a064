"""The progress of a long wait, as log lines when stderr is not a terminal: one when it starts,
a few more at doubling intervals, one with the time it took (issue 42: the first run printed a
line every 5 s, 30 for a 146 s comm sweep). Threads are ordered by events, not sleeps."""

import logging
import threading

from autodist import _progress


class _Lines(logging.Handler):
    def __init__(self, want: int) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.want = want
        self.enough = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if len(self.lines) >= self.want:
            self.enough.set()


def test_a_long_wait_logs_a_start_a_few_progress_lines_and_its_duration(monkeypatch):
    monkeypatch.setattr(_progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(_progress, "FIRST_LOG_S", 0.5)  # then 1 s, 2 s, ...: checked once a second
    monkeypatch.setattr(_progress.sys.stderr, "isatty", lambda: False, raising=False)
    log = logging.getLogger("autodist")
    handler = _Lines(want=3)
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        with _progress.progress("measuring something"):
            assert handler.enough.wait(60), handler.lines  # the start and two progress lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    start, first, second, *rest = handler.lines
    assert start == "autodist: measuring something ..."
    assert first.startswith("autodist: measuring something ... ") and first.endswith(" s")
    # the second line comes only after twice the first interval
    assert float(second.split("... ")[1][:-2]) >= 2 * float(first.split("... ")[1][:-2]) - 1
    assert len(rest) == 1 and rest[0].startswith("autodist: measuring something done in ")
