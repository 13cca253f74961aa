"""Which token scope each ExecutorService RPC needs (README: Security has the table). Cache and session ids
are unguessable (uuid4) and a session reaches only its own caches, so the user scope covers the calls a
client makes on its own work; admin is what changes the server for everyone (adapters) or reaches across
sessions (every session's caches and their ids; the stream of every session's cached blocks) or makes the
executor connect out (ImportKv)."""
from __future__ import annotations

from typing import Any

from tandem.executor.v1 import executor_pb2
from tandem.security.tokens import Scope

_SERVICE = "/" + executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name + "/"
# ImportKv: the executor connects out, with its peer token, to an address the caller names.
ADMIN_METHODS = frozenset({"LoadAdapter", "UnloadAdapter", "SubscribeKvEvents", "ImportKv"})


def scope_of(method: str, request: Any) -> Scope:
    """The scope `method` needs for `request` (None for a client stream: reflection). ListCaches needs admin
    unless it names one session (without one it lists every session, ids included)."""
    if not method.startswith(_SERVICE):
        return Scope.USER  # reflection (and health, when --auth-health)
    name = method[len(_SERVICE):]
    if name in ADMIN_METHODS:
        return Scope.ADMIN
    if name == "ListCaches" and not getattr(request, "session_id", ""):
        return Scope.ADMIN
    return Scope.USER
