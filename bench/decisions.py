"""How fast is a decision? specgate's compiled policies against the alternatives.

Run ``python -m bench.decisions`` (``--help`` for the knobs). Side by side, in
one process and interleaved, it times:

* ``specgate-seed``: ``policies/examples/seed.yaml`` through
  ``compile_policy(...).decide(shape)``;
* ``hand-written``: the seed rule as a plain Python function of the same
  ``RequestShape`` (the floor);
* ``cel-seed``: the seed rule in cel-python, compiled runner, inputs converted
  with ``celpy.json_to_cel`` on every call (what an integration has to do);
  ``cel-seed-eval`` is the same program on activations built before timing,
  ``cel-seed-interpreted`` the same rule on cel-python's interpreted runner;
* ``unleash-seed``: the seed rule as an Unleash feature flag, evaluated offline
  by the Python SDK on its Rust engine (yggdrasil);
* ``specgate-fifty``: ``bench/policies/fifty_rules.yaml`` (50 rules) through
  ``compile_policy``, on the whole shape mix and (``specgate-fifty-fallthrough``)
  on only the shapes no rule matches, its worst case;
* ``cel-fifty``, ``cel-fifty-chained`` and ``unleash-fifty``: the same 50 rules
  translated mechanically from the document into 50 CEL programs tried in
  order, into one chained CEL expression (``c1 ? "r1" : c2 ? "r2" : ...``), and
  into one Unleash flag whose strategies (in rule order) carry the rule's name
  as a strategy variant;
* ``loop`` and ``noop-call``: an empty loop and a call to a function that does
  nothing, the overheads that every row above includes.

Every sample times ``--iterations`` consecutive calls (fewer for rows so
slow that a sample would last over ``--max-sample-ms``) with
``time.perf_counter_ns`` and divides, so the distributions are of batch means,
not of single calls. "net" figures subtract the median empty-loop time per
iteration; the call overhead stays in, as every caller pays it. Rounds go over
the implementations in a shuffled order, each taking a few samples, so that
drift on a noisy machine spreads over all of them. Before timing, every
implementation decides every shape of the mix and the answers are
cross-checked (speculate or not, and the rule where the implementation can
name it) against :func:`policies.interpret`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import policies
from bench.machine import machine_facts
from policies import CompiledPolicy, PolicyDocument, RequestShape, compile_policy, interpret, load_policy
from policies.model import When

BENCH_DIR = Path(__file__).resolve().parent
SEED_POLICY = Path(policies.__file__).resolve().parent / "examples" / "seed.yaml"
FIFTY_POLICY = BENCH_DIR / "policies" / "fifty_rules.yaml"

SEED_RULE = "chat-low-batch"
DEFAULT_RULE = "default"
SEED_CEL = 'route == "chat" && batch_size <= 4 && !structured_output'
SEED_FLAG = "seed-chat-low-batch"
FIFTY_FLAG = "fleet-fifty"

GOAL_FIFTY_MEDIAN_US = 2.0
GOAL_VS_UNLEASH = 10.0
GOAL_VS_CEL = 25.0
GOAL_VS_HAND = 3.0


# --- the request shapes ------------------------------------------------------------

_ROUTES = (
    ("chat", 30), ("support", 8), ("extract", 6), ("summarize", 6), ("rag", 8), ("code", 7),
    ("code-review", 3), ("translate", 4), ("classify", 3), ("moderate", 1), ("agent", 6),
    ("reasoning", 4), ("batch", 3), ("eval", 1), ("creative", 3),
    # routes no rule names: the compiled policy sends them to its route-free rules
    ("embed-rerank", 3), ("default", 3),
)
_MODELS = (("llama-3.1-70b", 35), ("llama-3.3-70b", 15), ("llama-3.1-8b", 25), ("deepseek-v3", 10),
           ("qwen3-32b", 10), ("mistral-small", 5))
_MAX_TOKENS = (None, 16, 24, 32, 64, 100, 128, 256, 300, 512, 1000, 1024, 2048, 4096, 8192)


def make_shapes(count: int = 1000, seed: int = 20250101) -> list[RequestShape]:
    """A fixed mix of request shapes: the same ``seed`` gives the same list."""
    rng = random.Random(seed)
    routes, route_weights = zip(*_ROUTES, strict=True)
    models, model_weights = zip(*_MODELS, strict=True)
    shapes = []
    for _ in range(count):
        labels: dict[str, str] = {}
        if rng.random() < 0.6:
            labels["tenant"] = rng.choice(("acme", "globex", "hooli", "umbrella", "initech-eu", "wayne",
                                           "stark", "tyrell", "soylent"))
        if rng.random() < 0.7:
            labels["tier"] = rng.choice(("free", "standard", "standard", "premium"))
        if rng.random() < 0.3:
            labels["region"] = rng.choice(("eu-west", "us-east", "ap-south"))
        if rng.random() < 0.15:
            labels["agent_step"] = rng.choice(("plan", "act", "reflect"))
        if rng.random() < 0.2:
            labels["priority"] = rng.choice(("low", "normal", "high"))
        # Mostly small batches, with a tail up to 64.
        batch_size = min(64, 1 + int(rng.expovariate(1 / 6)))
        shapes.append(RequestShape(
            route=rng.choices(routes, route_weights)[0],
            model=rng.choices(models, model_weights)[0],
            batch_size=batch_size,
            structured_output=rng.random() < 0.12,
            tools=rng.random() < 0.15,
            stream=rng.random() < 0.6,
            max_tokens=rng.choice(_MAX_TOKENS),
            prompt_tokens=int(rng.lognormvariate(6.5, 1.2)),
            labels=MappingProxyType(labels),
        ))
    return shapes


# --- the implementations ------------------------------------------------------------

def hand_written(s: RequestShape) -> bool:
    """The seed rule, written by hand: the floor for any decision function."""
    return s.route == "chat" and s.batch_size <= 4 and not s.structured_output


def _noop(s: RequestShape) -> None:
    return None


@dataclass
class Impl:
    """One timed way of deciding.

    ``decide`` is what gets timed; ``rule_of`` turns its result into the name of
    the rule that decided (``default`` when none did), for the cross-check.
    """

    key: str
    policy: str  # "seed", "fifty" or "" for the overhead rows
    label: str
    decide: Callable[[RequestShape], Any]
    rule_of: Callable[[Any], str] | None = None
    speculate_of: Callable[[Any], bool] | None = None
    shapes: list[RequestShape] | None = None  # None: the common mix
    empty_loop: bool = False


@dataclass
class Policies:
    seed_doc: PolicyDocument
    fifty_doc: PolicyDocument
    seed: CompiledPolicy
    fifty: CompiledPolicy

    def speculates(self, policy: str, rule: str) -> bool:
        doc = self.seed_doc if policy == "seed" else self.fifty_doc
        then = doc.default if rule == DEFAULT_RULE else next(r.then for r in doc.rules if r.name == rule)
        return then.engine != doc.resolved_plain_engine


def load_policies() -> Policies:
    seed_doc = load_policy(SEED_POLICY.read_text())
    fifty_doc = load_policy(FIFTY_POLICY.read_text())
    return Policies(seed_doc, fifty_doc, compile_policy(seed_doc), compile_policy(fifty_doc))


# CEL ---------------------------------------------------------------------------------

def _cel_str(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a CEL string literal


def when_to_cel(when: When) -> str:
    """One rule's ``when`` as a CEL condition over the variables of :func:`cel_activation`."""
    tests: list[str] = []
    for name in ("route", "model"):
        values = getattr(when, name)
        if values is not None:
            tests.append(f"{name} in [{', '.join(_cel_str(v) for v in values)}]")
    for name in ("batch_size", "max_tokens", "prompt_tokens"):
        r = getattr(when, name)
        if r is None:
            continue
        if name == "max_tokens":
            tests.append("has_max_tokens")  # an unset max_tokens matches no range
        if r.min is not None:
            tests.append(f"{name} >= {r.min}")
        if r.max is not None:
            tests.append(f"{name} <= {r.max}")
    for name in ("structured_output", "tools", "stream"):
        wanted = getattr(when, name)
        if wanted is not None:
            tests.append(name if wanted else f"!{name}")
    for key, allowed in when.label_sets().items():
        k = _cel_str(key)
        tests.append(f"{k} in labels && labels[{k}] in [{', '.join(_cel_str(v) for v in sorted(allowed))}]")
    return " && ".join(f"({t})" for t in tests) if tests else "true"


