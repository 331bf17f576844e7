"""The pure parts of training (no torch here): packing and the n-gram proposer the evaluation imitates."""

from __future__ import annotations

from testbed.train import lr_at, pack, prompt_lookup


def test_pack_keeps_examples_whole_and_masks_padding() -> None:
    examples = [([1, 2, 3], [-100, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [-100, -100, 8, 9]),
                ([0] * 9, [0] * 9)]
    rows, labels = pack(examples, 6, pad_id=99)
    assert rows == [[1, 2, 3, 4, 5, 99], [6, 7, 8, 9, 99, 99]]
    assert labels == [[-100, 2, 3, 4, 5, -100], [-100, -100, 8, 9, -100, -100]]


def test_prompt_lookup_prefers_the_longest_then_the_earliest_match() -> None:
    # suffix [2, 3] occurs at 1 and 5; the 3-gram [9, 2, 3] only at 4: the longest wins
    tokens = [1, 2, 3, 4, 9, 2, 3, 7, 8, 9, 2, 3]
    assert prompt_lookup(tokens, 2, 3, 1) == [7, 8]
    # only 1-grams match: the earliest occurrence proposes
    assert prompt_lookup([5, 6, 5, 7, 5], 3, 3, 1) == [6, 5, 7]
    assert prompt_lookup([1, 2, 3], 4, 3, 1) == []
    # the proposal stops at the end of the context
    assert prompt_lookup([1, 2, 1], 4, 3, 1) == [2, 1]


def test_learning_rate_warms_up_and_decays() -> None:
    assert lr_at(0, 100, 10, 1.0) == 0.1
    assert lr_at(9, 100, 10, 1.0) == 1.0
    assert abs(lr_at(99, 100, 10, 1.0) - 0.1) < 0.01
