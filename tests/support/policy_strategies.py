"""Hypothesis strategies shared by the policy library's tests.

Documents are generated as raw dicts (what YAML or JSON would give) so that
they go through the same validation as a real document. Values come from
small alphabets so that routes, models and labels collide between rules and
request shapes: that is where rule order and route partitioning matter.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import strategies as st

from policies import PolicyDocument, PolicyValidationError, RequestShape, validate_data

ROUTES = ("chat", "extract", "code", "creative")
MODELS = ("m1", "m2", "m3")
LABEL_KEYS = ("tier", "team")
LABEL_VALUES = ("a", "b", "c")
BOUND = 16  # range bounds are drawn from 0..BOUND; shapes from 0..BOUND + 2

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix")
# Methods that may schedule in the engine (a suffix engine may not: vLLM's suffix proposer drafts one fixed K).
IN_ENGINE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
NON_ROUTE_PREDICATES = ("model", "batch_size", "max_tokens", "prompt_tokens",
                        "structured_output", "tools", "stream", "labels")


@st.composite
def ranges(draw: st.DrawFn) -> dict[str, int]:
    kind = draw(st.sampled_from(("min", "max", "both")))
    if kind == "min":
        return {"min": draw(st.integers(0, BOUND))}
    if kind == "max":
        return {"max": draw(st.integers(0, BOUND))}
    low = draw(st.integers(0, BOUND))
    return {"min": low, "max": draw(st.integers(low, BOUND))}


@st.composite
def engine_sets(draw: st.DrawFn) -> dict[str, dict[str, Any]]:
    """1-3 engines: exactly one plain engine ``base`` and 0-2 speculative ones."""
    engines: dict[str, dict[str, Any]] = {"base": {"method": "none"}}
    for i in range(draw(st.integers(0, 2))):
        method = draw(st.sampled_from(SPECULATIVE_METHODS))
        spec: dict[str, Any] = {"method": method, "num_speculative_tokens": draw(st.integers(1, 16))}
        if method in ("draft_model", "eagle", "eagle3"):
            spec["model"] = f"models/{method}-{i}"
        if method == "ngram" and draw(st.booleans()):
            low = draw(st.integers(1, 4))
            spec["prompt_lookup_min"] = low
            spec["prompt_lookup_max"] = draw(st.integers(low, 8))
        if method == "suffix":
            optional = {"suffix_decoding_max_tree_depth": st.integers(1, 1024),
                        "suffix_decoding_max_cached_requests": st.integers(0, 1_000_000),
                        "suffix_decoding_max_spec_factor": st.floats(0.0, 16.0),
                        "suffix_decoding_min_token_prob": st.floats(0.0, 1.0)}
            for field in draw(st.sets(st.sampled_from(sorted(optional)))):
                spec[field] = draw(optional[field])
        engines[f"{method.replace('_', '-')}{i}"] = spec
    return engines


def speculative_names(engines: dict[str, dict[str, Any]]) -> list[str]:
    return [n for n, e in engines.items() if e["method"] != "none"]


@st.composite
def thens(draw: st.DrawFn, engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    name = draw(st.sampled_from(sorted(engines)))
    then: dict[str, Any] = {"engine": name}
    engine = engines[name]
    if engine["method"] != "none" and draw(st.booleans()):
        then["num_speculative_tokens"] = draw(st.integers(1, engine["num_speculative_tokens"]))
    return then


@st.composite
def label_predicates(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(LABEL_KEYS), min_size=1, max_size=2, unique=True))
    out: dict[str, Any] = {}
    for key in keys:
        if draw(st.booleans()):
            out[key] = draw(st.sampled_from(LABEL_VALUES))
        else:
            out[key] = draw(st.lists(st.sampled_from(LABEL_VALUES), min_size=1, max_size=3))
    return out


@st.composite
def whens(draw: st.DrawFn, with_route: bool | None = None) -> dict[str, Any]:
    """A rule's predicates; ``with_route`` forces a route predicate on or off."""
    when: dict[str, Any] = {}
    if with_route is None:
        # Most real rules have a route, and a route makes a rule less likely to
        # shadow a later one: bias towards it.
        with_route = draw(st.integers(0, 4)) > 0
    if with_route:
        # Not unique on purpose: a repeated route is legal and must not matter.
        when["route"] = draw(st.lists(st.sampled_from(ROUTES), min_size=1, max_size=3))
    for field in draw(st.sets(st.sampled_from(NON_ROUTE_PREDICATES), max_size=4)):
        if field == "model":
            when["model"] = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=2))
        elif field in ("batch_size", "max_tokens", "prompt_tokens"):
            when[field] = draw(ranges())
        elif field == "labels":
            when["labels"] = draw(label_predicates())
        else:
            when[field] = draw(st.booleans())
    return when


