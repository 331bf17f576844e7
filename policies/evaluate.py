"""Turning a document into decisions.

Two readings of the same document:

* :func:`interpret` is the reference: a loop over the rules that reads like
  the specification. It is what the compiled form is tested against.
* :func:`compile_policy` builds the fast path. Rules are partitioned by
  route (the predicate almost every rule has) into one generated function per
  route, so a request only looks at the rules that could apply to it, and
  every possible Decision is built once, up front: deciding allocates nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from policies.model import PlainEngine, PolicyDocument, Range, Rule, Then, When, engine_k
from policies.shape import Decision, RequestShape, sticky_fraction

KILL_SWITCH_RULE = "kill-switch"
DEFAULT_RULE = "default"


def exploration_salt(policy_name: str) -> str:
    return f"explore:{policy_name}"


def exploration_key(shape: RequestShape, window_s: float | None) -> str | None:
    """What the exploration split hashes: the request id, or with ``window_s`` the time window.

    A window's key is ``"window:"`` and the decimal index ``floor(arrival_time / window_s)``, so every
    worker that runs the policy with a clock in sync explores the same windows. None explores nothing.
    """
    if window_s is None:
        return shape.request_id
    if shape.arrival_time is None:
        return None
    return f"window:{math.floor(shape.arrival_time / window_s)}"


def _decision_for(doc: PolicyDocument, then: Then, rule: str, revision: str) -> Decision:
    engine = doc.engines[then.engine]
    k = then.num_speculative_tokens or engine_k(engine)
    return Decision(then.engine, not isinstance(engine, PlainEngine), k, rule, doc.name, revision)


def _explored_alternative(doc: PolicyDocument, decision: Decision) -> Decision | None:
    """The other decision an explored request gets, or None when there is none."""
    if decision.speculate:
        target = doc.resolved_plain_engine
    else:
        if doc.exploration.speculative_engine is None:
            return None
        target = doc.exploration.speculative_engine
    engine = doc.engines[target]
    return Decision(target, not isinstance(engine, PlainEngine), engine_k(engine), decision.rule,
                    doc.name, decision.revision, explored=True)


# --- the reference interpreter -------------------------------------------------

def _in_range(r: Range | None, value: int | None) -> bool:
    if r is None:
        return True
    if value is None:
        return False
    return r.contains(value)


def matches(when: When, shape: RequestShape) -> bool:
    if when.route is not None and shape.route not in when.route:
        return False
    if when.model is not None and shape.model not in when.model:
        return False
    if not _in_range(when.batch_size, shape.batch_size):
        return False
    if not _in_range(when.max_tokens, shape.max_tokens):
        return False
    if not _in_range(when.prompt_tokens, shape.prompt_tokens):
        return False
    if when.structured_output is not None and shape.structured_output != when.structured_output:
        return False
    if when.tools is not None and shape.tools != when.tools:
        return False
    if when.stream is not None and shape.stream != when.stream:
        return False
    for key, allowed in when.label_sets().items():
        if shape.labels.get(key) not in allowed:
            return False
    return True


def interpret(doc: PolicyDocument, shape: RequestShape, revision: str = "") -> Decision:
    decision = _decision_for(doc, doc.default, DEFAULT_RULE, revision)
    for rule in doc.rules:
        if matches(rule.when, shape):
            decision = _decision_for(doc, rule.then, rule.name, revision)
            break
    rate = doc.exploration.rate
    key = exploration_key(shape, doc.exploration.window_s)
    if rate > 0 and key is not None:
        if sticky_fraction(key, exploration_salt(doc.name)) < rate:
            alternative = _explored_alternative(doc, decision)
            if alternative is not None:
                return alternative
    return decision


# --- the compiler ----------------------------------------------------------------

class CompiledPolicy:
    """A document compiled into one decision function; immutable once built."""

    __slots__ = ("document", "revision", "name", "decide", "kill_switch_decision",
                 "fallback_engine", "_source")

    def __init__(self, document: PolicyDocument, revision: str) -> None:
        self.document = document
        self.revision = revision
        self.name = document.name
        self.fallback_engine = document.resolved_plain_engine
        self.kill_switch_decision = Decision(self.fallback_engine, False, 0, KILL_SWITCH_RULE,
                                             document.name, revision)
        fn, source = _build(document, revision)
        self.decide: Callable[[RequestShape], Decision] = fn
        self._source = source

    def __repr__(self) -> str:
        return f"CompiledPolicy(name={self.name!r}, revision={self.revision[:12]!r})"


def compile_policy(document: PolicyDocument, revision: str = "") -> CompiledPolicy:
    return CompiledPolicy(document, revision)


class _Emitter:
    """Collects constants so generated code refers to names, never to user text."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {}

    def const(self, value: Any) -> str:
        name = f"_c{len(self.namespace)}"
        self.namespace[name] = value
        return name


def _range_test(em: _Emitter, var: str, r: Range, may_be_none: bool) -> str:
    parts = []
    if may_be_none:
        parts.append(f"{var} is not None")
    if r.min is not None and r.max is not None:
        parts.append(f"{r.min} <= {var} <= {r.max}")
    elif r.min is not None:
        parts.append(f"{var} >= {r.min}")
    else:
        parts.append(f"{var} <= {r.max}")
    return " and ".join(parts)


