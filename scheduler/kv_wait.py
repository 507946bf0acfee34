"""How long KV kept each request out: the part of its queue time to blame on the pool, not
on the queue ahead of it (`FinishedStats.kv_wait_s`), so an operator can tell a pool that
is too small from a server that is merely busy."""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.request import Request


class KVWaitClock:
    def __init__(self) -> None:
        self._since: float | None = None  # the queue's head waits for KV since

    def note(self, req: Request, now: float) -> None:
        """A request leaves the queue: count the time KV kept it out."""
        since = self._since
        if since is not None:
            joined = req.arrival_time if req.queued_time is None else req.queued_time
            req.kv_wait_s += max(0.0, now - max(since, joined))

    def blocked(self, blocked: bool, waiting: Iterable[Request], now: float) -> None:
        """The queue's head was (or was no longer) kept out by KV: everyone queued behind
        it waits for KV too, so on the change each request's share is counted."""
        if blocked and self._since is None:
            self._since = now
        elif not blocked and self._since is not None:
            for req in waiting:
                self.note(req, now)
            self._since = None