def policy_to_cel(doc: PolicyDocument) -> str:
    """The document's rules, first match wins, as one CEL expression giving the rule's name."""
    expr = _cel_str(DEFAULT_RULE)
    for rule in reversed(doc.rules):
        expr = f"({when_to_cel(rule.when)}) ? {_cel_str(rule.name)} : ({expr})"
    return expr


def cel_program(expr: str, compiled: bool = True) -> Any:
    """A cel-python program for ``expr``.

    cel-python 0.5.0 builds its Lark parser once per process
    (``CELParser.CEL_PARSER``) with the tree class of the first Environment that
    asked for it. The compiled runner needs ``TranspilerTree`` nodes, so after
    any interpreted Environment (``lark.Tree``) a compiled one fails with
    ``AttributeError: 'Tree' object has no attribute 'checked_exception'``.
    Dropping the cached parser whenever the tree class must change fixes that.
    In 0.5.0 the runner class is an argument of ``Environment``, not of
    ``Environment.program``.
    """
    import celpy
    from celpy.celparser import CELParser

    runner = celpy.CompiledRunner if compiled else celpy.InterpretedRunner
    cached = CELParser.CEL_PARSER
    if cached is not None and cached.options.tree_class is not runner.tree_node_class:
        CELParser.CEL_PARSER = None
    env = celpy.Environment(runner_class=runner)
    return env.program(env.compile(expr))


