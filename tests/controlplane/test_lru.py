"""The shared LRU: recency order, eviction at capacity, and many threads at once."""

from __future__ import annotations

import threading

import pytest

from controlplane.lru import LRU


def test_a_full_cache_drops_the_least_recently_used_entry() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent: "b" goes first
    cache.put("c", 3)
    assert "b" not in cache
    assert (cache.get("a"), cache.get("c"), len(cache)) == (1, 3, 2)


def test_writing_a_key_again_replaces_its_value_and_makes_it_recent() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.put("a", 10) == 10
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (10, None, 3)


def test_a_look_with_in_does_not_count_as_a_use() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert "a" in cache
    cache.put("c", 3)
    assert "a" not in cache
    assert "b" in cache


def test_clear_empties_it() -> None:
    cache: LRU[int, str] = LRU(4)
    for i in range(3):
        cache.put(i, str(i))
    cache.clear()
    assert len(cache) == 0
    assert cache.get(0) is None


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LRU(0)


def test_threads_sharing_it_never_push_it_past_capacity() -> None:
    cache: LRU[int, int] = LRU(50)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def hammer(offset: int) -> None:
        try:
            start.wait()
            for i in range(2000):
                key = (offset * 7 + i) % 200
                cache.put(key, key)
                got = cache.get((key + 3) % 200)
                assert got is None or got == (key + 3) % 200
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(cache) == 50


def test_a_weighed_lru_drops_the_least_recent_past_its_weight_but_keeps_the_newest() -> None:
    cache: LRU[str, bytes] = LRU(100, weigh=len, max_weight=10)
    cache.put("a", b"xxxx")
    cache.put("b", b"xxxx")
    assert cache.get("a") == b"xxxx"  # a is now the most recent
    cache.put("c", b"xxxx")  # 12 > 10: the least recent (b) goes
    assert "b" not in cache
    assert "a" in cache
    assert "c" in cache
    assert cache.weight == 8
    cache.put("a", b"x")  # replacing re-weighs
    assert cache.weight == 5
    cache.put("huge", b"x" * 50)  # alone over the bound: everything older goes, the newest stays
    assert len(cache) == 1
    assert cache.get("huge") == b"x" * 50
    assert cache.weight == 50
    cache.clear()
    assert cache.weight == 0


def test_a_weighed_lru_needs_a_weight_bound() -> None:
    with pytest.raises(ValueError, match="max_weight"):
        LRU(10, weigh=len)
