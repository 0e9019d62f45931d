"""Stop requests from signals: SIGTERM/SIGINT make the run save a checkpoint and exit cleanly.

A signal handler only sets a flag (:class:`StopRequest`); the train loop folds the flag into the
step's world all-reduce, so that every rank sees the request at the same step boundary (a signal
delivered to one rank stops all of them), then saves and returns. A second SIGINT while the save
runs is ignored (the save is atomic either way: an interrupted one is never loaded), and so is any
signal after the handlers are removed, once a stop was requested: the process exits with status 0.

Handlers can only be installed from the main thread; elsewhere :meth:`StopRequest.install` does
nothing and the run simply cannot be stopped by a signal.

The launcher installs its request for the whole job, from before the model is built to after the
process groups are gone (a signal during start-up stops the run after its first step, with a
checkpoint); :func:`interrupt_exits_quietly` covers what comes before and after it in the entry point
(the command-line checks, Hydra's start and end): a Ctrl-C there ends the process with one line.

Usage::

    stop = StopRequest()
    with stop.installed():
        for step in ...:
            ... flag = stop.requested ...
"""

from __future__ import annotations

import contextlib
import signal
import sys
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


INTERRUPTED_STATUS = 130
"""Exit status after a Ctrl-C outside the job (128 + SIGINT, the shell's convention)."""


@contextlib.contextmanager
def interrupt_exits_quietly(stream=None) -> Iterator[None]:
    """A Ctrl-C (``KeyboardInterrupt``) that reaches this block ends the process with the line
    ``interrupted`` on ``stream`` (stderr) and exit status :data:`INTERRUPTED_STATUS` instead of a
    traceback; SIGINT is ignored from then on, so a second Ctrl-C cannot interrupt the exit."""
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("interrupted", file=stream or sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_STATUS) from None
