"""``specgate loadgen``: traffic for a sidecar, or for any OpenAI-compatible server.

A closed-loop load generator: during each stage of a concurrency schedule
(``1:30s,4:30s,16:30s``) exactly that many workers each send a request, wait
for the whole answer, and send the next. Every request draws, from the seeded
randomness of its own index, a route (weights over routes), a prompt in the
style of that route, whether it asks for structured output
(``response_format: json_schema``) and whether it streams (with
``stream_options.include_usage``). The route travels as the
``X-Specgate-Route`` header and as ``metadata.route``, so a sidecar classifies
it whichever it reads; each request gets a unique ``X-Request-Id``.

The report tallies requests, errors by kind, p50/p95 latency per route and the
share of requests the sidecar sent to a speculative engine, read from its
``X-Specgate-Decision`` response header (an engine not named in
``plain_engines`` counts as speculative). When the server returns vLLM's
per-request ``metrics.speculative_decoding`` (a vLLM server addressed
directly, or a sidecar that exposes them) the acceptance rate per route is
reported too.

The module splits into a pure core (parsing and validating options into a
:class:`LoadPlan`, :func:`build_request`, :func:`summarize`, the prompt
generators), which the tests exercise without a network, and the asyncio
runner :func:`run_load` (aiohttp).

From Python: ``plan = build_plan(url=..., schedule="1:30s,4:30s")``
then ``summary = await run_load(plan, stop=event, on_progress=print, report_every_s=5)``;
setting ``event`` ends the run early, and :func:`format_summary` renders the report.

Prompts: :class:`SyntheticPrompts` writes prompts in the shape of the
testbed's synthetic corpus (``extract: {json record}``, ``classify: ...``,
``chat: ...``, ``write: ...``) over its own small syllable language. To send
the very prompts a model was trained on, point ``--prompts`` at another
source: ``MODULE:FUNCTION`` (a ``function(route, rng) -> str``) or ``MODULE``
with a ``GENERATORS`` mapping (route -> ``generator(rng, lexicon)`` returning
an object with ``.prompt``) and a ``Lexicon(seed)`` class, which is the shape
of ``testbed.corpus`` (``--corpus-seed`` picks the language).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import math
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_ROUTES: Mapping[str, float] = {"extract": 1.0, "classify": 1.0, "chat": 1.0, "creative": 1.0}
DEFAULT_DURATION_S = 30.0
MAX_CONCURRENCY = 4096
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ROUTE_CARRIERS = ("both", "header", "metadata")
DECISION_HEADER = "X-Specgate-Decision"
FALLBACK_HEADER = "X-Specgate-Fallback"


class LoadgenError(ValueError):
    """A bad option: the message starts with the option's name, as the user typed it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


# --- prompts ---------------------------------------------------------------------------


class PromptSource(Protocol):
    """Where prompts come from: the routes it knows, a prompt per route, a JSON schema per route."""

    def routes(self) -> tuple[str, ...] | None:
        """The routes this source knows, or None when it cannot tell (then each route is probed once)."""

    def prompt(self, route: str, rng: random.Random) -> str: ...

    def schema(self, route: str) -> dict[str, Any]: ...


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
EXTRACT_FIELDS = ("name", "city", "street", "phone", "item", "note")
CLASSIFY_LABELS = ("positive", "negative", "question", "neutral")

# What a structured-output request asks for, per route: the answer each route's
# prompt calls for, as a JSON object (extraction fills the record's template).
ROUTE_SCHEMAS: Mapping[str, dict[str, Any]] = {
    "extract": {"type": "object", "properties": {k: {"type": "string"} for k in EXTRACT_FIELDS},
                "required": list(EXTRACT_FIELDS), "additionalProperties": False},
    "classify": {"type": "object", "properties": {"label": {"type": "string", "enum": list(CLASSIFY_LABELS)}},
                 "required": ["label"], "additionalProperties": False},
}
GENERIC_SCHEMA: Mapping[str, Any] = {"type": "object", "properties": {"reply": {"type": "string"}},
                                     "required": ["reply"], "additionalProperties": False}