def cel_seed_activation(s: RequestShape) -> Any:
    from celpy.adapter import json_to_cel

    return json_to_cel({"route": s.route, "batch_size": s.batch_size,
                              "structured_output": s.structured_output})


def cel_activation(s: RequestShape) -> Any:
    """Every field a rule may test, as CEL values."""
    from celpy.adapter import json_to_cel

    return json_to_cel({
        "route": s.route, "model": s.model, "batch_size": s.batch_size,
        "structured_output": s.structured_output, "tools": s.tools, "stream": s.stream,
        "has_max_tokens": s.max_tokens is not None,
        "max_tokens": s.max_tokens if s.max_tokens is not None else 0,
        "prompt_tokens": s.prompt_tokens, "labels": dict(s.labels),
    })


def cel_implementations(pols: Policies, shapes: Sequence[RequestShape]) -> list[Impl]:
    import celpy
    from celpy.adapter import json_to_cel

    seed_eval = cel_program(SEED_CEL).evaluate
    seed_interpreted = cel_program(SEED_CEL, compiled=False).evaluate
    chained_eval = cel_program(policy_to_cel(pols.fifty_doc)).evaluate
    rule_evals = [(rule.name, cel_program(when_to_cel(rule.when)).evaluate) for rule in pols.fifty_doc.rules]

    def cel_seed(s: RequestShape) -> Any:
        return seed_eval(json_to_cel({"route": s.route, "batch_size": s.batch_size,
                                      "structured_output": s.structured_output}))

    def cel_seed_interpreted(s: RequestShape) -> Any:
        return seed_interpreted(json_to_cel({"route": s.route, "batch_size": s.batch_size,
                                             "structured_output": s.structured_output}))

    # The evaluate-only row decides pre-built activations; keyed by identity
    # so it can take the same shapes as every other row.
    prebuilt = {id(s): cel_seed_activation(s) for s in shapes}

    def cel_seed_eval(s: RequestShape) -> Any:
        return seed_eval(prebuilt[id(s)])

    def cel_fifty(s: RequestShape) -> str:
        activation = cel_activation(s)
        for name, evaluate in rule_evals:
            matched = evaluate(activation)
            if not isinstance(matched, celpy.celtypes.BoolType):
                raise TypeError(f"CEL rule {name} returned {matched!r}")
            if matched:
                return name
        return DEFAULT_RULE

    def cel_fifty_chained(s: RequestShape) -> Any:
        return chained_eval(cel_activation(s))

    def seed_rule(result: Any) -> str:
        if not isinstance(result, celpy.celtypes.BoolType):
            raise TypeError(f"CEL returned {result!r}")
        return SEED_RULE if result else DEFAULT_RULE

    def fifty_rule(result: Any) -> str:
        if not isinstance(result, (str, celpy.celtypes.StringType)):
            raise TypeError(f"CEL returned {result!r}")
        return str(result)

    return [
        Impl("cel-seed", "seed", "seed rule in cel-python (compiled runner, json_to_cel per call)",
             cel_seed, rule_of=seed_rule),
        Impl("cel-seed-eval", "seed", "same, activation built before timing (evaluate only)",
             cel_seed_eval, rule_of=seed_rule),
        Impl("cel-seed-interpreted", "seed", "seed rule in cel-python, interpreted runner",
             cel_seed_interpreted, rule_of=seed_rule),
        Impl("cel-fifty", "fifty", "50 rules as 50 compiled CEL programs, first match wins",
             cel_fifty, rule_of=fifty_rule),
        Impl("cel-fifty-chained", "fifty", "50 rules as one chained CEL expression (c1 ? r1 : c2 ? ...)",
             cel_fifty_chained, rule_of=fifty_rule),
    ]


