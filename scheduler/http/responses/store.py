"""The bounded in-memory store behind /v1/responses' previous_response_id: each stored response's
conversation (its input, without instructions, then its output as chat messages), least recently used dropped
first past --responses-store-size. A response is visible only to the token that made it (another token gets
the same 404 as for an unknown id); nothing survives a restart.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandem.errors import ResponseNotFound
from scheduler.http.request_schemas import ChatMessageIn
from tandem.security.tokens import Principal


@dataclass(frozen=True)
class Stored:
    conversation: tuple[ChatMessageIn, ...]
    owner: Principal | None  # None: no auth (--auth-token-file off)


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size  # responses kept; 0 = none
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, conversation: list[ChatMessageIn], owner: Principal | None) -> None:
        if self.size == 0:
            return
        self._items[response_id] = Stored(tuple(conversation), owner)
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def conversation(self, response_id: str, owner: Principal | None) -> list[ChatMessageIn]:
        """The stored conversation (and it becomes the most recently used); ResponseNotFound (404) otherwise."""
        found = self._items.get(response_id)
        if found is None or (found.owner is not None and found.owner != owner):
            raise ResponseNotFound(f"previous_response_id {response_id[:80]!r} is unknown: never stored (store: "
                                   f"false), or dropped (this server keeps the last {self.size} responses, "
                                   "--responses-store-size, in memory only); send the conversation as input items")
        self._items.move_to_end(response_id)
        return list(found.conversation)

    def __len__(self) -> int:
        return len(self._items)