@st.composite
def raw_documents(draw: st.DrawFn, route_modes: st.SearchStrategy[bool | None] | None = None,
                  min_rules: int = 0, max_rules: int = 8, exploration: bool | None = None
                  ) -> dict[str, Any]:
    """A raw document that is valid except, possibly, for shadowed rules."""
    engines = draw(engine_sets())
    modes = route_modes if route_modes is not None else st.just(None)
    rules = []
    for i in range(draw(st.integers(min_rules, max_rules))):
        rule: dict[str, Any] = {"name": f"rule-{i}", "then": draw(thens(engines))}
        when = draw(whens(draw(modes)))
        spell_out_empty_when = draw(st.booleans())
        if when or spell_out_empty_when:
            rule["when"] = when
        rules.append(rule)
    doc: dict[str, Any] = {
        "apiVersion": "specgate/v1",
        "name": draw(st.sampled_from(("fleet", "p", "policy-2"))),
        "engines": engines,
        "default": draw(thens(engines)),
    }
    spell_out_no_rules = draw(st.booleans())
    if rules or spell_out_no_rules:
        doc["rules"] = rules
    if draw(st.booleans()):
        doc["plain_engine"] = "base"
    speculative = speculative_names(engines)
    want_exploration = draw(st.booleans()) if exploration is None else exploration
    if want_exploration and speculative:
        doc["exploration"] = {
            "rate": draw(st.one_of(st.just(0.5), st.floats(0.0, 0.5, exclude_min=True))),
            "speculative_engine": draw(st.sampled_from(speculative)),
        }
        if draw(st.integers(0, 2)) == 0:  # a switchback: exploration by time window
            doc["exploration"]["window_s"] = draw(st.one_of(st.sampled_from((1, 10, 60)),
                                                            st.floats(1.0, 86400.0)))
    elif draw(st.integers(0, 4)) == 0:
        doc["exploration"] = {"rate": 0.0}
    return doc


_SHADOWED = re.compile(r"^rules\[(\d+)\]$")


def validate_generated(raw: dict[str, Any]) -> PolicyDocument:
    """Validate a generated document, dropping the rules validation calls shadowed.

    Dropping a shadowed rule never un-shadows another (coverage is
    transitive), so this converges. Any other error means the generator (or the
    validator) is wrong, and fails the test rather than being filtered out.
    """
    raw = dict(raw)
    while True:
        try:
            return validate_data(raw)
        except PolicyValidationError as exc:
            others = [e for e in exc.errors if e.code != "shadowed_rule"]
            assert not others, f"generated a document the validator rejects: {others}\n{raw}"
            shadowed = set()
            for err in exc.errors:
                match = _SHADOWED.match(err.path)
                assert match, err
                shadowed.add(int(match.group(1)))
            raw["rules"] = [r for i, r in enumerate(raw["rules"]) if i not in shadowed]


present_request_ids = st.one_of(st.text(max_size=12), st.integers(0, 10**9).map(lambda i: f"req-{i}"))
request_ids = st.one_of(st.none(), present_request_ids)