# Unleash -------------------------------------------------------------------------------

def _unleash_constraints(when: When) -> list[dict[str, Any]]:
    """One rule's ``when`` as Unleash constraints over :func:`unleash_properties`.

    The SDK hands every context value to the engine as a string (``False``
    arrives as ``"False"``), so strings and flags are ``IN`` lists and ranges
    are ``NUM_GTE`` / ``NUM_LTE``; an unset max_tokens is left out of the
    context, and a numeric constraint on a missing field does not match.
    """
    out: list[dict[str, Any]] = []
    for name in ("route", "model"):
        values = getattr(when, name)
        if values is not None:
            out.append({"contextName": name, "operator": "IN", "values": list(values)})
    for name in ("batch_size", "max_tokens", "prompt_tokens"):
        r = getattr(when, name)
        if r is None:
            continue
        if r.min is not None:
            out.append({"contextName": name, "operator": "NUM_GTE", "value": str(r.min)})
        if r.max is not None:
            out.append({"contextName": name, "operator": "NUM_LTE", "value": str(r.max)})
    for name in ("structured_output", "tools", "stream"):
        wanted = getattr(when, name)
        if wanted is not None:
            out.append({"contextName": name, "operator": "IN", "values": [str(wanted)]})
    for key, allowed in when.label_sets().items():
        out.append({"contextName": f"label_{key}", "operator": "IN", "values": sorted(allowed)})
    return out


def unleash_features(pols: Policies) -> dict[str, Any]:
    """An Unleash client-features document: the seed rule and the 50-rule policy as flags."""
    seed_rule = pols.seed_doc.rules[0]
    seed = {
        "name": SEED_FLAG, "type": "release", "project": "default", "enabled": True,
        "strategies": [{"name": "default", "parameters": {},
                        "constraints": _unleash_constraints(seed_rule.when)}],
    }
    fifty = {
        "name": FIFTY_FLAG, "type": "release", "project": "default", "enabled": True,
        # Strategies are tried in order and the first that matches picks the
        # variant, so a variant per strategy is a rule's name, first match wins.
        "strategies": [
            {"name": "default", "parameters": {}, "constraints": _unleash_constraints(rule.when),
             "variants": [{"name": rule.name, "weight": 1000, "stickiness": "default",
                           "weightType": "variable"}]}
            for rule in pols.fifty_doc.rules
        ],
    }
    return {"version": 2, "features": [seed, fifty]}


def unleash_properties(s: RequestShape) -> dict[str, Any]:
    props: dict[str, Any] = {
        "route": s.route, "model": s.model, "batch_size": s.batch_size,
        "structured_output": s.structured_output, "tools": s.tools, "stream": s.stream,
        "prompt_tokens": s.prompt_tokens,
    }
    if s.max_tokens is not None:
        props["max_tokens"] = s.max_tokens
    for key, value in s.labels.items():
        props[f"label_{key}"] = value
    return props


