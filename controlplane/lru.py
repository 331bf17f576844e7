"""A small least-recently-used cache that the request threads of the threadpool may share."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``capacity`` entries (and, with ``weigh``, at most ``max_weight`` of their total weight);
    a read or a write makes an entry the most recent, a write past a bound drops the least recent ones.
    Values are never None (``get`` answers None for a miss)."""

    def __init__(self, capacity: int, *, weigh: Callable[[V], int] | None = None, max_weight: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU needs a capacity of at least 1, got {capacity}")
        if weigh is not None and max_weight < 1:
            raise ValueError(f"a weighed LRU needs a max_weight of at least 1, got {max_weight}")
        self.capacity = capacity
        self._weigh = weigh
        self.max_weight = max_weight
        self.weight = 0
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> V:
        """Store ``value`` and return it, so that a caller can compute, store and return in one line."""
        weigh = self._weigh
        with self._lock:
            if weigh is not None:
                old = self._items.get(key)
                self.weight += weigh(value) - (weigh(old) if old is not None else 0)
            self._items[key] = value
            self._items.move_to_end(key)
            # The newest entry stays even when it alone outweighs the bound: the caller is about to use it.
            while len(self._items) > self.capacity or (weigh is not None and self.weight > self.max_weight
                                                        and len(self._items) > 1):
                _, dropped = self._items.popitem(last=False)
                if weigh is not None:
                    self.weight -= weigh(dropped)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.weight = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __contains__(self, key: object) -> bool:
        # Membership does not count as a use: it would reorder the cache on a mere look.
        with self._lock:
            return key in self._items