def schema_for(route: str) -> dict[str, Any]:
    copy: dict[str, Any] = json.loads(json.dumps(ROUTE_SCHEMAS.get(route, GENERIC_SCHEMA)))  # the caller may keep it
    return copy


class SyntheticPrompts:
    """Prompts shaped like the testbed corpus, over a syllable language drawn from ``seed``.

    * ``extract`` — ``extract: {"k":"v",...}``: a record with the template's fields in random order
      and distractors; the answer copies the values (what prompt look-up speculation feeds on);
    * ``classify`` — ``classify: <sentence>`` with one cue word that decides the label;
    * ``chat`` — ``chat: <sentence>`` of a small Zipf grammar;
    * ``creative`` — ``write: <three random words>``, whose continuation nothing predicts.
    """

    ROUTES = ("extract", "classify", "chat", "creative")

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(f"specgate-loadgen-lexicon:{seed}")  # noqa: S311 - test traffic, not secrets

        def words(n: int, lo: int, hi: int) -> list[str]:
            out: set[str] = set()
            while len(out) < n:
                out.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(lo, hi))))
            return sorted(out)

        self.names, self.places, self.things = words(120, 2, 3), words(60, 2, 3), words(80, 2, 2)
        self.nouns, self.verbs, self.adjectives = words(60, 1, 2), words(40, 1, 2), words(40, 2, 2)
        self.cues = {label: words(6, 2, 2) for label in CLASSIFY_LABELS}
        self.determiners = ["the", "a", "this", "my", "our"]
        # Zipf weights: a few words dominate, like natural text, so a drafter can learn them
        self._zipf = {id(items): [1.0 / (rank + 1) ** 1.1 for rank in range(len(items))]
                      for items in (self.nouns, self.verbs, self.adjectives, self.determiners)}

    def routes(self) -> tuple[str, ...]:
        return self.ROUTES

    def schema(self, route: str) -> dict[str, Any]:
        return schema_for(route)

    def _pick(self, rng: random.Random, items: list[str]) -> str:
        return rng.choices(items, weights=self._zipf[id(items)], k=1)[0]

    def _sentence(self, rng: random.Random) -> str:
        det, noun = self.determiners, self.nouns
        subject = f"{self._pick(rng, det)} {self._pick(rng, noun)}"
        if rng.random() < 0.4:
            subject = f"{self._pick(rng, det)} {self._pick(rng, self.adjectives)} {self._pick(rng, noun)}"
        clause = f"{subject} {self._pick(rng, self.verbs)}s {self._pick(rng, det)} {self._pick(rng, noun)}"
        return clause[0].upper() + clause[1:] + "."

    def prompt(self, route: str, rng: random.Random) -> str:
        if route == "extract":
            fields = [("name", f"{rng.choice(self.names)} {rng.choice(self.names)}"),
                      ("city", rng.choice(self.places)),
                      ("street", f"{rng.randint(1, 99)} {rng.choice(self.places)} {rng.choice(['road', 'lane'])}"),
                      ("phone", f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"),
                      ("item", f"{rng.choice(self.adjectives)} {rng.choice(self.things)}"),
                      ("note", " ".join(rng.choice(self.nouns) for _ in range(rng.randint(2, 4))))]
            for key in rng.sample(("id", "date", "ref"), rng.randint(0, 2)):
                fields.append((key, f"{rng.choice(self.things)}{rng.randint(1, 99)}"))
            rng.shuffle(fields)
            # the record as a JSON object: the answer's template repeats its keys and values verbatim
            return "extract: " + json.dumps(dict(fields), separators=(",", ":"))
        if route == "classify":
            words = self._sentence(rng).rstrip(".").split()
            words.insert(rng.randint(1, len(words)), rng.choice(self.cues[rng.choice(CLASSIFY_LABELS)]))
            return "classify: " + " ".join(words) + "."
        if route == "chat":
            return "chat: " + self._sentence(rng)
        if route == "creative":
            return "write: " + " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                                        for _ in range(3))
        raise KeyError(route)


class FunctionPrompts:
    """A ``function(route, rng) -> str``; routes unknown up front (probed when the plan is built)."""

    def __init__(self, function: Callable[[str, random.Random], str], name: str) -> None:
        self.function = function
        self.name = name

    def routes(self) -> tuple[str, ...] | None:
        return None

    def prompt(self, route: str, rng: random.Random) -> str:
        return str(self.function(route, rng))

    def schema(self, route: str) -> dict[str, Any]:
        return schema_for(route)


class CorpusPrompts:
    """A corpus module with ``GENERATORS`` (route -> ``generator(rng, lexicon)``) and ``Lexicon(seed)``."""

    def __init__(self, module: Any, seed: int) -> None:
        self.generators: Mapping[str, Callable[[random.Random, Any], Any]] = module.GENERATORS
        self.lexicon = module.Lexicon(seed)

    def routes(self) -> tuple[str, ...]:
        return tuple(self.generators)

    def prompt(self, route: str, rng: random.Random) -> str:
        return str(self.generators[route](rng, self.lexicon).prompt)

    def schema(self, route: str) -> dict[str, Any]:
        return schema_for(route)


def load_prompt_source(spec: str | None, *, corpus_seed: int = 0) -> PromptSource:
    """``None``: :class:`SyntheticPrompts`; ``MODULE:FUNCTION``; or ``MODULE`` shaped like a corpus."""
    if not spec:
        return SyntheticPrompts(corpus_seed)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoadgenError("--prompts", f"cannot import {module_name!r}: {exc}") from exc
    if attr:
        function = getattr(module, attr, None)
        if not callable(function):
            raise LoadgenError("--prompts", f"{module_name!r} has no function {attr!r}")
        return FunctionPrompts(function, spec)
    if not isinstance(getattr(module, "GENERATORS", None), Mapping) or not callable(getattr(module, "Lexicon", None)):
        raise LoadgenError("--prompts", f"{module_name!r} has neither GENERATORS and Lexicon; "
                           "name a function as MODULE:FUNCTION")
    return CorpusPrompts(module, corpus_seed)


# --- options -> plan --------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, option: str) -> float:
    """``30s``, ``2m``, ``500ms``, ``1h`` or a bare number of seconds; must be above zero."""
    match = _DURATION.match(text)
    if not match:
        raise LoadgenError(option, f"{text!r} is not a duration (e.g. 30s, 2m, 500ms)")
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if seconds <= 0:
        raise LoadgenError(option, f"{text!r}: a duration must be above zero")
    return seconds


@dataclass(frozen=True, slots=True)
class Stage:
    concurrency: int
    duration_s: float | None  # None: until the request budget is spent


def parse_schedule(text: str) -> list[Stage]:
    """``CONCURRENCY:DURATION,...``, e.g. ``1:30s,4:30s,16:30s``."""
    option = "--schedule"
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise LoadgenError(option, f"{text!r}: expected CONCURRENCY:DURATION[,...], e.g. 1:30s,4:30s,16:30s")
    stages = []
    for number, part in enumerate(parts, 1):
        concurrency, sep, duration = part.partition(":")
        if not sep:
            raise LoadgenError(option, f"stage {number} {part!r} is not CONCURRENCY:DURATION (e.g. 4:30s)")
        stages.append(Stage(_concurrency(concurrency.strip(), f"{option} stage {number}"),
                            parse_duration(duration, f"{option} stage {number}")))
    return stages


def _concurrency(text: str, option: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_CONCURRENCY:
        raise LoadgenError(option, f"concurrency {text!r} must be a whole number from 1 to {MAX_CONCURRENCY}")
    return int(text)


def parse_route_mix(text: str) -> dict[str, float]:
    """``ROUTE=WEIGHT,...`` (``chat=2,extract=1``); a route alone weighs 1. At least one weight above 0."""
    option = "--routes"
    mix: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise LoadgenError(option, f"{text!r}: expected ROUTE=WEIGHT[,...], e.g. chat=2,extract=1")
        route, sep, weight_text = part.partition("=")
        route = route.strip()
        if not route:
            raise LoadgenError(option, f"{part!r} names no route")
        if route in mix:
            raise LoadgenError(option, f"route {route!r} is given twice")
        try:
            weight = float(weight_text) if sep else 1.0
        except ValueError:
            raise LoadgenError(option, f"weight of {route!r} must be a number, got {weight_text!r}") from None
        if not math.isfinite(weight) or weight < 0:
            raise LoadgenError(option, f"weight of {route!r} must be a finite number >= 0, got {weight_text!r}")
        mix[route] = weight
    if not any(mix.values()):
        raise LoadgenError(option, "at least one route needs a weight above 0")
    return mix


def _share(value: float, option: str) -> float:
    if not isinstance(value, int | float) or math.isnan(value) or not 0.0 <= value <= 1.0:
        raise LoadgenError(option, f"must be a share in [0, 1], got {value!r}")
    return float(value)


def parse_labels(items: Iterable[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or "," in item:
            raise LoadgenError("--label", f"must be k=v (no commas), got {item!r}")
        labels[key.strip()] = value.strip()
    return labels


@dataclass(frozen=True)
class LoadPlan:
    """Everything a run needs, validated. Build it with :func:`build_plan`."""

    url: str
    stages: tuple[Stage, ...]
    routes: Mapping[str, float]
    prompts: PromptSource
    structured_share: float = 0.0
    stream_share: float = 0.0
    max_tokens: int = 64
    requests: int | None = None
    endpoint: str = "chat"
    model: str | None = None
    seed: int = 0
    run_id: str = ""
    timeout_s: float = 120.0
    labels: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = None
    plain_engines: frozenset[str] = frozenset({"base"})
    route_in: str = "both"
    temperature: float | None = None  # None: not sent, the server's default

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]

    @property
    def max_concurrency(self) -> int:
        return max(stage.concurrency for stage in self.stages)


def build_plan(*, url: str = "http://127.0.0.1:9000", routes: str | Mapping[str, float] | None = None,
               schedule: str | None = None, concurrency: int | None = None, duration: str | None = None,
               requests: int | None = None, structured_share: float = 0.0, stream_share: float = 0.0,
               max_tokens: int = 64, endpoint: str = "chat", model: str | None = None, seed: int = 0,
               run_id: str | None = None, timeout_s: float = 120.0, labels: Iterable[str] = (),
               api_key: str | None = None, plain_engines: Iterable[str] = ("base",), route_in: str = "both",
               prompts: PromptSource | None = None, temperature: float | None = None) -> LoadPlan:
    """Validate the options; every error is a :class:`LoadgenError` naming its option."""
    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise LoadgenError("--url", f"must be an http(s) base URL like http://127.0.0.1:9000, got {url!r}")
    if schedule is not None:
        if concurrency is not None or duration is not None:
            raise LoadgenError("--schedule", "replaces --concurrency and --duration; give one or the other")
        stages = parse_schedule(schedule)
    else:
        if concurrency is None:
            concurrency = 4
        if not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
            raise LoadgenError("--concurrency", f"must be from 1 to {MAX_CONCURRENCY}, got {concurrency!r}")
        seconds = parse_duration(duration, "--duration") if duration is not None else (
            None if requests is not None else DEFAULT_DURATION_S)
        stages = [Stage(concurrency, seconds)]
    if requests is not None and requests < 1:
        raise LoadgenError("--requests", f"must be at least 1, got {requests}")
    if not 1 <= max_tokens <= 1_000_000:
        raise LoadgenError("--max-tokens", f"must be from 1 to 1000000, got {max_tokens}")
    if endpoint not in ENDPOINTS:
        raise LoadgenError("--endpoint", f"must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if route_in not in ROUTE_CARRIERS:
        raise LoadgenError("--route-in", f"must be one of {', '.join(ROUTE_CARRIERS)}, got {route_in!r}")
    if not timeout_s > 0:
        raise LoadgenError("--timeout", f"must be above zero, got {timeout_s}")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise LoadgenError("--temperature", f"must be from 0 to 2, got {temperature}")
    source = prompts if prompts is not None else SyntheticPrompts()
    mix = dict(DEFAULT_ROUTES) if routes is None else (
        parse_route_mix(routes) if isinstance(routes, str) else dict(routes))
    _check_routes(mix, source)
    plain = frozenset(p.strip() for p in plain_engines if p.strip())
    return LoadPlan(
        url=url.rstrip("/"), stages=tuple(stages), routes=mix, prompts=source,
        structured_share=_share(structured_share, "--structured-share"),
        stream_share=_share(stream_share, "--stream-share"), max_tokens=max_tokens, requests=requests,
        endpoint=endpoint, model=model or None, seed=seed, run_id=run_id or uuid.uuid4().hex[:8],
        timeout_s=float(timeout_s), labels=parse_labels(labels), api_key=api_key or None,
        plain_engines=plain, route_in=route_in, temperature=temperature)


def _check_routes(mix: Mapping[str, float], source: PromptSource) -> None:
    known = source.routes()
    if known is not None:
        unknown = sorted(set(mix) - set(known))
        if unknown:
            raise LoadgenError("--routes", f"unknown route(s) {', '.join(map(repr, unknown))}; "
                               f"the prompt source knows {', '.join(known)}")
        return
    for route in mix:  # a source that cannot list its routes: ask it for one prompt of each
        try:
            source.prompt(route, random.Random(0))  # noqa: S311 - test traffic, not secrets
        except (KeyError, ValueError, IndexError) as exc:
            raise LoadgenError("--routes", f"the prompt source has no route {route!r} ({exc!r})") from None


# --- one request ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    request_id: str
    route: str
    structured: bool
    stream: bool
    body: dict[str, Any]
    headers: dict[str, str]


def request_rng(seed: int, index: int) -> random.Random:
    """The randomness of request ``index``: fixed by (seed, index), whatever order workers take requests in."""
    return random.Random(f"specgate-loadgen:{seed}:{index}")  # noqa: S311 - test traffic, not secrets


def build_request(plan: LoadPlan, index: int) -> PlannedRequest:
    rng = request_rng(plan.seed, index)
    routes = list(plan.routes)
    route = rng.choices(routes, weights=[plan.routes[r] for r in routes], k=1)[0]
    # drawn in a fixed order and always, so one share does not shift the other's draws
    structured = rng.random() < plan.structured_share
    stream = rng.random() < plan.stream_share
    prompt = plan.prompts.prompt(route, rng)
    request_id = f"lg-{plan.run_id}-{index:07d}"
    body: dict[str, Any] = {"model": plan.model or "default", "max_tokens": plan.max_tokens}
    if plan.temperature is not None:
        body["temperature"] = plan.temperature
    if plan.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if plan.route_in in ("both", "metadata"):
        body["metadata"] = {"route": route}
    if structured:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"{route}_answer", "schema": plan.prompts.schema(route)}}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if plan.route_in in ("both", "header"):
        headers["X-Specgate-Route"] = route
    if plan.labels:
        headers["X-Specgate-Labels"] = ",".join(f"{k}={v}" for k, v in plan.labels.items())
    if plan.api_key:
        headers["Authorization"] = f"Bearer {plan.api_key}"
    return PlannedRequest(index, request_id, route, structured, stream, body, headers)


def parse_decision(header: str | None) -> dict[str, str]:
    """``engine=draft; rule=r; policy=p; revision=...; explored=false`` -> dict; {} when absent."""
    if not header:
        return {}
    out = {}
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            out[key] = value
    return out


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    index: int
    request_id: str
    route: str
    stage: int
    structured: bool
    stream: bool
    start_s: float  # since the run started
    latency_s: float
    inflight: int  # this generator's requests in flight when it was sent, itself included
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None  # None: ok; else a kind: http_503, connect, timeout, disconnected, ...
    ttft_s: float | None = None
    engine: str | None = None  # from the decision header
    replica: str | None = None  # ... which names the replica that answered (replica pools)
    rule: str | None = None
    explored: bool = False
    fallback: bool = False
    completion_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    engine_itl_ms: float | None = None  # vLLM's per-request mean inter-token latency, when the answer carries it
    valid_json: bool | None = None  # structured requests: did the answer parse as JSON


def apply_answer(outcome: Outcome, answer: Mapping[str, Any]) -> None:
    """Usage and vLLM's per-request speculative metrics of a JSON answer or a stream's last chunk."""
    usage = answer.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
        outcome.completion_tokens = usage["completion_tokens"]
    metrics = answer.get("metrics")
    itl = metrics.get("mean_itl_ms") if isinstance(metrics, Mapping) else None
    if isinstance(itl, (int, float)) and not isinstance(itl, bool) and math.isfinite(itl) and itl >= 0:
        outcome.engine_itl_ms = float(itl)
    spec = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    if isinstance(spec, Mapping):
        drafted, accepted = spec.get("num_draft_tokens"), spec.get("num_accepted_draft_tokens")
        if isinstance(drafted, int) and isinstance(accepted, int):
            outcome.drafted, outcome.accepted = drafted, accepted


def answer_text(answer: Mapping[str, Any]) -> str:
    """The text of a JSON answer's first choice, or of one stream chunk's delta."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return ""
    choice = choices[0]
    for holder in (choice.get("message"), choice.get("delta")):
        if isinstance(holder, Mapping) and isinstance(holder.get("content"), str):
            return str(holder["content"])
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def is_valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# --- the report -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def _group(outcomes: Sequence[Outcome], plain: frozenset[str]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency_s for o in ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    decided = [o for o in outcomes if o.engine is not None]
    speculated = sum(1 for o in decided if o.engine not in plain)
    drafted = sum(o.drafted or 0 for o in outcomes)
    accepted = sum(o.accepted or 0 for o in outcomes)
    checked = [o for o in outcomes if o.valid_json is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "p50_ms": _ms(percentile(latencies, 50)),
        "p95_ms": _ms(percentile(latencies, 95)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "decided": len(decided),
        "speculated": speculated,
        "speculated_share": round(speculated / len(decided), 4) if decided else None,
        "structured": sum(1 for o in outcomes if o.structured),
        "streamed": sum(1 for o in outcomes if o.stream),
        "completion_tokens": sum(o.completion_tokens or 0 for o in ok),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "valid_json_share": round(sum(1 for o in checked if o.valid_json) / len(checked), 4) if checked else None,
    }


def summarize(outcomes: Sequence[Outcome], plan: LoadPlan, elapsed_s: float) -> dict[str, Any]:
    """The run's report as plain data (what ``--json`` prints)."""
    plain = plan.plain_engines
    overall = _group(outcomes, plain)
    overall["elapsed_s"] = round(elapsed_s, 3)
    overall["requests_per_s"] = round(len(outcomes) / elapsed_s, 3) if elapsed_s > 0 else None
    stages = []
    for number, stage in enumerate(plan.stages):
        mine = [o for o in outcomes if o.stage == number]
        row = _group(mine, plain)
        row["concurrency"] = stage.concurrency
        row["duration_s"] = stage.duration_s
        row["max_inflight"] = max((o.inflight for o in mine), default=0)
        stages.append(row)
    routes = {route: _group([o for o in outcomes if o.route == route], plain) for route in plan.routes}
    return {
        "run_id": plan.run_id,
        "url": plan.url,
        "overall": overall,
        "stages": stages,
        "routes": routes,
        "engines": dict(sorted(Counter(o.engine for o in outcomes if o.engine is not None).items())),
        "rules": dict(sorted(Counter(o.rule for o in outcomes if o.rule is not None).items())),
        "errors": dict(sorted(Counter(o.error for o in outcomes if o.error is not None).items())),
        "fallbacks": sum(1 for o in outcomes if o.fallback),
        "explored": sum(1 for o in outcomes if o.explored),
    }


def _cell(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}{suffix}"
    return f"{value}{suffix}"


def _share_cell(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The human report: totals, a table per stage and per route, engines, errors."""
    o = summary["overall"]
    error_pct = f" ({o['errors'] / o['requests'] * 100:.1f} %)" if o["requests"] else ""
    lines = [f"loadgen run {summary['run_id']} against {summary['url']}: {o['requests']} requests in "
             f"{o['elapsed_s']:.1f} s ({_cell(o['requests_per_s'])} req/s), {o['errors']} errors{error_pct}"]
    header = f"{'':<10}{'requests':>9}{'errors':>8}{'p50 ms':>10}{'p95 ms':>10}{'ttft p50':>10}" \
             f"{'speculated':>12}{'acceptance':>12}"

    def row(name: str, g: Mapping[str, Any]) -> str:
        return (f"{name:<10}{g['requests']:>9}{g['errors']:>8}{_cell(g['p50_ms']):>10}{_cell(g['p95_ms']):>10}"
                f"{_cell(g['ttft_p50_ms']):>10}{_share_cell(g['speculated_share']):>12}"
                f"{_share_cell(g['acceptance_rate']):>12}")

    lines += ["", "stage " + header[6:]]
    for number, stage in enumerate(summary["stages"], 1):
        length = f"{stage['duration_s']:g}s" if stage["duration_s"] else "-"
        lines.append(row(f"{number} c={stage['concurrency']}", stage) + f"   ({length}, max in flight "
                     f"{stage['max_inflight']})")
    lines += ["", "route " + header[6:]]
    for route, group in summary["routes"].items():
        lines.append(row(route[:10], group))
    engines = ", ".join(f"{name} {count}" for name, count in summary["engines"].items()) or "no decision headers"
    lines += ["", f"engines: {engines}; fallbacks {summary['fallbacks']}; explored {summary['explored']}"]
    if summary["errors"]:
        lines.append("errors: " + ", ".join(f"{kind} {count}" for kind, count in summary["errors"].items()))
    return "\n".join(lines)


def progress_line(outcomes: Sequence[Outcome], elapsed_s: float, stage: int, plan: LoadPlan) -> str:
    """One live line: where the run is and how it goes so far."""
    recent = [o for o in outcomes if o.stage == stage]
    ok = [o.latency_s for o in recent if o.error is None]
    decided = [o for o in recent if o.engine is not None]
    spec = (sum(1 for o in decided if o.engine not in plan.plain_engines) / len(decided)) if decided else None
    errors = sum(1 for o in outcomes if o.error is not None)
    return (f"[{elapsed_s:7.1f} s] stage {stage + 1}/{len(plan.stages)} c={plan.stages[stage].concurrency} "
            f"requests {len(outcomes)} errors {errors} | this stage: {len(recent)} done, "
            f"p50 {_cell(_ms(percentile(ok, 50)))} ms, p95 {_cell(_ms(percentile(ok, 95)))} ms, "
            f"speculated {_share_cell(spec)}")


# --- the runner -----------------------------------------------------------------------


async def discover_model(session: Any, plan: LoadPlan) -> str:
    """The first model ``GET /v1/models`` lists (what a plan without ``--model`` sends)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else None
    try:
        async with session.get(plan.url + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(plan.timeout_s, 30.0))) as resp:
            data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise LoadgenError("--model", f"not given, and {plan.url}/v1/models named no model "
                           f"({type(exc).__name__}: {exc}); pass --model") from None


class LoadRun:
    """One run of a plan: workers per stage, outcomes as they finish."""

    def __init__(self, plan: LoadPlan, *, on_progress: Callable[[str], None] | None = None,
                 report_every_s: float = 0.0, stop: asyncio.Event | None = None) -> None:
        self.plan = plan
        self.outcomes: list[Outcome] = []
        self.on_progress = on_progress
        self.report_every_s = report_every_s
        self.stop = stop or asyncio.Event()
        self._next = 0
        self._inflight = 0
        self._t0 = 0.0
        self._stage = 0
        self.elapsed_s = 0.0

    def _take(self) -> int | None:
        if self.plan.requests is not None and self._next >= self.plan.requests:
            return None
        index, self._next = self._next, self._next + 1
        return index

    def _exhausted(self) -> bool:
        return self.plan.requests is not None and self._next >= self.plan.requests

    async def run(self) -> dict[str, Any]:
        import aiohttp

        plan = self.plan
        connector = aiohttp.TCPConnector(limit=plan.max_concurrency + 4, force_close=False)
        timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            if plan.model is None:
                self.plan = plan = _with_model(plan, await discover_model(session, plan))
            self._t0 = time.perf_counter()
            reporter = asyncio.create_task(self._report()) if self.on_progress and self.report_every_s > 0 else None
            try:
                for number, stage in enumerate(plan.stages):
                    self._stage = number
                    await self._run_stage(session, number, stage)
                    if self.stop.is_set() or self._exhausted():
                        break
            finally:
                if reporter is not None:
                    reporter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reporter
                self.elapsed_s = time.perf_counter() - self._t0
        return summarize(self.outcomes, plan, self.elapsed_s)

    async def _run_stage(self, session: Any, number: int, stage: Stage) -> None:
        # The stage ends when its time is up and the requests it started have finished, so
        # the server never sees more than the stage's concurrency from this generator.
        deadline = None if stage.duration_s is None else time.perf_counter() + stage.duration_s
        workers = {asyncio.create_task(self._worker(session, number, deadline)) for _ in range(stage.concurrency)}
        stopper: asyncio.Task[Any] = asyncio.create_task(self.stop.wait())
        pending: set[asyncio.Task[Any]] = set(workers)
        try:
            while pending and not self.stop.is_set():
                _, waiting = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
                pending = waiting - {stopper}
        finally:
            stopper.cancel()
            for worker in pending:  # stopped: requests in flight are abandoned, not counted
                worker.cancel()
            results = await asyncio.gather(*workers, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):  # a bug, not a failed request (those are outcomes)
                raise result

    async def _worker(self, session: Any, number: int, deadline: float | None) -> None:
        while not self.stop.is_set() and (deadline is None or time.perf_counter() < deadline):
            index = self._take()
            if index is None:
                return
            self.outcomes.append(await self._one(session, build_request(self.plan, index), number))

    async def _one(self, session: Any, request: PlannedRequest, stage: int) -> Outcome:
        import aiohttp

        self._inflight += 1
        start = time.perf_counter()
        outcome = Outcome(request.index, request.request_id, request.route, stage, request.structured,
                          request.stream, start - self._t0, 0.0, self._inflight)
        try:
            async with session.post(self.plan.url + self.plan.path, data=json.dumps(request.body),
                                    headers=request.headers) as resp:
                outcome.status = resp.status
                decision = parse_decision(resp.headers.get(DECISION_HEADER))
                outcome.engine = decision.get("engine")
                outcome.replica = decision.get("replica")
                outcome.rule = decision.get("rule")
                outcome.explored = decision.get("explored") == "true"
                outcome.fallback = FALLBACK_HEADER in resp.headers
                if resp.status >= 400:
                    await resp.read()
                    outcome.error = f"http_{resp.status}"
                elif request.stream:
                    await self._read_stream(resp, outcome, start)
                else:
                    answer = json.loads(await resp.read())
                    apply_answer(outcome, answer)
                    if request.structured:
                        outcome.valid_json = is_valid_json(answer_text(answer))
        except TimeoutError:
            outcome.error = "timeout"
        except aiohttp.ClientConnectorError:
            outcome.error = "connect"
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):
            outcome.error = "disconnected"
        except aiohttp.ClientError as exc:
            outcome.error = type(exc).__name__
        except ValueError:
            outcome.error = "bad_answer"
        finally:
            self._inflight -= 1
            outcome.latency_s = time.perf_counter() - start
        return outcome

    @staticmethod
    async def _read_stream(resp: Any, outcome: Outcome, start: float) -> None:
        done = False
        text: list[str] = []
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                outcome.error = "stream_error"
                return
            piece = answer_text(chunk)
            if piece:
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - start
                if outcome.structured:
                    text.append(piece)
            if chunk.get("usage") or chunk.get("metrics"):
                apply_answer(outcome, chunk)
        if not done:
            outcome.error = "incomplete_stream"
        elif outcome.structured:
            outcome.valid_json = is_valid_json("".join(text))

    async def _report(self) -> None:
        assert self.on_progress is not None
        while True:
            await asyncio.sleep(self.report_every_s)
            self.on_progress(progress_line(self.outcomes, time.perf_counter() - self._t0, self._stage, self.plan))


def _with_model(plan: LoadPlan, model: str) -> LoadPlan:
    from dataclasses import replace

    return replace(plan, model=model)


async def run_load(plan: LoadPlan, *, on_progress: Callable[[str], None] | None = None,
                   report_every_s: float = 0.0, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run ``plan`` to its end (or until ``stop`` is set) and return :func:`summarize`'s report."""
    return await LoadRun(plan, on_progress=on_progress, report_every_s=report_every_s, stop=stop).run()