@contextlib.contextmanager
def unleash_implementations(pols: Policies) -> Iterator[list[Impl]]:
    """An UnleashClient that never touches the network: bootstrapped, no fetch, no metrics."""
    from UnleashClient.cache import FileCache
    from UnleashClient.clients.unleash_client import UnleashClient
    from UnleashClient.utils import InstanceAllowType

    with tempfile.TemporaryDirectory(prefix="specgate-bench-unleash-") as cache_dir:
        cache = FileCache("specgate-bench", directory=cache_dir)
        cache.bootstrap_from_dict(unleash_features(pols))
        client = UnleashClient(
            url="http://127.0.0.1:9", app_name="specgate-bench", cache=cache,
            disable_metrics=True, disable_registration=True, refresh_interval=3600,
            multiple_instance_mode=InstanceAllowType.SILENTLY_ALLOW,
        )
        client.initialize_client(fetch_toggles=False)
        try:
            is_enabled = client.is_enabled
            get_variant = client.get_variant

            def unleash_seed(s: RequestShape) -> bool:
                return is_enabled(SEED_FLAG, {"properties": {
                    "route": s.route, "batch_size": s.batch_size,
                    "structured_output": s.structured_output}})

            def unleash_fifty(s: RequestShape) -> dict[str, Any]:
                return get_variant(FIFTY_FLAG, {"properties": unleash_properties(s)})

            def fifty_rule(result: dict[str, Any]) -> str:
                return result["name"] if result.get("enabled") else DEFAULT_RULE

            yield [
                Impl("unleash-seed", "seed", "seed rule as an Unleash flag (SDK 6.9.1, yggdrasil, offline)",
                     unleash_seed, rule_of=lambda r: SEED_RULE if r else DEFAULT_RULE),
                Impl("unleash-fifty", "fifty", "50 rules as one flag, strategy variants name the rule",
                     unleash_fifty, rule_of=fifty_rule),
            ]
        finally:
            client.destroy()


@contextlib.contextmanager
def implementations(shapes: list[RequestShape], *, cel: bool = True,
                    unleash: bool = True) -> Iterator[tuple[Policies, list[Impl]]]:
    """Every implementation, in table order; the Unleash client is shut down on exit."""
    pols = load_policies()
    fallthrough = [s for s in shapes if pols.fifty.decide(s).rule == DEFAULT_RULE]
    impls = [
        Impl("loop", "", "empty loop (for s in batch: pass)", _noop, empty_loop=True),
        Impl("noop-call", "", "call of a function that returns None", _noop),
        Impl("specgate-seed", "seed", "seed.yaml via compile_policy(...).decide", pols.seed.decide,
             rule_of=lambda d: d.rule, speculate_of=lambda d: d.speculate),
        Impl("hand-written", "seed", "hand-written Python function of the seed rule", hand_written,
             rule_of=lambda r: SEED_RULE if r else DEFAULT_RULE),
        Impl("specgate-fifty", "fifty", "fifty_rules.yaml via compile_policy(...).decide", pols.fifty.decide,
             rule_of=lambda d: d.rule, speculate_of=lambda d: d.speculate),
        Impl("specgate-fifty-fallthrough", "fifty", "same, only shapes no rule matches (worst case)",
             pols.fifty.decide, rule_of=lambda d: d.rule, speculate_of=lambda d: d.speculate,
             shapes=fallthrough),
    ]
    if cel:
        impls += cel_implementations(pols, shapes)
    with contextlib.ExitStack() as stack:
        if unleash:
            impls += stack.enter_context(unleash_implementations(pols))
        yield pols, impls


# --- cross-check ------------------------------------------------------------------------

def cross_check(pols: Policies, impls: Sequence[Impl], shapes: Sequence[RequestShape]) -> list[str]:
    """Every implementation against the reference interpreter; returns the disagreements."""
    problems: list[str] = []
    docs = {"seed": pols.seed_doc, "fifty": pols.fifty_doc}
    for impl in impls:
        if not impl.policy or impl.rule_of is None:
            continue
        doc = docs[impl.policy]
        for i, s in enumerate(impl.shapes if impl.shapes is not None else shapes):
            want = interpret(doc, s)
            try:
                result = impl.decide(s)
                rule = impl.rule_of(result)
                speculate = (impl.speculate_of(result) if impl.speculate_of is not None
                             else pols.speculates(impl.policy, rule))
            except Exception as exc:  # a crash is a disagreement too
                problems.append(f"{impl.key}: shape {i} raised {exc!r}")
                continue
            if rule != want.rule or speculate != want.speculate:
                problems.append(f"{impl.key}: shape {i} {s.to_dict()} -> rule {rule!r} speculate "
                                f"{speculate}, reference says rule {want.rule!r} speculate {want.speculate}")
    return problems


