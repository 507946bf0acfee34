"""Fair share of the waiting queue: how many sequences one client may queue, so that a
flood from one sender fills at most its share and delays that sender, not everyone."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from scheduler.request import Request


class QueueFull(Exception):
    """The waiting queue, or the sender's share of it, is full; the caller should retry."""


def max_group(max_waiting: int) -> int:
    """The most sequences one client may ever hold in the queue: a larger request can
    never be queued (the API refuses it with a 400, not a 429 to retry)."""
    return max(1, max_waiting // 2)


def check_room(waiting: Collection[Request], max_waiting: int, client: str, k: int) -> None:
    """Raise `QueueFull` unless `client` may queue `k` more sequences beside `waiting`.

    A client (its API key, else its connection) may hold at most `max_waiting // (n + 1)`
    waiting sequences, n being the clients with sequences waiting, itself included. One
    client alone can use half the queue, and a client over its share adds nothing while
    others wait, so a flood fills at most its share and delays its sender. What a client
    took under a larger share is not taken back: several clients that each filled their
    share can still fill the queue between them (evicting the newest waiting request of
    the largest holder would close that).
    """
    total = len(waiting)
    if total + k > max_waiting:
        raise QueueFull(f"{total} sequences already waiting (at most {max_waiting})")
    held = Counter(r.client for r in waiting)
    share = max(1, max_waiting // (len(held | {client: 1}) + 1))
    if held[client] + k > share:
        raise QueueFull(
            f"this client has {held[client]} sequences waiting; its share of the queue "
            f"is {share} while {len(held)} clients wait"
        )
