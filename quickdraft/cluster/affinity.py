"""Which replica a prompt goes to: the one holding the longest cached prefix of it, within a slack
of the shortest queue, so a conversation returns to the replica that has its history while one
hot prefix cannot pile every request on one replica (SGLang's and vLLM's routers balance the same
way, with thresholds on the queues).

What the router believes a replica holds: the digests (digests.py) it last advertised, and those of
the prompts routed to it since, for `horizon_s` (a reply's prompt is cached as soon as its prefill
ends, well before the next summary; afterwards the replica's own word is the truth, evictions
included). Pure: knows digests and queue lengths, nothing of Ray.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLACK = 4  # requests a replica's queue may exceed the shortest by and still win on its prefix
# A replica's match counts only where it covers this share of the prompt's blocks (SGLang's router
# has such a threshold), or where it continues a prompt routed there (below): a chat template's
# system prompt is one or two blocks of every prompt, and at 0.3 a short first question's prompt
# (3 blocks, 1 of them the system prompt) still followed another session's to its replica, which
# then took both sessions' every turn (2 sessions x 6 turns: 12 requests to one replica, 0 to the
# other).
MATCH_SHARE = 0.5
ENDS = 4096  # prompt ends remembered per replica (continues): a conversation's next turn may come
             # minutes later, when its blocks are known only from the replica's summary


@dataclass(frozen=True)
class Candidate:
    name: str
    load: int               # requests running or queued there
    matched: int            # leading blocks of the prompt it holds
    continues: bool = False  # the prompt begins with every block of a prompt routed there, and the
                            # replica holds them: the same conversation's next turn, whose history is
                            # there (its answer too, which the router cannot know of until the
                            # replica's next summary)


def rank(candidates: Sequence[Candidate], slack: int = SLACK, turn: int = 0, blocks: int = 0,
         share: float = MATCH_SHARE) -> list[list[str]]:
    """Names, most preferred first, one per rank: the longest match (of at least `share` of the
    prompt's `blocks`, or continuing a prompt routed there) among those within `slack` of the shortest queue (ties: the shorter queue,
    then in turn, so that idle replicas alternate), then the rest by queue."""
    assert candidates, "no replica to rank"
    least = min(c.load for c in candidates)
    near = [c for c in candidates if c.load <= least + slack]
    start = turn % len(near)
    held = lambda c: c.matched if c.continues or c.matched >= share * blocks else 0  # noqa: E731
    best = max(near[start:] + near[:start], key=lambda c: (held(c), -c.load))  # max keeps the first of ties
    rest = sorted((c for c in candidates if c is not best), key=lambda c: (c.load, -c.matched))
    return [[best.name], *([c.name] for c in rest)]


class PrefixMap:
    """Each replica's cached prefixes as the router knows them."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._advertised: dict[str, frozenset[int]] = {}
        self._sent: dict[str, OrderedDict[int, float]] = {}  # digest -> when routed there, oldest first
        self._ends: dict[str, OrderedDict[int, None]] = {}  # the last digest of each prompt routed there

    def advertise(self, replica: str, digests: Sequence[int]) -> None:
        self._advertised[replica] = frozenset(digests)

    def routed(self, replica: str, digests: Sequence[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        sent, ends = self._sent.setdefault(replica, OrderedDict()), self._ends.setdefault(replica, OrderedDict())
        for digest in digests:
            _note(sent, digest, now)
        while sent and next(iter(sent.values())) < now - self.horizon_s:
            sent.popitem(last=False)
        if digests:
            _note(ends, digests[-1], None)
            while len(ends) > ENDS:
                ends.popitem(last=False)

    def matched(self, replica: str, digests: Sequence[int], now: float | None = None) -> int:
        """Leading blocks of `digests` the replica is believed to hold."""
        now = time.monotonic() if now is None else now
        held = self._advertised.get(replica, frozenset())
        sent = self._sent.get(replica, {})
        fresh = now - self.horizon_s
        for n, digest in enumerate(digests):
            if digest not in held and sent.get(digest, float("-inf")) < fresh:
                return n
        return len(digests)

    def continued(self, replica: str, held: Sequence[int]) -> bool:
        """Whether `held`, the leading digests of a prompt the replica holds (matched), end where a
        prompt routed there ended: the prompt begins with every block of that one (a digest names
        its whole prefix), a later turn of its conversation, whose history is there."""
        ends = self._ends.get(replica, {})
        return any(digest in ends for digest in held)

    def forget(self, replica: str) -> None:
        """A replica gone (died, restarted: its successor starts with an empty cache)."""
        self._advertised.pop(replica, None)
        self._sent.pop(replica, None)
        self._ends.pop(replica, None)

    def replicas(self) -> set[str]:
        return set(self._advertised) | set(self._sent)


def _note(seen: OrderedDict[int, Any], digest: int, value: Any) -> None:
    """Put digest last (the most recent) with `value`."""
    seen[digest] = value
    seen.move_to_end(digest)