def rule_histogram(pols: Policies, shapes: Sequence[RequestShape]) -> dict[str, dict[str, int]]:
    """Where the mix lands: which rule position decides, for both policies."""
    out: dict[str, dict[str, int]] = {}
    for name, doc in (("seed", pols.seed_doc), ("fifty", pols.fifty_doc)):
        position = {r.name: i + 1 for i, r in enumerate(doc.rules)}
        buckets = {"rules 1-10": 0, "rules 11-30": 0, "rules 31-50": 0, "default": 0, "speculate": 0}
        for s in shapes:
            d = interpret(doc, s)
            buckets["speculate"] += d.speculate
            if d.rule == DEFAULT_RULE:
                buckets["default"] += 1
            elif position[d.rule] <= 10:
                buckets["rules 1-10"] += 1
            elif position[d.rule] <= 30:
                buckets["rules 11-30"] += 1
            else:
                buckets["rules 31-50"] += 1
        out[name] = buckets
    return out


# --- timing -----------------------------------------------------------------------------

def _time_calls(fn: Callable[[RequestShape], Any], batch: list[RequestShape]) -> int:
    perf = time.perf_counter_ns
    t0 = perf()
    for s in batch:
        fn(s)
    return perf() - t0


def _time_empty(fn: Callable[[RequestShape], Any], batch: list[RequestShape]) -> int:
    perf = time.perf_counter_ns
    t0 = perf()
    for _s in batch:
        pass
    return perf() - t0


