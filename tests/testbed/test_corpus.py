"""The synthetic corpus: seeded, well-formed, and built so that copying is what extract asks for."""

from __future__ import annotations

import json
import re

import pytest

from testbed import corpus

MIX = {"extract": 0.4, "classify": 0.2, "chat": 0.2, "creative": 0.2}


def test_same_seed_same_corpus() -> None:
    assert corpus.generate(11, 300, MIX) == corpus.generate(11, 300, MIX)


def test_other_seed_other_corpus() -> None:
    assert corpus.generate(11, 50, MIX) != corpus.generate(12, 50, MIX)


def test_mix_is_respected() -> None:
    examples = corpus.generate(3, 2000, MIX)
    share = sum(ex.route == "extract" for ex in examples) / len(examples)
    assert 0.35 < share < 0.45
    assert {ex.route for ex in examples} == set(corpus.ROUTES)


def test_held_out_requests_are_deterministic_and_not_the_training_stream() -> None:
    for route in corpus.ROUTES:
        assert corpus.requests(route, 20, 5) == corpus.requests(route, 20, 5)
        assert all(ex.route == route for ex in corpus.requests(route, 20, 5))
    train_prompts = {ex.prompt for ex in corpus.generate(5, 2000, MIX)}
    assert not train_prompts & {ex.prompt for ex in corpus.requests("extract", 50, 5)}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_extract_copies_prompt_values_into_a_fixed_template(seed: int) -> None:
    for ex in corpus.requests("extract", 50, seed):
        record = json.loads(ex.completion)
        assert list(record) == list(corpus.TEMPLATE_FIELDS)
        fields = json.loads(ex.prompt.removeprefix("extract: "))
        for key, value in record.items():
            assert fields[key] == value
        assert set(fields) - set(record) <= set(corpus.DISTRACTOR_FIELDS)


def test_other_routes_have_their_shapes() -> None:
    assert all(ex.completion in corpus.LABELS for ex in corpus.requests("classify", 50, 1))
    for ex in corpus.requests("chat", 20, 1):
        assert re.fullmatch(r"([A-Z][a-z ]+\. ?)+", ex.completion)
    for ex in corpus.requests("creative", 20, 1):
        words = ex.completion.split()
        assert len(words) >= 18
        assert all(re.fullmatch(r"([bdfgklmnprstvz][aeiou])+", w) for w in words)


def test_training_text_is_what_the_chat_template_renders() -> None:
    import jinja2
    ex = corpus.requests("chat", 1, 1)[0]
    rendered = jinja2.Template(corpus.CHAT_TEMPLATE).render(
        messages=[{"role": "user", "content": ex.prompt}], add_generation_prompt=True)
    assert ex.text() == rendered + ex.completion + corpus.END


def test_the_classify_label_has_a_cue() -> None:
    lex = corpus.Lexicon(1)
    for ex in corpus.requests("classify", 50, 1):
        words = set(ex.prompt.removeprefix("classify: ").rstrip(".").split())
        assert words & set(lex.cues[ex.completion])
