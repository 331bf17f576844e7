"""bench/shadow.py's comparison: what it counts as a difference, and where. Against a fake engine's /tokenize."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.shadow import compare
from sidecar.shadow import Answer
from tests.support.fake_upstream import FakeEngine
from tests.support.sidecars import LoopThread


@pytest.fixture
def base() -> Iterator[FakeEngine]:
    loop = LoopThread()
    engine = FakeEngine("base")
    loop.run(engine.start())
    yield engine
    loop.run(engine.stop())
    loop.close()


def test_compare_counts_differences_with_their_token_positions(base: FakeEngine) -> None:
    reference = [Answer("a b c", [], "stop"), Answer("d e f", [], "stop"), Answer("g h", [], "stop"), None]
    got = [Answer("a b c", [], "stop"), Answer("d e x", [], "stop"), Answer("g h", [], "length"),
           Answer("i", [], "stop")]
    cell = compare(base.url, got, reference)
    assert (cell["compared"], cell["differ"], cell["failed"]) == (3, 2, 1)
    assert cell["match_rate"] == round(1 / 3, 4)
    low, high = cell["match_rate_95"]
    assert 0 < low < 1 / 3 < high < 1
    # the fake tokenizer's tokens are words: "d e f" and "d e x" part at the third; "g h" (the same text, another
    # finish reason) has no differing token: its whole length
    assert cell["first_diff_tokens"] == [2, 2]
    assert base.tokenized == ["d e x", "d e f", "g h", "g h"]


def test_no_difference_still_has_an_interval(base: FakeEngine) -> None:
    answers = [Answer(f"t{i}", [], "stop") for i in range(20)]
    cell = compare(base.url, answers, list(answers))
    assert (cell["match_rate"], cell["differ"], cell["first_diff_tokens_p50"]) == (1.0, 0, None)
    low, high = cell["match_rate_95"]
    assert high == 1.0
    assert 0.8 < low < 0.9
    assert base.tokenized == []
