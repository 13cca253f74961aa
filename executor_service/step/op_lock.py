"""The executor's model lock: one operation at a time, control operations first.

Model calls (prefill, decode, ...) reach the lock one by one from the model thread, which keeps the others
queued (executor_service/model_thread.py); control operations that change state without running the model
(release, truncate, close a session, reap expired sessions, unload an adapter) come from RPC threads. A
plain Lock is not fair: the model thread, releasing it and taking it again for the next queued call, could
keep a waiting release out for as long as the queue lasts. Here a waiting control operation goes next, so
it waits for the one operation in progress, never for the queue behind it. Control operations are short,
so model calls cannot starve in turn.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class OpLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._control_waiting = 0
        self._model_waiting = 0

    def waiting(self) -> tuple[int, int]:
        """(control, model) operations waiting for the lock now."""
        with self._cond:
            return self._control_waiting, self._model_waiting

    @contextmanager
    def hold(self, control: bool = False) -> Iterator[None]:
        with self._cond:
            if control:
                self._control_waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._held)
                finally:
                    self._control_waiting -= 1
            else:
                self._model_waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._held and not self._control_waiting)
                finally:
                    self._model_waiting -= 1
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()
