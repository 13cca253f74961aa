"""The control channel of a tensor-parallel executor: before every model op rank 0 broadcasts a small
step descriptor (`Step`, pickled, over a gloo group) and every rank then runs that op on its shard, so the
ranks' KV pools stay in lockstep without any state of their own: rank 0 alone allocates blocks, keeps the
prefix cache, sessions and leases; a step carries the block ids it writes.

Failure rule: the group is all or nothing. On rank 0, any error inside a model op (a collective that failed
because a rank died, timed out, or anything else once the workers were told to run) is fatal: it is logged
and the process exits with EXIT_GROUP_DOWN (a half-run op leaves the ranks out of step; the scheduler
recomputes the executor's requests elsewhere, as for any lost executor). Every collective is bounded by the
group's timeout (init_process_group(timeout=...)); while rank 0 is idle a heartbeat (a ping and a one-element
all_reduce) keeps the workers' waits inside that bound and finds a dead worker on another machine.
"""
from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from models.attention.paged import ItemLayout

log = logging.getLogger("tandem.executor.tp")
EXIT_GROUP_DOWN = 3  # the exit code of a rank whose group went down


@dataclass(frozen=True)
class Step:
    """One op for every rank. op: forward | hidden | project | ping | stop."""

    op: str
    ids: tuple[int, ...] = ()  # forward/hidden: the packed token ids
    items: tuple[ItemLayout, ...] = ()  # forward/hidden: per item its blocks, cached length, new tokens
    rows: tuple[int, ...] | None = None  # forward/hidden: the rows wanted (None: all)
    copies: tuple[tuple[int, int], ...] = ()  # KV blocks to copy (source, destination) first: copy-on-write
    shape: tuple[int, ...] = ()  # project: the shape of the hidden states broadcast right after
    dtype: str = ""  # project: their dtype ("float32", ...)


def _brief(exc: BaseException) -> str:
    """The first line of an error, short (gloo's errors run to several lines)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}"


AT_FATAL: list[Callable[[], None]] = []  # quick cleanups `fatal` runs first (rank 0's rendezvous directory)


def fatal(message: str) -> None:
    """Ends this rank at once: its group is down (the other ranks end on their failed collectives)."""
    log.error("tensor parallelism: %s; exiting with code %d", message, EXIT_GROUP_DOWN)
    for cleanup in AT_FATAL:
        try:
            cleanup()
        except Exception:  # noqa: BLE001  (exiting anyway)
            pass
    logging.shutdown()
    os._exit(EXIT_GROUP_DOWN)


class ControlChannel:
    """rank 0 sends (`op`, `ping`, `stop`), the workers receive (`recv`). data: the group the model's
    collectives run on (its tensors are broadcast there too); control: a gloo group for the descriptors."""

    def __init__(self, rank: int, size: int, control: dist.ProcessGroup, data: dist.ProcessGroup | None,
                 device: torch.device, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        self.control, self.data, self.device = control, data, device
        self.heartbeat_s = max(0.5, min(10.0, timeout_s / 4))
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = False
        # Names what took the group down when a collective fails (rank 0: a local worker that exited); None: unknown
        self.why_down: Callable[[], str | None] = lambda: None

    # ------------------------------------------------------------- rank 0
    @contextmanager
    def op(self, step: Step) -> Iterator[None]:
        """Tells the workers to run `step`, then runs the body (rank 0's share of it); any error is fatal."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the tensor-parallel group was stopped")
            try:
                self._send(step)
                yield
            except BaseException as exc:  # noqa: BLE001  (the group is out of step: nothing can be undone)
                fatal(self.why_down() or f"a model op failed on rank 0 ({_brief(exc)}): the group is down")
            self._last = time.monotonic()

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Inside `op` (rank 0) or after `recv` (workers): the tensor of the step, from rank 0 to all."""
        dist.broadcast(tensor, src=0, group=self.data)

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """Tells the workers to exit (rank 0's clean shutdown); a failure here is only logged."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                self._send(Step("stop"))
            except Exception as exc:  # noqa: BLE001  (a worker already gone: nothing left to tell)
                log.warning("tensor parallelism: could not tell the workers to stop: %s", exc)

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.heartbeat_s / 2)
            with self._lock:
                if self._stopped:
                    return
                if time.monotonic() - self._last < self.heartbeat_s:
                    continue
                try:
                    self._send(Step("ping"))
                    self.pong()
                except Exception as exc:  # noqa: BLE001
                    fatal(self.why_down()
                          or f"a worker did not answer the heartbeat ({_brief(exc)}): the group is down")
                self._last = time.monotonic()

    def _send(self, step: Step) -> None:
        dist.broadcast_object_list([step], src=0, group=self.control)

    # ------------------------------------------------------------- both sides
    def pong(self) -> None:
        """The heartbeat's answer: a one-element all_reduce every rank joins (a dead rank fails it)."""
        dist.all_reduce(torch.ones(1), group=self.control)

    def recv(self) -> Step:
        """Workers: the next step (waits at most the group's timeout; rank 0 pings while idle)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        step = box[0]
        if not isinstance(step, Step):
            raise pickle.UnpicklingError(f"expected a Step from rank 0, got {type(step).__name__}")
        return step
