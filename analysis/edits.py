"""Rule edits a recommendation proposes, applied to a policy document's normal form.

Each edit takes the canonical document (a dict, as revisions store it) and
returns a new one; :func:`apply_edit` validates the result with ``policies``
so that an edit which would make an invalid or shadowed rule set is refused
with the library's own errors. An edit touches one route: a rule that lists
other routes too is split, so the other routes keep their behaviour.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterator
from typing import Any

from policies import PolicyDocument, validate_data

Doc = dict[str, Any]
EDIT_KINDS = ("set_batch_max", "exclude_route", "set_k", "set_engine_k", "set_engine", "plain_only", "route_instead")


def _speculative_engines(doc: Doc) -> set[str]:
    return {name for name, engine in doc["engines"].items() if engine.get("method") != "none"}


def _plain_engine(doc: Doc) -> str:
    if doc.get("plain_engine"):
        return str(doc["plain_engine"])
    return str(next(name for name, engine in doc["engines"].items() if engine.get("method") == "none"))


def _rule_name(doc: Doc, base: str, route: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", route).strip("-.") or "route"
    digest = hashlib.sha256(route.encode()).hexdigest()[:6]
    taken = {r["name"] for r in doc.get("rules", [])}
    name = f"{base}-{slug}"[:56]
    if not re.match(r"^[A-Za-z0-9]", name):
        name = "r" + name[:55]
    if name in taken:
        name = f"{name[:49]}-{digest}"
    return name


def _route_rules(doc: Doc, route: str, only_speculative: bool = True) -> list[int]:
    """Indexes of rules that can match ``route`` (and send it to a speculative engine)."""
    spec = _speculative_engines(doc)
    out = []
    for i, rule in enumerate(doc.get("rules", [])):
        routes = rule.get("when", {}).get("route")
        if routes is not None and route not in routes:
            continue
        if only_speculative and rule["then"]["engine"] not in spec:
            continue
        out.append(i)
    return out


def _isolate(doc: Doc, index: int, route: str) -> int:
    """Make rule ``index`` apply to ``route`` only, keeping other routes' behaviour; returns its new index.

    A rule for ``[route]`` is left as it is. Otherwise a copy restricted to
    ``route`` is inserted before it, and the route is removed from the
    original's list (a rule without a route predicate stays as it is: the copy
    shadows it for this route only).
    """
    rules = doc["rules"]
    rule = rules[index]
    routes = rule.get("when", {}).get("route")
    if routes == [route]:
        return index
    copy_rule = copy.deepcopy(rule)
    copy_rule["name"] = _rule_name(doc, rule["name"], route)
    copy_rule.setdefault("when", {})["route"] = [route]
    copy_rule.pop("description", None)
    if routes is not None:
        rule["when"]["route"] = [r for r in routes if r != route]
    rules.insert(index, copy_rule)
    return index


def _route_rules_isolated(doc: Doc, route: str) -> Iterator[Doc]:
    """Yield, for editing in place, each rule that sends ``route`` to a speculative engine, isolated to it.

    Yields the rule itself, not its index: isolating a rule inserts a copy and shifts the indexes after
    it. Raises ValueError, before anything is changed, when no rule does."""
    indexes = _route_rules(doc, route)
    if not indexes:
        raise ValueError(f"no rule sends route {route!r} to a speculative engine")
    for index in reversed(indexes):
        yield doc["rules"][_isolate(doc, index, route)]


def set_batch_max(doc: Doc, route: str, batch_max: int) -> Doc:
    """Speculate for ``route`` up to ``batch_max`` requests in flight (the rules' batch_size.max)."""
    out = copy.deepcopy(doc)
    for rule in _route_rules_isolated(out, route):
        when = rule.setdefault("when", {})
        low = (when.get("batch_size") or {}).get("min")
        when["batch_size"] = {"max": batch_max} if low is None else {"min": low, "max": max(batch_max, low)}
    return out


def exclude_route(doc: Doc, route: str) -> Doc:
    """Never speculate for ``route``: its speculative rules go, or one rule sends it to the plain engine."""
    out = copy.deepcopy(doc)
    rules = out.setdefault("rules", [])
    general = False
    for index in reversed(_route_rules(out, route)):
        routes = rules[index].get("when", {}).get("route")
        if routes == [route]:
            del rules[index]
        elif routes is not None:
            rules[index]["when"]["route"] = [r for r in routes if r != route]
        else:
            general = True
    spec = _speculative_engines(out)
    if general or out["default"]["engine"] in spec:
        first = next((i for i in _route_rules(out, route) if rules[i].get("when", {}).get("route") is None),
                     len(rules))
        rules.insert(first, {"name": _rule_name(out, "exclude", route), "when": {"route": [route]},
                             "then": {"engine": _plain_engine(out)}})
    return out


def set_k(doc: Doc, route: str, k: int) -> Doc:
    """Draft ``k`` tokens per step for ``route`` (the rules' then.num_speculative_tokens)."""
    out = copy.deepcopy(doc)
    for rule in _route_rules_isolated(out, route):
        rule["then"]["num_speculative_tokens"] = k
    return out


def set_engine_k(doc: Doc, engine: str, k: int) -> Doc:
    """Configure a speculative engine variant to draft ``k`` tokens (every route on it; the engine restarts)."""
    out = copy.deepcopy(doc)
    if engine not in _speculative_engines(out):
        raise ValueError(f"{engine!r} is not a speculative engine of the policy")
    out["engines"][engine]["num_speculative_tokens"] = k
    return out


def set_engine(doc: Doc, route: str, engine: str) -> Doc:
    """Send ``route``'s speculative requests to another speculative engine (switch the method)."""
    out = copy.deepcopy(doc)
    if engine not in _speculative_engines(out):
        raise ValueError(f"{engine!r} is not a speculative engine of the policy")
    for rule in _route_rules_isolated(out, route):
        rule["then"] = {"engine": engine}
    return out


def plain_only(doc: Doc) -> Doc:
    """Speculate on nothing: no rules, the plain engine by default.

    The engines and the exploration stay, so the switchback windows keep measuring what speculating
    would do, and a later recommendation can bring it back where it pays.
    """
    out = copy.deepcopy(doc)
    out["rules"] = []
    out["default"] = {"engine": _plain_engine(out)}
    return out


def route_instead(doc: Doc, engine: str) -> Doc:
    """The engine stops scheduling in the engine: its rules' batch ranges route again (a request beyond them
    goes on to the next rules and the default, typically the plain engine) and it drafts at its K."""
    if engine not in doc["engines"]:
        raise ValueError(f"engine {engine!r} is not defined")
    if doc["engines"][engine].get("schedule") != "in_engine":
        raise ValueError(f"engine {engine!r} does not schedule in the engine")
    out = copy.deepcopy(doc)
    del out["engines"][engine]["schedule"]
    return out


def apply_edit(doc: Doc, edit: dict[str, Any]) -> tuple[Doc, PolicyDocument]:
    """Apply ``{"kind": ..., "route": ..., <value>}`` and validate; raises ValueError or PolicyValidationError."""
    kind = edit["kind"]
    route = edit.get("route", "")
    if kind == "set_batch_max":
        out = set_batch_max(doc, route, int(edit["batch_max"]))
    elif kind == "exclude_route":
        out = exclude_route(doc, route)
    elif kind == "set_k":
        out = set_k(doc, route, int(edit["k"]))
    elif kind == "set_engine_k":
        out = set_engine_k(doc, str(edit["engine"]), int(edit["k"]))
    elif kind == "set_engine":
        out = set_engine(doc, route, str(edit["engine"]))
    elif kind == "plain_only":
        out = plain_only(doc)
    elif kind == "route_instead":
        out = route_instead(doc, str(edit["engine"]))
    else:
        raise ValueError(f"unknown edit {kind!r}")
    return out, validate_data(out)
