"""The suite's fork server ("zygote"): one per pytest worker and server module, started by tests/server_forks.py.

It imports a server's modules once (`executor_service.__main__` costs ~3.5 CPU-seconds, almost all of it torch;
`scheduler.__main__` ~1.7 s) and then forks a child per request that runs `python -m MODULE ARGS` as a fresh
interpreter would, from `runpy` on: its own argv, environment, working directory, stdin/stdout/stderr (file
descriptors passed over the control socket), session. The suite starts ~250 servers; a fresh interpreter each
was about half of the suite's CPU time.

Why it is safe to fork here: this process runs no thread, opens no gRPC channel or server and runs no torch
operation (no OpenMP pool exists yet), so a child starts from a clean single-threaded state. Each child gets
SIGTERM when this process dies (PR_SET_PDEATHSIG), and this process exits when the pytest worker that started
it goes away, so nothing outlives a killed test run.

Protocol (SOCK_SEQPACKET, one message per packet): the client sends a JSON request (module, args, cwd, env,
own_session) with four descriptors [report socket, stdin, stdout, stderr]; on the report socket the zygote
answers {"pid": N} after the fork and {"rc": CODE, "cpu_s": S} once the child is reaped (CODE as subprocess's
returncode: negative for a signal; S the child's CPU seconds, user + system).

Each child gets its own control socket to the zygote, installed as its tandem/server_process spawner
(tests/server_forks.py's SiblingSpawner): what a server starts itself (a tensor-parallel rank 0 its workers,
executor_service/tp/launch.py) is forked here too, a sibling of the server rather than its child.

    python -m tests.server_fork_zygote CONTROL_FD MODULE [MODULE ...]   (the modules to import first)
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys

from tandem import server_process
from tests.server_forks import SiblingSpawner

_PR_SET_PDEATHSIG = 1
_MAX_FDS = 4


def _die_with(parent_pid: int) -> None:
    """SIGTERM to this (child) process when its parent, the zygote, dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _become_server(request: dict, fds: list[int], zygote_pid: int, to_close: list[socket.socket],
                   own_control: socket.socket) -> None:
    """In the child: take the requested stdio, cwd, environment and argv, install own_control (its line to the
    zygote) as server_process's spawner, then run the module as __main__. Returns only by an exception
    (SystemExit included), which ends this process as it would end a fresh one."""
    for s in to_close:
        s.close()
    _die_with(zygote_pid)
    server_process.use_spawner(SiblingSpawner(own_control, dict(os.environ)))  # (the zygote's environment)
    if request["own_session"]:
        os.setsid()
    for target, fd in zip((0, 1, 2), fds[1:]):
        os.dup2(fd, target)
    for fd in fds[1:]:  # (fds[0], the report socket, was closed with to_close)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS, not the zygote's
        sys.modules["numpy"].random.seed()
    sys.argv = [request["module"], *request["args"]]  # run_module sets argv[0] to the module's file
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report = children.pop(pid, None)
        if report is not None:
            try:
                report.send(json.dumps({"rc": os.waitstatus_to_exitcode(status),
                                        "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
            except OSError:
                pass  # the client went away: nobody waits for this code
            report.close()


def serve(control: socket.socket, parent_pid: int) -> None:
    children: dict[int, socket.socket] = {}
    child_controls: list[socket.socket] = []  # each child's line for starting its own servers (SiblingSpawner)
    zygote_pid = os.getpid()
    control.send(b"ready")
    while True:
        readable, _, _ = select.select([control, *child_controls], [], [], 0.1)
        _reap(children)
        if os.getppid() != parent_pid:
            return  # the pytest worker is gone: children get SIGTERM from their parent-death signal
        for source in readable:
            message, fds, _, _ = socket.recv_fds(source, 1 << 20, _MAX_FDS)
            if not message:
                if source is control:
                    return  # the client closed the control socket
                child_controls.remove(source)  # that child exited
                source.close()
                continue
            request = json.loads(message)
            report = socket.socket(fileno=fds[0])
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                _become_server(request, fds, zygote_pid,
                               [control, report, ours, *children.values(), *child_controls], theirs)
            theirs.close()
            child_controls.append(ours)
            for fd in fds[1:]:
                os.close(fd)
            report.send(json.dumps({"pid": pid}).encode())
            children[pid] = report


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[0]))
    parent_pid = os.getppid()
    for module in argv[1:]:
        importlib.import_module(module)
    serve(control, parent_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
