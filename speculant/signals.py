"""Ctrl-C and SIGTERM while C code runs.

A Python exception raised inside a ctypes callback (llama.cpp's log and progress callbacks) is printed as
"Exception ignored ..." and lost, so a Ctrl-C during model loading used to vanish. Around such calls the
signal is only recorded (`received`; llama.cpp's progress callback then asks it to stop), and the signal's
own handler runs once the C call has returned: KeyboardInterrupt for Ctrl-C, as anywhere else."""

from __future__ import annotations

import signal
import threading
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class deferred_signals:
    """`with deferred_signals() as s:` record SIGINT/SIGTERM in `s.received`; act on them at the end of the
    block. A no-op off the main thread (only it receives signals)."""

    def __init__(self):
        self.received: Optional[int] = None
        self.previous: dict = {}

    def _record(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> "deferred_signals":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                if signal.getsignal(s) is not signal.SIG_IGN:  # an ignored signal stays ignored (`cmd &`, nohup)
                    self.previous[s] = signal.signal(s, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if self.received is not None:
            handler = self.previous.get(self.received)
            if callable(handler):
                handler(self.received, None)  # e.g. raises KeyboardInterrupt
            elif handler in (signal.SIG_DFL, None):
                signal.raise_signal(self.received)


def exit_on_sigterm():
    """SIGTERM raises SystemExit(143) in the main thread, so `finally` blocks and temporary directories
    are cleaned up as they are on Ctrl-C (the default action kills the process on the spot). Returns the
    previous handler (None off the main thread, where nothing changes)."""

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, terminate)
