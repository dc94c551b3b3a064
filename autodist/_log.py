"""The ``autodist`` logger and a per-object ``warn_once``.

Library code never prints; everything goes through ``logging.getLogger("autodist")``. Messages that
matter only once per model (an order deviation, an unused parameter) go through :class:`OnceLogger`,
which remembers what it said on the instance that owns it — no process-global registry.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("autodist")


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
