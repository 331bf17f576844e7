"""The policy document: validated, immutable models of ``specgate/v1``.

Structure and per-field bounds live here; rules that need the whole document
(engine references, duplicate names, shadowing) live in ``validate.py`` so
that every problem of a document can be reported in one pass.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from policies.errors import ErrorCode

API_VERSION = "specgate/v1"

# Names travel in response headers and metric labels, so they stay short and plain.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
Identifier = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NonEmptyStr = Annotated[str, StringConstraints(min_length=1, max_length=256)]
SpeculativeTokens = Annotated[int, Field(ge=1, le=16)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]

# Names with a meaning of their own in a Decision: a rule may not take them.
RESERVED_RULE_NAMES = frozenset({"default", "kill-switch", "fallback"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Range(_Strict):
    """An inclusive integer range; either bound may be left open, not both."""

    min: Annotated[int, Field(ge=0)] | None = None
    max: Annotated[int, Field(ge=0)] | None = None

    @field_validator("max")
    @classmethod
    def _not_inverted(cls, value: int | None, info: object) -> int | None:
        data = getattr(info, "data", {})
        low = data.get("min")
        if value is not None and low is not None and value < low:
            raise PydanticCustomError(
                ErrorCode.inverted_range, "max ({high}) is below min ({low}): the range is empty",
                {"high": value, "low": low},
            )
        return value

    @model_validator(mode="after")
    def _has_a_bound(self) -> Range:
        if self.min is None and self.max is None:
            raise PydanticCustomError(
                ErrorCode.empty_range, "a range needs min, max or both; an empty range would match everything"
            )
        return self

    def contains(self, value: int) -> bool:
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def covers(self, other: Range) -> bool:
        """True when every value in ``other`` is also in ``self``."""
        low_ok = self.min is None or (other.min is not None and other.min >= self.min)
        high_ok = self.max is None or (other.max is not None and other.max <= self.max)
        return low_ok and high_ok


StringSet = Annotated[list[NonEmptyStr], Field(min_length=1, max_length=1024)]


def _one_or_many(value: object) -> object:
    # A label may be written as one value or a list; the normal form is a list,
    # so equal meanings hash to equal revisions.
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    raise PydanticCustomError(ErrorCode.wrong_type, "expected a string or a list of strings")


LabelValues = Annotated[StringSet, BeforeValidator(_one_or_many)]


class When(_Strict):
    """Predicates on the request shape; all given predicates must hold."""

    route: StringSet | None = None
    model: StringSet | None = None
    batch_size: Range | None = None
    max_tokens: Range | None = None
    prompt_tokens: Range | None = None
    structured_output: bool | None = None
    tools: bool | None = None
    stream: bool | None = None
    labels: Annotated[dict[NonEmptyStr, LabelValues], Field(min_length=1)] | None = None

    def label_sets(self) -> dict[str, frozenset[str]]:
        if not self.labels:
            return {}
        return {k: frozenset(v) for k, v in self.labels.items()}

    def test_count(self) -> int:
        """The tests a compiled rule makes for these predicates: one per predicate and per label, none for the
        route (which chooses the function a rule is compiled into)."""
        given = sum(getattr(self, name) is not None for name in _NON_ROUTE_PREDICATES)
        return given + len(self.labels or {})


_NON_ROUTE_PREDICATES = ("model", "batch_size", "max_tokens", "prompt_tokens", "structured_output", "tools",
                         "stream")


class Then(_Strict):
    engine: Identifier
    num_speculative_tokens: SpeculativeTokens | None = None


class Rule(_Strict):
    name: Identifier
    description: str | None = None
    when: When = When()
    then: Then

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value in RESERVED_RULE_NAMES:
            raise PydanticCustomError(
                ErrorCode.reserved_name, "rule name '{name}' is reserved for decisions that no rule made",
                {"name": value},
            )
        return value


class PlainEngine(_Strict):
    method: Literal["none"]
    description: str | None = None


# Where a speculative engine's batch-size rules are applied. "router" (what None means; None, so that a document
# without the field keeps its revision id): the sidecar tests each rule's batch and sends a request elsewhere
# outside it. "in_engine": the sidecar sends every request a rule's other predicates match to the engine, and the
# engine drafts by a schedule over its own running batch compiled from those rules (policies.schedule; vLLM's
# num_speculative_tokens_per_batch_size), K=0 where no rule drafts: one copy of the weights, and the engine sees
# its batch at every step where the sidecar sees it once, at admission.
# "router" is read as None: the two mean the same, so they must make the same revision id.
ScheduleMode = Annotated[Literal["router", "in_engine"],
                         AfterValidator(lambda mode: None if mode == "router" else mode)]


class NgramEngine(_Strict):
    method: Literal["ngram"]
    description: str | None = None
    num_speculative_tokens: SpeculativeTokens
    schedule: ScheduleMode | None = None
    prompt_lookup_min: Annotated[int, Field(ge=1, le=64)] | None = None
    prompt_lookup_max: Annotated[int, Field(ge=1, le=64)] | None = None

    @field_validator("prompt_lookup_max")
    @classmethod
    def _lookup_not_inverted(cls, value: int | None, info: object) -> int | None:
        low = getattr(info, "data", {}).get("prompt_lookup_min")
        if value is not None and low is not None and value < low:
            raise PydanticCustomError(
                ErrorCode.inverted_range, "prompt_lookup_max ({high}) is below prompt_lookup_min ({low})",
                {"high": value, "low": low},
            )
        return value


class DraftModelEngine(_Strict):
    method: Literal["draft_model"]
    description: str | None = None
    model: NonEmptyStr
    num_speculative_tokens: SpeculativeTokens
    draft_tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] | None = None
    schedule: ScheduleMode | None = None


class EagleEngine(_Strict):
    method: Literal["eagle", "eagle3"]
    description: str | None = None
    model: NonEmptyStr
    num_speculative_tokens: SpeculativeTokens
    schedule: ScheduleMode | None = None


class MtpEngine(_Strict):
    method: Literal["mtp"]
    description: str | None = None
    num_speculative_tokens: SpeculativeTokens
    schedule: ScheduleMode | None = None


# Suffix decoding (arXiv 2411.04975): drafts from suffix trees over the request's prompt and output and over the
# responses of earlier requests, as far as the tokens' estimated probabilities carry it. Fields, defaults and bounds
# as vLLM 0.32.0 defines them (vllm/config/speculative.py, SpeculativeConfig and _validate_suffix_decoding; the
# proposer is vllm/v1/spec_decode/suffix_decoding.py, on Arctic Inference's suffix trees); like the other engines
# the fields keep vLLM's names. num_speculative_tokens is the most a step drafts (vLLM would default it to the tree
# depth, which is above what a policy may name). Upper bounds are the policy's own: vLLM has none (the trees take
# 32-bit integers).
MAX_SUFFIX_TREE_DEPTH = 1024
MAX_SUFFIX_CACHED_REQUESTS = 1_000_000
SUFFIX_REFUSES_IN_ENGINE = (
    "suffix decoding cannot schedule in the engine: vLLM 0.32.0's suffix proposer drafts with the engine's "
    "num_speculative_tokens at every step and stops on any other K, so it takes no batch-size schedule; leave "
    "schedule out (the router applies the rules' batch ranges)")


class SuffixEngine(_Strict):
    method: Literal["suffix"]
    description: str | None = None
    num_speculative_tokens: SpeculativeTokens
    # Only the router: vLLM's suffix proposer asserts that each step's K is the configured one (see above).
    schedule: Annotated[Literal["router"], AfterValidator(lambda _: None)] | None = None
    # The depth of the prompt's and the global suffix trees: a match and the draft after it together.
    suffix_decoding_max_tree_depth: Annotated[int, Field(ge=1, le=MAX_SUFFIX_TREE_DEPTH)] = 24
    # Earlier responses kept in the global tree, evicted first in first out; 0 keeps none (prompt trees only).
    suffix_decoding_max_cached_requests: Annotated[int, Field(ge=0, le=MAX_SUFFIX_CACHED_REQUESTS)] = 10000
    # A step drafts at most this factor times the length of the match. The upper bound is the policy's: a match is
    # at least one token and K at most 16, so a larger factor limits nothing.
    suffix_decoding_max_spec_factor: Annotated[float, Field(ge=0.0, le=16.0)] = 1.0
    # Draft only tokens whose estimated probability (from the trees' frequency counts) is at least this.
    suffix_decoding_min_token_prob: Fraction = 0.1

    @field_validator("schedule", mode="before")
    @classmethod
    def _router_only(cls, value: object) -> object:
        if value == "in_engine":
            raise PydanticCustomError(ErrorCode.invalid_value, SUFFIX_REFUSES_IN_ENGINE)
        return value


Engine = Annotated[
    PlainEngine | NgramEngine | DraftModelEngine | EagleEngine | MtpEngine | SuffixEngine,
    Field(discriminator="method"),
]
SpeculativeEngine = NgramEngine | DraftModelEngine | EagleEngine | MtpEngine | SuffixEngine
ENGINE_METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix")
ENGINE_MODELS = (PlainEngine, NgramEngine, DraftModelEngine, EagleEngine, MtpEngine, SuffixEngine)


def engine_k(engine: PlainEngine | SpeculativeEngine) -> int:
    """Draft length an engine variant is configured with; 0 for a plain engine."""
    return 0 if isinstance(engine, PlainEngine) else engine.num_speculative_tokens


def schedules_in_engine(engine: PlainEngine | SpeculativeEngine | None) -> bool:
    """Whether the engine applies its rules' batch ranges itself (``schedule: in_engine``)."""
    return engine is not None and not isinstance(engine, PlainEngine) and engine.schedule == "in_engine"