shapes = st.builds(
    RequestShape,
    route=st.sampled_from((*ROUTES, "default", "other")),
    model=st.sampled_from((*MODELS, "")),
    batch_size=st.integers(0, BOUND + 2),
    structured_output=st.booleans(),
    tools=st.booleans(),
    stream=st.booleans(),
    max_tokens=st.one_of(st.none(), st.integers(0, BOUND + 2)),
    prompt_tokens=st.integers(0, BOUND + 2),
    labels=st.dictionaries(st.sampled_from((*LABEL_KEYS, "other")), st.sampled_from((*LABEL_VALUES, "z")),
                           max_size=3),
    request_id=request_ids,
    arrival_time=st.one_of(st.none(), st.floats(0.0, 4e9), st.integers(1_700_000_000, 1_800_000_000).map(float)),
)


def witness_shapes(doc: PolicyDocument) -> list[RequestShape]:
    """Shapes aimed at each rule: one that satisfies it, and its range boundaries.

    Random shapes rarely satisfy a rule with four predicates; these make sure
    every rule's matching path (and the values just outside each range) is
    exercised.
    """
    out: list[RequestShape] = []
    for i, rule in enumerate(doc.rules):
        w = rule.when
        base = RequestShape(
            route=w.route[0] if w.route else "other",
            model=w.model[0] if w.model else "m1",
            batch_size=_inside(w.batch_size),
            max_tokens=_inside(w.max_tokens),
            prompt_tokens=_inside(w.prompt_tokens),
            structured_output=bool(w.structured_output),
            tools=bool(w.tools),
            stream=bool(w.stream),
            labels={k: sorted(v)[0] for k, v in w.label_sets().items()},
            request_id=f"witness-{i}",
        )
        out.append(base)
        for field in ("batch_size", "max_tokens", "prompt_tokens"):
            r = getattr(w, field)
            if r is None:
                continue
            for edge in (r.min, r.max):
                if edge is None:
                    continue
                for value in (edge - 1, edge, edge + 1):
                    if value >= 0:
                        out.append(_replace(base, **{field: value}))
        if w.max_tokens is not None:
            out.append(_replace(base, max_tokens=None))
        if w.route is not None:
            out.append(_replace(base, route="other"))
    return out


def _inside(r: Any) -> int:
    if r is None:
        return 1
    return int(r.min if r.min is not None else r.max)


def _replace(shape: RequestShape, **changes: Any) -> RequestShape:
    data = shape.to_dict()
    data.update(changes)
    return RequestShape(**data)


def _other_predicates(rule: dict[str, Any]) -> str:
    """A rule's predicates other than batch_size, in a normal form (its group, for an in-engine engine)."""
    when = {k: v for k, v in rule.get("when", {}).items() if k != "batch_size"}
    for name in ("route", "model"):
        if name in when:
            when[name] = sorted(set(when[name]))
    if "labels" in when:
        when["labels"] = {k: sorted(set([v] if isinstance(v, str) else v)) for k, v in when["labels"].items()}
    return repr(sorted(when.items()))


@st.composite
def in_engine_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A raw document with one speculative engine marked ``schedule: in_engine``, repaired into one the validator
    accepts but for shadowed rules: one group of rules for that engine, none of them with a range below batch 1,
    and neither the default nor exploration sending requests there."""
    raw = draw(raw_documents(min_rules=1))
    speculative = [n for n in speculative_names(raw["engines"]) if raw["engines"][n]["method"] in IN_ENGINE_METHODS]
    if not speculative:
        raw["engines"]["in-engine"] = {"method": "ngram", "num_speculative_tokens": draw(st.integers(1, 16))}
        speculative = ["in-engine"]
    engine = draw(st.sampled_from(speculative))
    raw["engines"][engine] = {**raw["engines"][engine], "schedule": "in_engine"}
    if raw["default"]["engine"] == engine:
        raw["default"] = {"engine": "base"}
    if raw.get("exploration", {}).get("speculative_engine") == engine:
        del raw["exploration"]
    group: str | None = None
    kept = []
    for rule in raw.get("rules", []):
        if rule["then"]["engine"] == engine:
            batch = rule.get("when", {}).get("batch_size") or {}
            if batch.get("max") is not None and batch["max"] < 1:
                continue  # holds no batch the engine runs: refused for an in-engine engine
            key = _other_predicates(rule)
            group = key if group is None else group
            if key != group:
                continue
        kept.append(rule)
    raw["rules"] = kept
    return raw
