"""The scheduling policy as an object: the waiting queue and the order of service.

vLLM's shape (`SchedulingPolicy`, a `RequestQueue` base, `create_request_queue`). The
scheduler asks the queue, it does not branch on the policy: which waiting sequence is
admitted next (`peek` / `pop`), where preempted sequences go back (`prepend`), and the sort
key (`key`) that orders everything else the scheduler orders, the running batch (smaller
first) and its choice of what to preempt (the largest first).

- FCFS: by arrival time, then the order the requests came in.
- PRIORITY: by the request's `priority` (smaller first, vLLM's convention), then as FCFS.

Host-only: no JAX.
"""
from __future__ import annotations

import abc
import bisect
import enum
from collections import deque
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from paxkv.engine.sequence import Sequence

Key = tuple


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(abc.ABC):
    """Waiting sequences in the order they are to be admitted."""

    @staticmethod
    @abc.abstractmethod
    def key(seq: "Sequence", order: int) -> Key:
        """The sort key of `seq` (smaller: served first, preempted last); `order` is its
        request's admission order, which breaks ties of arrival time."""

    @abc.abstractmethod
    def add(self, seq: "Sequence", key: Key) -> None:
        """A new sequence, its key from `key`."""

    @abc.abstractmethod
    def prepend(self, seqs: Iterable["Sequence"], keys: Iterable[Key]) -> None:
        """Preempted sequences coming back: ahead of the sequences that arrived after them."""

    @abc.abstractmethod
    def peek(self) -> "Sequence":
        """The sequence to admit next (the queue is not empty)."""

    @abc.abstractmethod
    def pop(self) -> "Sequence":
        """Remove and return `peek()`."""

    @abc.abstractmethod
    def remove(self, seq: "Sequence") -> bool:
        """Remove `seq` if it waits here; whether it did."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator["Sequence"]:
        """The waiting sequences, in admission order."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque; preempted sequences go back to its front."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    @staticmethod
    def key(seq: "Sequence", order: int) -> Key:
        return (seq.arrival_time, order, seq.seq_id)

    def add(self, seq: "Sequence", key: Key) -> None:
        self._queue.append(seq)

    def prepend(self, seqs: Iterable["Sequence"], keys: Iterable[Key]) -> None:
        self._queue.extendleft(reversed(list(seqs)))

    def peek(self) -> "Sequence":
        return self._queue[0]

    def pop(self) -> "Sequence":
        return self._queue.popleft()

    def remove(self, seq: "Sequence") -> bool:
        try:
            self._queue.remove(seq)   # Sequence compares by identity
        except ValueError:
            return False
        return True

    def __iter__(self) -> Iterator["Sequence"]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityRequestQueue(RequestQueue):
    """By the requests' `priority` (smaller first), then first come, first served: a list
    kept sorted by key (waiting queues hold thousands of sequences, not millions)."""

    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._seqs: list[Sequence] = []

    @staticmethod
    def key(seq: "Sequence", order: int) -> Key:
        return (seq.priority, seq.arrival_time, order, seq.seq_id)

    def add(self, seq: "Sequence", key: Key) -> None:
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._seqs.insert(i, seq)

    def prepend(self, seqs: Iterable["Sequence"], keys: Iterable[Key]) -> None:
        for seq, key in zip(seqs, keys):   # their keys put them where they belong
            self.add(seq, key)

    def peek(self) -> "Sequence":
        return self._seqs[0]

    def pop(self) -> "Sequence":
        self._keys.pop(0)
        return self._seqs.pop(0)

    def remove(self, seq: "Sequence") -> bool:
        for i, s in enumerate(self._seqs):
            if s is seq:
                del self._keys[i], self._seqs[i]
                return True
        return False

    def __iter__(self) -> Iterator["Sequence"]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The waiting queue of `policy` ("fcfs" or "priority")."""
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        raise ValueError(f"scheduling_policy must be one of "
                         f"{[p.value for p in SchedulingPolicy]}, got {policy!r}") from None
    return FCFSRequestQueue() if policy is SchedulingPolicy.FCFS else PriorityRequestQueue()