class Exploration(_Strict):
    """A holdout: this share of requests gets the other decision, tagged.

    Speculative decisions are explored on the policy's plain engine, plain
    decisions on ``speculative_engine``. By default the split is a sticky hash
    of the request id, so a replay of the same request explores the same way.

    With ``window_s`` the split is by time instead (a switchback): wall-clock
    time is cut into windows of that many seconds and a whole window is
    explored or not, by a sticky hash of its index. Per-request holdouts put
    the plain and the speculative engine under load at the same moment, and
    where the two share CPUs, memory bandwidth or a GPU, each one's latency
    then depends on the other's load; in a switchback window every request of
    a kind runs on one variant, as it would if the policy chose it for all.
    """

    rate: Annotated[float, Field(ge=0.0, le=0.5)] = 0.0
    speculative_engine: Identifier | None = None
    # None, not a default number: a document without it must keep the revision id it had before the field existed
    window_s: Annotated[float, Field(ge=1.0, le=86400.0)] | None = None


class Quality(_Strict):
    """Shadow comparisons: output quality checked beside speed.

    A share of the greedy requests that a speculative engine serves (temperature 0, one choice) is sent again
    to the plain engine, off the client's path, and the two answers are compared: exact match of the output,
    where they first differ, and for structured output the validity of both. Speculative decoding is lossless
    in the algorithm, but floating-point and batch-size effects can change exact outputs; this measures how
    often they do. The rate is small because every shadow is a request the plain engine serves for nothing.
    """

    shadow_rate: Annotated[float, Field(ge=0.0, le=0.05)]
    # None compares on every route; a list only on these
    routes: StringSet | None = None