def _condition(em: _Emitter, when: When, used: set[str], route_known: bool) -> str:
    tests: list[str] = []
    if when.route is not None and not route_known:
        used.add("route")
        tests.append(f"route in {em.const(frozenset(when.route))}")
    if when.model is not None:
        used.add("model")
        tests.append(f"model in {em.const(frozenset(when.model))}")
    if when.batch_size is not None:
        used.add("batch_size")
        tests.append(_range_test(em, "batch_size", when.batch_size, False))
    if when.max_tokens is not None:
        used.add("max_tokens")
        tests.append(_range_test(em, "max_tokens", when.max_tokens, True))
    if when.prompt_tokens is not None:
        used.add("prompt_tokens")
        tests.append(_range_test(em, "prompt_tokens", when.prompt_tokens, False))
    for flag in ("structured_output", "tools", "stream"):
        wanted = getattr(when, flag)
        if wanted is not None:
            used.add(flag)
            tests.append(flag if wanted else f"not {flag}")
    for key, allowed in when.label_sets().items():
        used.add("labels")
        key_name = em.const(key)
        if len(allowed) == 1:
            tests.append(f"labels.get({key_name}) == {em.const(next(iter(allowed)))}")
        else:
            tests.append(f"labels.get({key_name}) in {em.const(frozenset(allowed))}")
    return " and ".join(f"({t})" for t in tests) if tests else "True"


def _function_source(em: _Emitter, fname: str, rules: list[tuple[Rule, Decision, Decision | None]],
                     default: tuple[Decision, Decision | None], rate: float, salt: str,
                     route_known: bool) -> str:
    used: set[str] = set()
    body: list[str] = []

    def outcome(decision: Decision, alternative: Decision | None) -> str:
        d = em.const(decision)
        if alternative is None or rate <= 0:
            return f"return {d}"
        return f"return _explore({d}, {em.const(alternative)}, s)"

    for rule, decision, alternative in rules:
        cond = _condition(em, rule.when, used, route_known)
        if cond == "True":
            body.append(f"    {outcome(decision, alternative)}")
            break  # everything after an unconditional rule is unreachable here
        body.append(f"    if {cond}:")
        body.append(f"        {outcome(decision, alternative)}")
    else:
        body.append(f"    {outcome(*default)}")
    loads = [f"    {attr} = s.{attr}" for attr in sorted(used)]
    return "\n".join([f"def {fname}(s):", *loads, *body])


def _build(doc: PolicyDocument, revision: str) -> tuple[Callable[[RequestShape], Decision], str]:
    em = _Emitter()
    rate = doc.exploration.rate
    salt = exploration_salt(doc.name)

    window_s = doc.exploration.window_s

    # Two closures rather than one over exploration_key: the request-id split runs on every request of most
    # policies, and there it saves building a key.
    def explore(decision: Decision, alternative: Decision, shape: RequestShape) -> Decision:
        request_id = shape.request_id
        if request_id is not None and sticky_fraction(request_id, salt) < rate:
            return alternative
        return decision

    def explore_window(decision: Decision, alternative: Decision, shape: RequestShape) -> Decision:
        key = exploration_key(shape, window_s)
        if key is not None and sticky_fraction(key, salt) < rate:
            return alternative
        return decision

    em.namespace["_explore"] = explore if window_s is None else explore_window
    compiled_rules: list[tuple[Rule, Decision, Decision | None]] = []
    for rule in doc.rules:
        decision = _decision_for(doc, rule.then, rule.name, revision)
        compiled_rules.append((rule, decision, _explored_alternative(doc, decision)))
    default_decision = _decision_for(doc, doc.default, DEFAULT_RULE, revision)
    default = (default_decision, _explored_alternative(doc, default_decision))

    routes: list[str] = []
    for rule in doc.rules:
        for route in rule.when.route or ():
            if route not in routes:
                routes.append(route)

    sources: list[str] = []
    by_route: dict[str, str] = {}
    for i, route in enumerate(routes):
        applicable = [r for r in compiled_rules if r[0].when.route is None or route in r[0].when.route]
        fname = f"_route_{i}"
        sources.append(_function_source(em, fname, applicable, default, rate, salt, route_known=True))
        by_route[route] = fname
    unlisted = [r for r in compiled_rules if r[0].when.route is None]
    sources.append(_function_source(em, "_other_routes", unlisted, default, rate, salt, route_known=True))

    table = ", ".join(f"{em.const(route)}: {fname}" for route, fname in by_route.items())
    sources.append(
        f"_by_route = {{{table}}}\n"
        "_get = _by_route.get\n"
        "def decide(s):\n"
        "    return _get(s.route, _other_routes)(s)"
    )
    source = "\n\n".join(sources)
    namespace = em.namespace
    exec(compile(source, f"<policy {doc.name} {revision[:12]}>", "exec"), namespace)  # noqa: S102
    fn: Callable[[RequestShape], Decision] = namespace["decide"]
    return fn, source
