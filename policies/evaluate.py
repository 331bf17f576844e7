"""Turning a document into decisions.

Two readings of the same document:

* :func:`interpret` is the reference: a loop over the rules that reads like
  the specification. It is what the compiled form is tested against.
* :func:`compile_policy` builds the fast path. Rules are partitioned by
  route (the predicate almost every rule has) into one generated function per
  route, so a request only looks at the rules that could apply to it, and
  every possible Decision is built once, up front: deciding allocates nothing.

A rule without a route applies to every route. Copying such rules into every
route's function gives the fastest code, but costs routes x rules to compile
(a 46 KB document once took 35 s and 2.4 GiB), so they are copied only while
the copies stay within :data:`INLINE_BUDGET`. Beyond it they are compiled once,
shared by all routes: the prefix before any routed rule runs ahead of the
dispatch, and the rest is one function that every route asks, at most once
per decision, which of them matches first. Either way the generated code is
linear in the document; validation bounds what a document may ask for
(``policies.validate.MAX_COMPILED_TESTS``, counted by :func:`compiled_tests`).
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import hmac
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from policies.model import PlainEngine, PolicyDocument, Range, Rule, Then, When, engine_k
from policies.schedule import catch_alls
from policies.shape import Decision, RequestShape, sticky_fraction

KILL_SWITCH_RULE = "kill-switch"
DEFAULT_RULE = "default"


def exploration_salt(policy_name: str, cohort_secret: str = "") -> str:
    """The salt of a policy's exploration split.

    Without a secret it is public, ``"explore:" + policy_name``, as the shared vectors pin. Anyone who knows
    the policy name can then compute which request ids are explored and pick a cohort by choosing an id. With
    a secret it is the hex HMAC-SHA256, keyed by the secret, of that same string: stable for as long as the
    secret is, and unpredictable without it.
    """
    return _salt(f"explore:{policy_name}", cohort_secret)


def shadow_salt(policy_name: str, cohort_secret: str = "") -> str:
    """The salt of a policy's shadow-comparison sample (``quality``): ``"shadow:" + policy_name``, keyed by
    the secret as :func:`exploration_salt` is. Its own salt, so the shadowed requests are independent of the
    explored ones."""
    return _salt(f"shadow:{policy_name}", cohort_secret)


def raw_sample_salt(policy_name: str, cohort_secret: str = "") -> str:
    """The salt of a policy's raw-event sample (``telemetry.raw_sample_rate``): ``"raw:" + policy_name``,
    keyed by the secret as :func:`exploration_salt` is; independent of the explored and shadowed requests."""
    return _salt(f"raw:{policy_name}", cohort_secret)


def _salt(public: str, cohort_secret: str) -> str:
    if not cohort_secret:
        return public
    key = cohort_secret.encode("utf-8", errors="surrogatepass")
    return hmac.new(key, public.encode("utf-8", errors="surrogatepass"), hashlib.sha256).hexdigest()


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
    """The other decision an explored request gets, or None when there is none.

    A decision without drafts on a speculative engine (an in-engine schedule's K 0) is explored on the plain
    engine: that measures what its K=0 steps cost against not speculating at all (BENCHMARKS.md, "In-engine
    schedules"); the engine itself cannot be made to draft for one request.
    """
    if decision.speculate or not isinstance(doc.engines[decision.engine], PlainEngine):
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


def matches(when: When, shape: RequestShape, engine: str | None = None) -> bool:
    """Whether ``when`` holds for ``shape``; a batch predicate reads the batch of ``engine``, the engine the
    rule decides for (the shape's ``engine_batch``), else the shape's ``batch_size``."""
    if when.route is not None and shape.route not in when.route:
        return False
    if when.model is not None and shape.model not in when.model:
        return False
    if not _in_range(when.batch_size, shape.batch_size if engine is None else shape.batch_for(engine)):
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


def routed_rules(doc: PolicyDocument) -> list[tuple[Rule, bool]]:
    """The rules in the order the router tries them, each with whether it serves without drafts.

    An engine with ``schedule: in_engine`` applies its rules' batch ranges itself (policies.schedule). Its rules
    decide as written, with the batch the router sees; after the last rule of each group (rules for that engine
    whose other predicates are equal) comes the group's catch-all: its predicates without the batch, its first
    rule's name, the same engine with K 0. A request no range of the group holds is served there without drafts
    (where the engine's schedule says 0) instead of falling through to the rules after it.
    """
    in_engine = doc.in_engine_schedules
    if not in_engine:
        return [(rule, False) for rule in doc.rules]
    after: dict[int, list[Rule]] = {}
    for catch_all in catch_alls(enumerate(doc.rules), in_engine):
        after.setdefault(catch_all.after, []).append(catch_all.rule)
    routed: list[tuple[Rule, bool]] = []
    for index, rule in enumerate(doc.rules):
        routed.append((rule, False))
        routed += [(extra, True) for extra in after.get(index, ())]
    return routed


def _routed_decision(doc: PolicyDocument, rule: Rule, without_drafts: bool, revision: str) -> Decision:
    if without_drafts:
        return Decision(rule.then.engine, False, 0, rule.name, doc.name, revision)
    return _decision_for(doc, rule.then, rule.name, revision)


def interpret(doc: PolicyDocument, shape: RequestShape, revision: str = "", *,
              cohort_secret: str = "") -> Decision:
    decision = _decision_for(doc, doc.default, DEFAULT_RULE, revision)
    for rule, without_drafts in routed_rules(doc):
        if matches(rule.when, shape, rule.then.engine):
            decision = _routed_decision(doc, rule, without_drafts, revision)
            break
    rate = doc.exploration.rate
    key = exploration_key(shape, doc.exploration.window_s)
    if rate > 0 and key is not None:
        if sticky_fraction(key, exploration_salt(doc.name, cohort_secret)) < rate:
            alternative = _explored_alternative(doc, decision)
            if alternative is not None:
                return alternative
    return decision


# --- the compiler ----------------------------------------------------------------

# Route-less rules are copied into every route's function while the copies (in tests, as compiled_tests counts
# them) stay at or under this: about 50 ms of compiling. bench/policies/fifty_rules.yaml needs 288, and so
# decides with exactly the code it had before sharing existed.
INLINE_BUDGET = 4096


# What one route adds besides its rules (its function, the loads at its top, its default, its entry in the
# dispatch table), in tests: measured, a route costs about as much to compile as two tests.
ROUTE_COST = 2


def compiled_tests(rule: Rule) -> int:
    """What one rule costs the compiled form: its line and its tests, once per route it names (once with none).

    The route itself is never tested: it picks the function the rule is compiled into.
    """
    routes = len(set(rule.when.route)) if rule.when.route is not None else 1
    return (1 + rule.when.test_count()) * routes


def compiled_size(rules: Iterable[Rule]) -> int:
    """What rules cost the compiled form, in tests: theirs (:func:`compiled_tests`) and their routes'.

    Route-less rules count once: past :data:`INLINE_BUDGET` they are compiled once, not per route.
    """
    routes: set[str] = set()
    total = 0
    for rule in rules:
        total += compiled_tests(rule)
        routes.update(rule.when.route or ())
    return total + ROUTE_COST * len(routes)


class CompiledPolicy:
    """A document compiled into one decision function; immutable once built."""

    __slots__ = ("document", "revision", "name", "decide", "kill_switch_decision",
                 "fallback_engine", "_source", "shadow_rate", "_shadow_routes", "_shadow_salt",
                 "raw_sample_rate", "_raw_sample_salt")

    def __init__(self, document: PolicyDocument, revision: str, *, cohort_secret: str = "") -> None:
        self.document = document
        self.revision = revision
        self.name = document.name
        self.fallback_engine = document.resolved_plain_engine
        self.kill_switch_decision = Decision(self.fallback_engine, False, 0, KILL_SWITCH_RULE,
                                             document.name, revision)
        # The secret is used for the salt and not kept: nothing reachable from the object can reveal it.
        fn, source = _build(document, revision, exploration_salt(document.name, cohort_secret))
        self.decide: Callable[[RequestShape], Decision] = fn
        self._source = source
        quality = document.quality
        self.shadow_rate = 0.0 if quality is None else quality.shadow_rate
        self._shadow_routes = None if quality is None or quality.routes is None else frozenset(quality.routes)
        self._shadow_salt = shadow_salt(document.name, cohort_secret)
        self.raw_sample_rate = 1.0 if document.telemetry is None else document.telemetry.raw_sample_rate
        self._raw_sample_salt = raw_sample_salt(document.name, cohort_secret)

    @property
    def pre_aggregated(self) -> bool:
        """Whether workers report this policy's requests as rollup deltas plus a raw sample (``telemetry``)."""
        return self.raw_sample_rate < 1.0

    def raw_sampled(self, request_id: str) -> bool:
        """Whether a request's raw event is sent (``telemetry.raw_sample_rate``): every one at rate 1, else
        those whose ``sticky_fraction(request_id, raw_sample_salt)`` falls below the rate. Sticky, so a request
        retried under its id is sampled or not both times."""
        rate = self.raw_sample_rate
        return rate >= 1.0 or sticky_fraction(request_id, self._raw_sample_salt) < rate

    def shadowed(self, shape: RequestShape, decision: Decision) -> bool:
        """Whether a request so decided is sampled for a shadow comparison (``quality``): a speculative
        decision on one of the section's routes (any route without a list) whose request id falls in the
        sample, ``sticky_fraction(request_id, shadow_salt) < shadow_rate``. Whether the request can be compared
        (greedy, one choice, served as decided) is the sidecar's to check."""
        if not decision.speculate or self.shadow_rate <= 0.0:
            return False
        request_id = shape.request_id
        if request_id is None:
            return False
        routes = self._shadow_routes
        if routes is not None and shape.route not in routes:
            return False
        return sticky_fraction(request_id, self._shadow_salt) < self.shadow_rate

    def __repr__(self) -> str:
        return f"CompiledPolicy(name={self.name!r}, revision={self.revision[:12]!r})"


def compile_policy(document: PolicyDocument, revision: str = "", *, cohort_secret: str = "") -> CompiledPolicy:
    return CompiledPolicy(document, revision, cohort_secret=cohort_secret)


class _Emitter:
    """Collects constants so generated code refers to names, never to user text."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {}
        self.engines: dict[str, int] = {}

    def const(self, value: Any) -> str:
        name = f"_c{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def engine_index(self, engine: str) -> int:
        """A number per engine name whose batch rules test, and the constant ``_e<number>`` naming it."""
        index = self.engines.get(engine)
        if index is None:
            index = self.engines[engine] = len(self.engines)
            self.namespace[f"_e{index}"] = engine
        return index


# What a condition adds to the attributes it reads for the batch of one engine: this prefix and the variable
_ENGINE_BATCH = "engine_batch:"


def _range_test(var: str, r: Range, may_be_none: bool) -> str:
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


def _condition(em: _Emitter, when: When, used: set[str], engine: str) -> str:
    tests: list[str] = []
    if when.model is not None:
        used.add("model")
        tests.append(f"model in {em.const(frozenset(when.model))}")
    if when.batch_size is not None:
        # The batch of the rule's own engine, computed once per call at the top of the function (_function)
        var = f"_b{em.engine_index(engine)}"
        used.add(_ENGINE_BATCH + var)
        tests.append(_range_test(var, when.batch_size, False))
    if when.max_tokens is not None:
        used.add("max_tokens")
        tests.append(_range_test("max_tokens", when.max_tokens, True))
    if when.prompt_tokens is not None:
        used.add("prompt_tokens")
        tests.append(_range_test("prompt_tokens", when.prompt_tokens, False))
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


@dataclass(frozen=True, slots=True)
class _Piece:
    """One rule as generated code, made once however many functions it goes into."""

    position: int
    routes: tuple[str, ...] | None  # distinct, in document order; None: every route
    condition: str  # "True" when it always holds
    used: frozenset[str]  # the shape's attributes the condition reads
    outcome: str  # the expression the function returns when it holds
    tests: int  # compiled_tests of the rule


def _chain(pieces: Iterable[_Piece], lines: list[str], used: set[str]) -> bool:
    """Appends first-match-wins tests, and the attributes they read to ``used``; True when one always holds,
    so that nothing after it can run (nor load attributes)."""
    for piece in pieces:
        used |= piece.used
        if piece.condition == "True":
            lines.append(f"    return {piece.outcome}")
            return True
        lines.append(f"    if {piece.condition}:")
        lines.append(f"        return {piece.outcome}")
    return False


def _function(name: str, used: Iterable[str], lines: list[str]) -> str:
    attrs = set(used)
    batches = sorted(attr[len(_ENGINE_BATCH):] for attr in attrs if attr.startswith(_ENGINE_BATCH))
    attrs.difference_update(_ENGINE_BATCH + var for var in batches)
    if batches:
        attrs.update(("batch_size", "engine_batch"))
    loads = [f"    {attr} = s.{attr}" for attr in sorted(attrs)]
    # Without per-engine batches (a worker whose engines share one accelerator) every engine's batch is the
    # shape's batch_size; with them (replica pools) each engine's is looked up once per call.
    for var in batches:
        loads.append(f"    {var} = batch_size if engine_batch is None else engine_batch.get(_e{var[2:]}, batch_size)")
    return "\n".join([f"def {name}(s):", *loads, *lines])


def _build(doc: PolicyDocument, revision: str, salt: str) -> tuple[Callable[[RequestShape], Decision], str]:
    em = _Emitter()
    rate = doc.exploration.rate
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

    def outcome(decision: Decision, alternative: Decision | None) -> str:
        d = em.const(decision)
        if alternative is None or rate <= 0:
            return d
        return f"_explore({d}, {em.const(alternative)}, s)"

    pieces: list[_Piece] = []
    decisions: list[tuple[Decision, Decision | None]] = []
    for position, (rule, without_drafts) in enumerate(routed_rules(doc)):
        decision = _routed_decision(doc, rule, without_drafts, revision)
        alternative = _explored_alternative(doc, decision)
        reads: set[str] = set()
        condition = _condition(em, rule.when, reads, rule.then.engine)
        routes = tuple(dict.fromkeys(rule.when.route)) if rule.when.route is not None else None
        pieces.append(_Piece(position, routes, condition, frozenset(reads), outcome(decision, alternative),
                             compiled_tests(rule)))
        decisions.append((decision, alternative))
    default_decision = _decision_for(doc, doc.default, DEFAULT_RULE, revision)
    default = outcome(default_decision, _explored_alternative(doc, default_decision))

    # Each route's own rules, in document order, built in one pass so that the work is the (rule, route) pairs
    # the document names and not rules x routes.
    routed: dict[str, list[_Piece]] = {}
    for piece in pieces:
        for route in piece.routes or ():
            routed.setdefault(route, []).append(piece)
    free = [p for p in pieces if p.routes is None]
    fnames = {route: f"_route_{i}" for i, route in enumerate(routed)}

    sources: list[str] = []
    head: list[str] = []
    head_used: set[str] = set()
    done = False
    if (len(routed) + 1) * sum(p.tests for p in free) <= INLINE_BUDGET:
        _inline_free_rules(free, routed, fnames, default, sources)
    else:
        done = _shared_free_rules(em, pieces, free, decisions, routed, fnames, default, rate, sources, head,
                                  head_used)

    table = ", ".join(f"{em.const(route)}: {fname}" for route, fname in fnames.items())
    if not done:
        head.append("    return _get(s.route, _other_routes)(s)")
    sources.append(f"_by_route = {{{table}}}\n_get = _by_route.get\n" + _function("decide", head_used, head))
    source = "\n\n".join(sources)
    namespace = em.namespace
    exec(compile(source, f"<policy {doc.name} {revision[:12]}>", "exec"), namespace)  # noqa: S102
    fn: Callable[[RequestShape], Decision] = namespace["decide"]
    return fn, source


def _inline_free_rules(free: list[_Piece], routed: dict[str, list[_Piece]], fnames: dict[str, str],
                       default: str, sources: list[str]) -> None:
    """Every route's function holds its own rules and the route-less ones, merged in document order."""
    for route, own in routed.items():
        lines: list[str] = []
        used: set[str] = set()
        if not _chain(heapq.merge(own, free, key=lambda p: p.position), lines, used):
            lines.append(f"    return {default}")
        sources.append(_function(fnames[route], used, lines))
    lines = []
    used = set()
    if not _chain(free, lines, used):
        lines.append(f"    return {default}")
    sources.append(_function("_other_routes", used, lines))


def _shared_free_rules(em: _Emitter, pieces: list[_Piece], free: list[_Piece],
                       decisions: list[tuple[Decision, Decision | None]], routed: dict[str, list[_Piece]],
                       fnames: dict[str, str], default: str, rate: float, sources: list[str],
                       head: list[str], head_used: set[str]) -> bool:
    """Route-less rules compiled once. Appends to ``head`` what ``decide`` runs before its dispatch (and to
    ``head_used`` what that reads); True when that always returns.

    Those before the first routed rule come first for every route, so ``decide`` tests them itself. The others
    are ``_free(s)``: the index (among them) of the first that holds, or their count. A route's function calls
    it once, where the first of them comes before one of its own rules, and from then on compares the index
    with the number of them that come before each of its rules.
    """
    first_routed = min((p.position for p in pieces if p.routes is not None), default=len(pieces))
    prefix = [p for p in free if p.position < first_routed]
    rest = [p for p in free if p.position > first_routed]
    positions = [p.position for p in rest]

    lines: list[str] = []
    used: set[str] = set()
    for i, piece in enumerate(rest):
        used |= piece.used
        if piece.condition == "True":
            lines.append(f"    return {i}")
            break
        lines.append(f"    if {piece.condition}:")
        lines.append(f"        return {i}")
    else:
        lines.append(f"    return {len(rest)}")
    sources.append(_function("_free", used, lines))
    chosen = [decisions[p.position] for p in rest]
    em.namespace["_fd"] = tuple(d for d, _ in chosen)
    # A rule without an alternative explores to itself: the same decision, whichever way the split goes.
    em.namespace["_fa"] = tuple(a if a is not None else d for d, a in chosen)
    explored = rate > 0 and any(a is not None for _, a in chosen)
    free_outcome = "_explore(_fd[i], _fa[i], s)" if explored else "_fd[i]"

    def route_function(name: str, own: list[_Piece]) -> str:
        body: list[str] = []
        used: set[str] = set()
        ruled_out = 0  # how many of `rest` an earlier test has already found not to hold
        asked = False
        for piece in [*own, None]:
            before = bisect.bisect_left(positions, piece.position) if piece is not None else len(rest)
            if before > ruled_out:
                if not asked:
                    body.append("    i = _free(s)")
                    asked = True
                body.append(f"    if i < {before}:")
                body.append(f"        return {free_outcome}")
                ruled_out = before
            if piece is None:
                body.append(f"    return {default}")
            elif _chain([piece], body, used):
                break
        return _function(name, used, body)

    for route, own in routed.items():
        sources.append(route_function(fnames[route], own))
    sources.append(route_function("_other_routes", []))
    return _chain(prefix, head, head_used)
