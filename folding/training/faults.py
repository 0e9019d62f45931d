"""Stop requests from signals: SIGTERM/SIGINT make the run save a checkpoint and exit cleanly.

A signal handler only sets a flag (:class:`StopRequest`); the train loop folds the flag into the
step's world all-reduce, so that every rank sees the request at the same step boundary (a signal
delivered to one rank stops all of them), then saves and returns. A second SIGINT while the save
runs is ignored (the save is atomic either way: an interrupted one is never loaded), and so is any
signal after the handlers are removed, once a stop was requested: the process exits with status 0.

Handlers can only be installed from the main thread; elsewhere :meth:`StopRequest.install` does
nothing and the run simply cannot be stopped by a signal.

Usage::

    stop = StopRequest()
    with stop.installed():
        for step in ...:
            ... flag = stop.requested ...
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Dict, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A flag set by SIGTERM/SIGINT while :meth:`installed` is active."""

    def __init__(self):
        """No handler is installed until :meth:`installed`."""
        self.requested = False
        self.signum = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        """Install the handlers for the duration of the ``with`` block (main thread only), then put
        the previous handlers back."""
        previous: Dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                previous[s] = signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, h in previous.items():
                # after a stop request the process is winding down: a repeated signal must not turn
                # the clean exit into a KeyboardInterrupt traceback or a death by signal
                signal.signal(s, signal.SIG_IGN if self.requested else h)