class Telemetry(_Strict):
    """How a worker reports its requests: every one as a raw event (the default), or pre-aggregated.

    Below 1, ``raw_sample_rate`` turns pre-aggregation on: the sidecar adds every request to per-minute rollup
    deltas of its own (the counters and histograms the control plane keeps) and sends only that share of the
    requests as raw events, each carrying its weight (1 / rate), for the views that need single requests
    (what-if replays, per-worker figures). Rollups, and so the analysis and the guardrails, stay exact; the
    per-request views become estimates that say how many sampled events they rest on. For large fleets, where
    one stored row per request is what the control plane cannot keep up with.
    """

    raw_sample_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0


class Guardrails(_Strict):
    """Limits a rollout step must respect; a breach rolls the step back."""

    max_p95_itl_regression: Annotated[float, Field(ge=0.0, le=10.0)] = 0.10
    # What clients feel: the canary's end-to-end p95 against the baseline's. None, not a number: a document
    # without it keeps its revision id, and its rollouts check the ITL limit on e2e as well (see analysis).
    max_p95_e2e_regression: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    max_retry_rate_increase: Fraction = 0.02
    min_acceptance_rate: Fraction | None = None
    # The share of the canary's shadow comparisons (``quality``) whose answers match the plain engine's. Below 1:
    # a sample can show a rate is above 0.999, never that it is 1, so a minimum of 1 would hold every step forever.
    min_shadow_match_rate: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    min_samples: Annotated[int, Field(ge=1, le=10_000_000)] = 200


class PolicyDocument(_Strict):
    api_version: Literal["specgate/v1"] = Field(alias="apiVersion")
    name: Identifier
    description: str | None = None
    engines: Annotated[dict[Identifier, Engine], Field(min_length=1, max_length=64)]
    plain_engine: Identifier | None = None
    rules: Annotated[list[Rule], Field(max_length=1000)] = []
    default: Then
    exploration: Exploration = Exploration()
    guardrails: Guardrails = Guardrails()
    # None, not an empty section: a document without it keeps the revision id it had before the field existed
    quality: Quality | None = None
    # None for the same reason: every request as a raw event
    telemetry: Telemetry | None = None

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    @property
    def in_engine_schedules(self) -> frozenset[str]:
        """The engines whose batch rules run inside the engine."""
        return frozenset(name for name, engine in self.engines.items() if schedules_in_engine(engine))

    @property
    def resolved_plain_engine(self) -> str:
        """The engine for fallback, kill switch and explored speculative decisions.

        Validation guarantees it exists: either named, or the only plain engine.
        """
        if self.plain_engine is not None:
            return self.plain_engine
        return next(n for n, e in self.engines.items() if isinstance(e, PlainEngine))
