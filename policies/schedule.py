"""In-engine batch schedules: what an engine marked ``schedule: in_engine`` drafts at each batch size.

Such an engine's rules keep their batch ranges, but the sidecar no longer tests them: it sends every request
whose other predicates a rule matches to the engine, and the engine drafts by one schedule over its own
running batch (vLLM ``num_speculative_tokens_per_batch_size``, TensorRT-LLM ``draft_len_schedule``). The
schedule is engine-wide, so every way a request reaches the engine must imply the same one:

* a *group* of rules for the engine: the rules whose predicates other than ``batch_size`` are equal. At a
  batch size it gives the K of its first rule whose range holds it (first match wins, as in routing), and 0
  where none does: the router sends a request at a batch no range of the group holds to the engine anyway
  (policies.evaluate.routed_rules), to be served without drafts.
* the default, when it names the engine: its K at every batch size.
* exploration, when its ``speculative_engine`` is the engine: the engine's K at every batch size (an
  explored plain decision is meant to be speculated, whatever the batch).

Validation reports each one that disagrees with the first (``schedule_conflict``), and the renderers write
the one they all imply.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from policies.model import Exploration, Range, Rule, Then, When

# A batch size range and the draft length there: lo..hi inclusive, hi None for no upper bound.
Segment = tuple[int, int | None, int]


def first_match_segments(ranges: Sequence[tuple[Range | None, int]]) -> tuple[Segment, ...]:
    """K at every batch size from 1 up: that of the first range holding it (None holds every size), else 0.

    Works on the ranges' bounds, never on every batch size: bounds may be any integer.
    """
    points = {1}
    for r, _ in ranges:
        if r is None:
            continue
        if r.min is not None and r.min > 1:
            points.add(r.min)
        if r.max is not None:
            points.add(r.max + 1)
    starts = sorted(points)
    segments: list[Segment] = []
    for i, lo in enumerate(starts):
        hi = starts[i + 1] - 1 if i + 1 < len(starts) else None
        # Within a segment no range begins or ends, so its first batch size speaks for all of it.
        k = next((k for r, k in ranges if r is None or r.contains(lo)), 0)
        if segments and segments[-1][2] == k:
            segments[-1] = (segments[-1][0], hi, k)
        else:
            segments.append((lo, hi, k))
    return tuple(segments)


def describe(segments: Iterable[Segment]) -> str:
    """``K=3 at batch 1-4, K=0 from batch 5`` for messages."""
    parts = []
    for lo, hi, k in segments:
        if lo == 1 and hi is None:
            return f"K={k} at every batch size"
        where = f"from batch {lo}" if hi is None else (f"at batch {lo}" if lo == hi else f"at batch {lo}-{hi}")
        parts.append(f"K={k} {where}")
    return ", ".join(parts)


def group_key(when: When) -> str:
    """The predicates other than batch_size, in a normal form: rules with equal keys form one group.

    Equal meaning, equal key: route and model sets are sorted and deduplicated, label values likewise, and a
    range's ``min: 0`` beside a ``max`` is dropped (every count is at least 0; a range alone with ``min: 0`` is
    kept, since it still refuses a request without that count).
    """
    data: dict[str, Any] = when.model_dump(exclude={"batch_size"}, exclude_none=True)
    for name in ("route", "model"):
        if name in data:
            data[name] = sorted(set(data[name]))
    if "labels" in data:
        data["labels"] = {key: sorted(set(values)) for key, values in data["labels"].items()}
    for name in ("max_tokens", "prompt_tokens"):
        bounds = data.get(name)
        if bounds is not None and bounds.get("min") == 0 and "max" in bounds:
            del bounds["min"]
    return json.dumps(data, sort_keys=True)


@dataclass(frozen=True, slots=True)
class CatchAll:
    """After the last rule of a group for an in-engine engine: every request of the group's other predicates,
    whatever the batch, to the engine without drafts (policies.evaluate.routed_rules)."""

    after: int  # the index of the group's last rule; the catch-all is tried right after it
    first: int  # the index of the group's first rule, whose name it decides under
    rule: Rule  # that first rule without its batch range


def catch_alls(rules: Iterable[tuple[int, Rule]], in_engine: Collection[str]) -> list[CatchAll]:
    """One per group of rules (with a batch range) for the engines in ``in_engine``, in the order tried."""
    groups: dict[str, tuple[int, Rule, int]] = {}
    for index, rule in rules:
        if rule.then.engine in in_engine and rule.when.batch_size is not None:
            key = f"{rule.then.engine}\n{group_key(rule.when)}"
            first_index, first_rule, _ = groups.get(key, (index, rule, index))
            groups[key] = (first_index, first_rule, index)
    found = [CatchAll(last, first_index,
                      first_rule.model_copy(update={"when": first_rule.when.model_copy(update={"batch_size": None})}))
             for first_index, first_rule, last in groups.values()]
    return sorted(found, key=lambda c: c.after)


@dataclass(frozen=True, slots=True)
class Contributor:
    """One way requests reach an in-engine engine, and the schedule it implies."""

    path: str  # where an error about it points
    label: str  # how a message names it
    segments: tuple[Segment, ...]


def contributors(engine: str, engine_k: int, rules: Iterable[tuple[int, Rule]], default: Then | None,
                 exploration: Exploration | None) -> list[Contributor]:
    """Every group of rules for ``engine`` (in order of its first rule), then the default, then exploration."""
    groups: dict[str, list[tuple[int, Rule]]] = {}
    for index, rule in rules:
        if rule.then.engine == engine:
            groups.setdefault(group_key(rule.when), []).append((index, rule))
    found: list[Contributor] = []
    for members in groups.values():
        first_index, first = members[0]
        ranges = [(rule.when.batch_size, rule.then.num_speculative_tokens or engine_k) for _, rule in members]
        path = f"rules[{first_index}].when.batch_size" if first.when.batch_size is not None else f"rules[{first_index}]"
        label = f"rules[{first_index}] ('{first.name}')"
        if len(members) > 1:
            label += f" with {', '.join(f'rules[{i}]' for i, _ in members[1:])}"
        found.append(Contributor(path, label, first_match_segments(ranges)))
    if default is not None and default.engine == engine:
        found.append(Contributor("default.engine", "the default",
                                 first_match_segments([(None, default.num_speculative_tokens or engine_k)])))
    if exploration is not None and exploration.rate > 0 and exploration.speculative_engine == engine:
        found.append(Contributor("exploration.speculative_engine", "exploration",
                                 first_match_segments([(None, engine_k)])))
    return found


def engine_schedule(engine: str, engine_k: int, rules: Iterable[tuple[int, Rule]], default: Then | None,
                    exploration: Exploration | None) -> tuple[Segment, ...]:
    """The schedule every way in implies (validation makes them agree); never drafting when nothing leads in."""
    found = contributors(engine, engine_k, rules, default, exploration)
    return found[0].segments if found else ((1, None, 0),)