def _batches(shapes: Sequence[RequestShape], size: int) -> list[list[RequestShape]]:
    """Batches of ``size`` consecutive shapes that together cover the mix (cycling)."""
    if not shapes:
        raise ValueError("no shapes to time")
    count = max(1, -(-len(shapes) // size))
    out = []
    for b in range(count):
        start = b * size
        out.append([shapes[(start + i) % len(shapes)] for i in range(size)])
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks; ``q`` in [0, 100]."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


@dataclass
class Timing:
    impl: Impl
    batches: list[list[RequestShape]]
    samples_per_round: int = 1
    samples_us: list[float] = field(default_factory=list)  # per-decision µs, one per sample
    calls: int = 0
    elapsed_ns: int = 0


def measure(impls: Sequence[Impl], shapes: Sequence[RequestShape], *, iterations: int = 1000,
            rounds: int = 20, round_ms: float = 250.0, max_samples_per_round: int = 50,
            max_sample_ms: float = 100.0, seed: int = 1,
            progress: Callable[[str], None] | None = None) -> list[Timing]:
    """Time every implementation, interleaved: rounds over all of them, in shuffled order.

    A sample times ``iterations`` calls, fewer (at least 10) for an
    implementation so slow that a sample would last over ``max_sample_ms``.
    Each round gives each implementation about ``round_ms`` of samples (at
    least one, at most ``max_samples_per_round``), sized from a warm-up sample,
    so fast rows get many samples and slow rows are not starved of rounds.
    """
    timings = []
    for impl in impls:
        pool = impl.shapes if impl.shapes is not None else shapes
        runner = _time_empty if impl.empty_loop else _time_calls
        probe = _batches(pool, min(iterations, 10))[0]
        runner(impl.decide, probe)  # warm-up
        per_call_ns = max(1, runner(impl.decide, probe)) / len(probe)
        size = iterations
        if per_call_ns * iterations > max_sample_ms * 1e6:
            size = min(iterations, max(10, int(max_sample_ms * 1e6 / per_call_ns)))
        t = Timing(impl, _batches(pool, size))
        warm_ns = max(1, runner(impl.decide, t.batches[0]))
        t.samples_per_round = max(1, min(max_samples_per_round, int(round_ms * 1e6 / warm_ns)))
        timings.append(t)
    rng = random.Random(seed)
    order = list(range(len(timings)))
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            rng.shuffle(order)
            for index in order:
                t = timings[index]
                runner = _time_empty if t.impl.empty_loop else _time_calls
                gc.collect()
                gc.disable()  # as timeit does: no collection in the middle of a sample
                try:
                    for _ in range(t.samples_per_round):
                        batch = t.batches[len(t.samples_us) % len(t.batches)]
                        ns = runner(t.impl.decide, batch)
                        t.samples_us.append(ns / len(batch) / 1000)
                        t.calls += len(batch)
                        t.elapsed_ns += ns
                finally:
                    if gc_was_enabled:
                        gc.enable()
            if progress is not None:
                progress(f"round {r + 1}/{rounds} done")
    finally:
        if gc_was_enabled:
            gc.enable()
    return timings


def summarize(timings: Sequence[Timing]) -> dict[str, dict[str, Any]]:
    """Per implementation: raw percentiles and, net of the empty loop, the same."""
    loop = next((t for t in timings if t.impl.empty_loop), None)
    loop_us = percentile(sorted(loop.samples_us), 50) if loop is not None else 0.0
    out: dict[str, dict[str, Any]] = {}
    for t in timings:
        values = sorted(t.samples_us)
        raw = {"median": percentile(values, 50), "p90": percentile(values, 90),
               "p99": percentile(values, 99), "min": values[0] if values else float("nan"),
               "mean": t.elapsed_ns / t.calls / 1000 if t.calls else float("nan")}
        net = {k: v - loop_us for k, v in raw.items()} if not t.impl.empty_loop else dict(raw)
        out[t.impl.key] = {
            "policy": t.impl.policy, "label": t.impl.label, "samples": len(values),
            "calls_per_sample": len(t.batches[0]), "calls": t.calls,
            "shapes": len({id(s) for b in t.batches for s in b}),
            "raw_us": raw, "net_us": net,
            "decisions_per_s": 1e6 / raw["median"] if raw["median"] > 0 else float("inf"),
        }
    return out


def ratios(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median ratios (how many times slower the first is), raw and net of the empty loop."""
    pairs = [
        ("specgate-seed", "hand-written"),
        ("unleash-seed", "specgate-fifty"),
        ("cel-seed", "specgate-fifty"),
        ("unleash-fifty", "specgate-fifty"),
        ("cel-fifty", "specgate-fifty"),
        ("unleash-seed", "specgate-seed"),
        ("cel-seed", "specgate-seed"),
        ("specgate-fifty", "specgate-seed"),
        ("specgate-fifty-fallthrough", "specgate-fifty"),
    ]
    out = {}
    for a, b in pairs:
        if a in stats and b in stats:
            out[f"{a} / {b}"] = {
                "raw": stats[a]["raw_us"]["median"] / stats[b]["raw_us"]["median"],
                "net": stats[a]["net_us"]["median"] / stats[b]["net_us"]["median"],
            }
    return out


def goals(stats: dict[str, dict[str, Any]], rat: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The issue's targets, judged on raw medians (what a caller pays) and net ones."""
    out: list[dict[str, Any]] = []
    if "specgate-fifty" in stats:
        m = stats["specgate-fifty"]
        out.append({"goal": f"50-rule median < {GOAL_FIFTY_MEDIAN_US} us",
                    "raw": m["raw_us"]["median"], "net": m["net_us"]["median"],
                    "met_raw": m["raw_us"]["median"] < GOAL_FIFTY_MEDIAN_US,
                    "met_net": m["net_us"]["median"] < GOAL_FIFTY_MEDIAN_US})
    for key, target, text in (
        ("unleash-seed / specgate-fifty", GOAL_VS_UNLEASH, "50-rule >= 10x faster than Unleash (seed flag)"),
        ("cel-seed / specgate-fifty", GOAL_VS_CEL, "50-rule >= 25x faster than CEL (seed rule)"),
    ):
        if key in rat:
            out.append({"goal": text, **rat[key], "met_raw": rat[key]["raw"] >= target,
                        "met_net": rat[key]["net"] >= target})
    key = "specgate-seed / hand-written"
    if key in rat:
        out.append({"goal": "seed within 3x of hand-written", **rat[key],
                    "met_raw": rat[key]["raw"] <= GOAL_VS_HAND, "met_net": rat[key]["net"] <= GOAL_VS_HAND})
    return out


# --- reporting --------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for dist in ("pydantic", "cel-python", "lark", "UnleashClient", "yggdrasil-engine"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {**machine_facts(), "versions": versions}


def format_table(stats: dict[str, dict[str, Any]]) -> str:
    head = (f"{'implementation':<28} {'median':>8} {'p90':>8} {'p99':>8} {'net med':>8} "
            f"{'decisions/s':>12} {'samples':>8} {'calls/sample':>12}")
    lines = [head, "-" * len(head)]
    for key, s in stats.items():
        raw, net = s["raw_us"], s["net_us"]
        lines.append(f"{key:<28} {raw['median']:8.3f} {raw['p90']:8.3f} {raw['p99']:8.3f} "
                     f"{net['median']:8.3f} {s['decisions_per_s']:12,.0f} {s['samples']:8d} "
                     f"{s['calls_per_sample']:12d}")
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=1000,
                        help="calls timed together as one sample (default 1000)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds over all implementations (default 20)")
    parser.add_argument("--round-ms", type=float, default=250.0,
                        help="time each implementation gets per round, in ms (default 250)")
    parser.add_argument("--max-samples-per-round", type=int, default=50)
    parser.add_argument("--max-sample-ms", type=float, default=100.0,
                        help="slower implementations time fewer calls per sample (default 100)")
    parser.add_argument("--shapes", type=int, default=1000,
                        help="size of the request-shape mix (default 1000)")
    parser.add_argument("--seed", type=int, default=20250101, help="seed of the shape mix")
    parser.add_argument("--no-cel", action="store_true", help="leave out the cel-python rows")
    parser.add_argument("--no-unleash", action="store_true", help="leave out the Unleash rows")
    parser.add_argument("--json", metavar="OUT", help="also write the full results as JSON to OUT")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.rounds < 1 or args.shapes < 1:
        parser.error("--iterations, --rounds and --shapes must be positive")

    def say(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    shapes = make_shapes(args.shapes, args.seed)
    started = time.perf_counter()
    with implementations(shapes, cel=not args.no_cel, unleash=not args.no_unleash) as (pols, impls):
        problems = cross_check(pols, impls, shapes)
        if problems:
            for p in problems[:20]:
                print(p, file=sys.stderr)
            raise SystemExit(f"cross-check failed: {len(problems)} disagreements")
        checked = [i.key for i in impls if i.rule_of is not None]
        say(f"cross-check: {len(checked)} implementations agree with policies.interpret on "
            f"{len(shapes)} shapes")
        timings = measure(impls, shapes, iterations=args.iterations, rounds=args.rounds,
                          round_ms=args.round_ms, max_samples_per_round=args.max_samples_per_round,
                          max_sample_ms=args.max_sample_ms, progress=say)
    stats = summarize(timings)
    rat = ratios(stats)
    machine_facts = machine()
    goal_results = goals(stats, rat)
    result: dict[str, Any] = {
        "command": "python -m bench.decisions " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_facts,
        "parameters": {k: v for k, v in vars(args).items() if k not in ("json", "quiet")},
        "wall_s": round(time.perf_counter() - started, 1),
        "mix": rule_histogram(pols, shapes),
        "cross_check": {"shapes": len(shapes), "implementations": checked,
                        "disagreements": 0},
        "results": stats,
        "ratios": rat,
        "goals": goal_results,
    }
    if not args.quiet:
        m = machine_facts
        print(f"python {m['python']} on {m['cpu']} ({m['nproc']} CPUs); "
              f"{args.shapes} shapes, {args.iterations} calls per sample; times in us per decision")
        print(format_table(stats))
        print()
        for name, r in rat.items():
            print(f"{name:<45} {r['raw']:8.2f}x raw {r['net']:8.2f}x net")
        print()
        for g in goal_results:
            verdict = "met" if g["met_raw"] else ("met net of loop only" if g["met_net"] else "MISSED")
            print(f"goal: {g['goal']:<48} raw {g['raw']:.2f}, net {g['net']:.2f}: {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
