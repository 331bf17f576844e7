"""The synthetic corpus: four request types whose continuations differ in predictability.

Pure Python and seeded (``random.Random``), so the project's tests check it and
the engine environment trains on it without sharing anything but this module.

* ``extract`` — a record of fields in random order, with distractor fields;
  the answer is a fixed JSON template (fixed keys, fixed order) whose values
  are copied from the record. The record spells each pair as the template
  does (``"key":"value"``), so a key and its value are the same tokens in
  both: the target can learn to copy within minutes, and prompt look-up
  (n-gram) speculation finds the whole value once the key is written.
* ``classify`` — a sentence; the answer is one label decided by a cue word.
* ``chat`` — a sentence; the answer is a few sentences of a Zipf grammar.
* ``creative`` — a few seed syllables; the answer is near-random syllables
  that no drafter can predict.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

ROUTES = ("extract", "classify", "chat", "creative")

# The conversation format, shared by training and the chat template vLLM applies.
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
END = "<|end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (PAD, END, USER, ASSISTANT, SYSTEM)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
SYLLABLES = tuple(c + v for c in CONSONANTS for v in VOWELS)

TEMPLATE_FIELDS = ("name", "city", "street", "phone", "item", "note")
DISTRACTOR_FIELDS = ("id", "date", "ref")
LABELS = ("positive", "negative", "question", "neutral")


@dataclass(frozen=True)
class Example:
    route: str
    prompt: str
    completion: str

    def text(self) -> str:
        """The training text: exactly what the chat template renders, then the answer and the end token."""
        return f"{USER}{self.prompt}\n{ASSISTANT}{self.completion}{END}"


class Lexicon:
    """Word lists drawn once from the seed: the same seed gives the same language."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)  # noqa: S311 - data, not secrets

        def words(n: int, lo: int, hi: int) -> list[str]:
            out: set[str] = set()
            while len(out) < n:
                out.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(lo, hi))))
            return sorted(out)

        self.names = words(120, 2, 3)
        self.places = words(60, 2, 3)
        self.things = words(80, 2, 2)
        self.nouns = words(60, 1, 2)
        self.verbs = words(40, 1, 2)
        self.adjectives = words(40, 2, 2)
        self.cues = {label: words(6, 2, 2) for label in LABELS}
        self.street_kinds = ["road", "lane", "way", "hill"]
        self.determiners = ["the", "a", "this", "my", "our"]
        self.connectives = ["and", "but", "so", "then"]


def _zipf_choice(rng: random.Random, items: list[str], s: float = 1.1) -> str:
    weights = [1.0 / (rank + 1) ** s for rank in range(len(items))]
    return rng.choices(items, weights=weights, k=1)[0]


def _sentence(rng: random.Random, lex: Lexicon) -> str:
    subject = f"{_zipf_choice(rng, lex.determiners)} {_zipf_choice(rng, lex.nouns)}"
    if rng.random() < 0.4:
        subject = f"{_zipf_choice(rng, lex.determiners)} {_zipf_choice(rng, lex.adjectives)} " \
                  f"{_zipf_choice(rng, lex.nouns)}"
    obj = f"{_zipf_choice(rng, lex.determiners)} {_zipf_choice(rng, lex.nouns)}"
    clause = f"{subject} {_zipf_choice(rng, lex.verbs)}s {obj}"
    if rng.random() < 0.3:
        clause += f" {_zipf_choice(rng, lex.connectives)} {_zipf_choice(rng, lex.verbs)}s " \
                  f"{_zipf_choice(rng, lex.determiners)} {_zipf_choice(rng, lex.nouns)}"
    return clause[0].upper() + clause[1:] + "."


def _record(rng: random.Random, lex: Lexicon) -> dict[str, str]:
    return {
        "name": f"{rng.choice(lex.names)} {rng.choice(lex.names)}",
        "city": rng.choice(lex.places),
        "street": f"{rng.randint(1, 99)} {rng.choice(lex.places)} {rng.choice(lex.street_kinds)}",
        "phone": f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}",
        "item": f"{rng.choice(lex.adjectives)} {rng.choice(lex.things)}",
        "note": " ".join(rng.choice(lex.nouns + lex.verbs) for _ in range(rng.randint(2, 4))),
    }


def extract(rng: random.Random, lex: Lexicon) -> Example:
    record = _record(rng, lex)
    fields = list(record.items())
    for key in rng.sample(DISTRACTOR_FIELDS, rng.randint(0, 2)):
        fields.append((key, f"{rng.choice(lex.things)}{rng.randint(1, 99)}"))
    rng.shuffle(fields)
    prompt = "extract: {" + ",".join(json.dumps(k) + ":" + json.dumps(v) for k, v in fields) + "}"
    completion = json.dumps({k: record[k] for k in TEMPLATE_FIELDS}, separators=(",", ":"))
    return Example("extract", prompt, completion)


def classify(rng: random.Random, lex: Lexicon) -> Example:
    label = rng.choice(LABELS)
    words = _sentence(rng, lex).rstrip(".").split()
    words.insert(rng.randint(1, len(words)), rng.choice(lex.cues[label]))
    return Example("classify", "classify: " + " ".join(words) + ".", label)


def chat(rng: random.Random, lex: Lexicon) -> Example:
    prompt = "chat: " + _sentence(rng, lex)
    completion = " ".join(_sentence(rng, lex) for _ in range(rng.randint(3, 5)))
    return Example("chat", prompt, completion)


def creative(rng: random.Random, lex: Lexicon) -> Example:
    def word() -> str:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))

    prompt = "write: " + " ".join(word() for _ in range(3))
    completion = " ".join(word() for _ in range(rng.randint(18, 26)))
    return Example("creative", prompt, completion)


GENERATORS = {"extract": extract, "classify": classify, "chat": chat, "creative": creative}


def generate(seed: int, n: int, mix: dict[str, float]) -> list[Example]:
    """``n`` examples, routes drawn by ``mix`` weights; the same arguments always give the same list."""
    lex = Lexicon(seed)
    rng = random.Random(seed + 1)  # noqa: S311
    routes = sorted(mix)
    weights = [mix[r] for r in routes]
    return [GENERATORS[rng.choices(routes, weights=weights, k=1)[0]](rng, lex) for _ in range(n)]


def requests(route: str, n: int, seed: int) -> list[Example]:
    """Held-out requests of one route (a different stream than training, the same language)."""
    lex = Lexicon(seed)
    rng = random.Random(seed + 1_000_003 + ROUTES.index(route))  # noqa: S311
    return [GENERATORS[route](rng, lex) for _ in range(n)]
