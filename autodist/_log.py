"""The ``autodist`` logger, :func:`announce` and a per-object ``warn_once``.

Library code never prints; everything goes through ``logging.getLogger("autodist")``. Messages that
matter only once per model (an order deviation, an unused parameter) go through :class:`OnceLogger`,
which remembers what it said on the instance that owns it — no process-global registry.

[Note: what a script that configures no logging shows] Warnings reach stderr without any
configuration (Python's ``logging.lastResort``), as torch's own distributed warnings do; INFO records
do not. The few INFO lines a user must see to know what AutoDist did (the plan in force and the plan
chosen, with a kept built-in plan and why; the safe plan run while profiling; the step lines
``log_every`` asks for) go through :func:`announce`, which shows them the same way when logging is
not configured at all, and otherwise leaves them to the configuration: a ``logging.basicConfig`` or
a handler of the user's decides (once, through their handler), and
``logging.getLogger("autodist").setLevel(logging.WARNING)`` silences them.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("autodist")


def announce(msg: str, *args: object) -> None:
    """Log ``msg`` at INFO so that it is seen even where logging is not configured (see [Note: what a
    script that configures no logging shows]); where it is configured, exactly as ``logger.info``."""
    if logger.manager.disable >= logging.INFO:
        return
    configured = logger.level != logging.NOTSET or logger.hasHandlers()
    if configured:
        if logger.hasHandlers() or not logger.isEnabledFor(logging.INFO):
            logger.info(msg, *args)
            return
    # no handler anywhere: show it as Python shows an unconfigured warning (its last-resort handler,
    # stderr, the message alone), unless the user removed that handler
    if logging.lastResort is not None:
        logging.lastResort.handle(logger.makeRecord(logger.name, logging.INFO, "(autodist)", 0, msg, args, None))


class OnceLogger:
    """Logs each distinct key at most once for the lifetime of this object."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._said: set[str] = set()

    def warning(self, key: str, msg: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            self._log.warning(msg, *args)

    def info(self, key: str, msg: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            self._log.info(msg, *args)
