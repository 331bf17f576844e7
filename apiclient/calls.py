"""Every call the client makes: its endpoint (method, path, the answer's type) and the request built from arguments.

A :class:`Call` is data, not an action: :meth:`apiclient.ApiClient.send` runs
it. Keeping the calls apart from the client lets the dashboard key its cache
on :attr:`Call.key`, and lets the drift test walk :data:`ENDPOINTS` and
compare each with the control plane's OpenAPI document.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import TypeAdapter

from apiclient.models import (
    AppliedRecommendation,
    AuditPage,
    Autopilot,
    BeforeAfter,
    Cells,
    Diff,
    DraftCheck,
    Evaluation,
    Fleet,
    GuardrailEvaluation,
    GuardrailHistory,
    KillSwitch,
    KillSwitchChange,
    Policy,
    RecommendationList,
    Revision,
    RevisionPage,
    RollbackResult,
    Rollout,
    RolloutPage,
    RollupReport,
    SpeedupReport,
    SummaryReport,
    Switchback,
    WhatIf,
    WhoAmI,
    WorkerPage,
)

T = TypeVar("T")
When = dt.datetime | str | None
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Endpoint(Generic[T]):
    """One operation of the API as the client uses it.

    ``answer`` is the type of the body on every status in ``ok`` (a model, or
    e.g. ``list[Policy]``); ``query`` names every query parameter the client
    may send.
    """

    method: str
    path: str
    answer: type[T]
    ok: tuple[int, ...] = (200,)
    query: tuple[str, ...] = ()

    @cached_property
    def adapter(self) -> TypeAdapter[T]:
        return TypeAdapter(self.answer)

    @property
    def path_names(self) -> tuple[str, ...]:
        return tuple(_PLACEHOLDER.findall(self.path))

    def __call__(self, *, params: Mapping[str, Any] | None = None, body: Any = None,
                 headers: Mapping[str, str] | None = None, **path: str) -> Call[T]:
        if set(path) != set(self.path_names):
            raise TypeError(f"{self.method} {self.path} needs {self.path_names}, got {tuple(path)}")
        unknown = set(params or {}) - set(self.query)
        if unknown:
            raise TypeError(f"{self.method} {self.path} has no query parameter {sorted(unknown)}")
        # Path segments are quoted: a name with '/' or '?' must stay one segment.
        filled = _PLACEHOLDER.sub(lambda m: quote(str(path[m.group(1)]), safe=""), self.path)
        kept = {k: v for k, v in (params or {}).items() if v is not None}
        return Call(self, filled, kept, body, dict(headers or {}))


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request, ready to send: the endpoint it belongs to, its path, query, JSON body and headers."""

    endpoint: Endpoint[T]
    path: str
    params: Mapping[str, Any] = field(default_factory=dict)
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """What identifies the answer of a read: method, path and query, in a stable order."""
        query = "&".join(f"{k}={self.params[k]}" for k in sorted(self.params))
        return f"{self.endpoint.method} {self.path}?{query}"


def _time(value: When) -> str | None:
    return value.isoformat() if isinstance(value, dt.datetime) else value


def _window(since: When, until: When) -> dict[str, str | None]:
    return {"from": _time(since), "to": _time(until)}


# --- endpoints -----------------------------------------------------------------------------

WHOAMI = Endpoint("GET", "/v1/whoami", WhoAmI)

POLICIES = Endpoint("GET", "/v1/policies", list[Policy])
POLICY = Endpoint("GET", "/v1/policies/{name}", Policy)
CREATE_POLICY = Endpoint("POST", "/v1/policies", Policy, ok=(201,))
REVISIONS = Endpoint("GET", "/v1/policies/{name}/revisions", RevisionPage, query=("cursor", "limit"))
# 201: created; 200: an equal document is already a revision (nothing was created).
CREATE_REVISION = Endpoint("POST", "/v1/policies/{name}/revisions", Revision, ok=(200, 201))
VALIDATE = Endpoint("POST", "/v1/policies/{name}/validate", DraftCheck)
DIFF = Endpoint("GET", "/v1/policies/{name}/diff", Diff, query=("from", "to"))
REVISION = Endpoint("GET", "/v1/revisions/{revision_id}", Revision)
EVALUATE = Endpoint("POST", "/v1/revisions/{revision_id}/evaluate", list[Evaluation])
ROLLBACK = Endpoint("POST", "/v1/policies/{name}/rollback", RollbackResult)

ROLLOUTS = Endpoint("GET", "/v1/rollouts", RolloutPage, query=("policy", "state", "cursor", "limit"))
ROLLOUT = Endpoint("GET", "/v1/rollouts/{rollout_id}", Rollout)
START_ROLLOUT = Endpoint("POST", "/v1/rollouts", Rollout, ok=(201,))
PROMOTE = Endpoint("POST", "/v1/rollouts/{rollout_id}/promote", Rollout)
PAUSE = Endpoint("POST", "/v1/rollouts/{rollout_id}/pause", Rollout)
RESUME = Endpoint("POST", "/v1/rollouts/{rollout_id}/resume", Rollout)
ABORT = Endpoint("POST", "/v1/rollouts/{rollout_id}/abort", Rollout)
ROLLOUT_ACTIONS = {"promote": PROMOTE, "pause": PAUSE, "resume": RESUME, "abort": ABORT}
GUARDRAILS = Endpoint("GET", "/v1/rollouts/{rollout_id}/guardrails", GuardrailHistory, query=("limit",))
EVALUATE_GUARDRAILS = Endpoint("POST", "/v1/rollouts/{rollout_id}/guardrails/evaluate", GuardrailEvaluation)

KILL_SWITCH = Endpoint("GET", "/v1/killswitch", KillSwitch)
SET_KILL_SWITCH = Endpoint("PUT", "/v1/killswitch", KillSwitchChange)
FLEET = Endpoint("GET", "/v1/fleet", Fleet)
WORKERS = Endpoint("GET", "/v1/workers", WorkerPage, query=("pool", "kind", "cursor", "limit"))
AUDIT = Endpoint("GET", "/v1/audit", AuditPage, query=("q", "action", "actor", "target_type", "cursor", "limit"))

ROLLUPS = Endpoint("GET", "/v1/telemetry/rollups", RollupReport,
                   query=("group_by", "from", "to", "policy", "revision", "route", "engine", "limit"))
SUMMARY = Endpoint("GET", "/v1/analysis/summary", SummaryReport,
                   query=("policy", "revision", "route", "group_by", "window", "from", "to", "limit"))
SPEEDUPS = Endpoint("GET", "/v1/analysis/speedups", SpeedupReport,
                    query=("policy", "route", "rollout", "from", "to"))
BEFORE_AFTER = Endpoint("GET", "/v1/analysis/before-after", BeforeAfter,
                        query=("rollout", "policy", "from_revision", "to_revision", "from", "to"))
CELLS = Endpoint("GET", "/v1/analysis/cells", Cells, query=("policy", "from", "to"))
SWITCHBACK = Endpoint("GET", "/v1/analysis/switchback", Switchback, query=("policy", "from", "to", "confidence"))
WHAT_IF = Endpoint("POST", "/v1/analysis/what-if", WhatIf)
RECOMMENDATIONS = Endpoint("GET", "/v1/recommendations", RecommendationList,
                           query=("policy", "from", "to", "min_samples"))
AUTOPILOT = Endpoint("GET", "/v1/policies/{name}/autopilot", Autopilot)
SET_AUTOPILOT = Endpoint("PUT", "/v1/policies/{name}/autopilot", Autopilot)
APPLY_RECOMMENDATION = Endpoint("POST", "/v1/recommendations/{recommendation_id}/apply", AppliedRecommendation,
                                ok=(201,), query=("policy", "from", "to", "min_samples"))

ENDPOINTS: tuple[Endpoint[Any], ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Endpoint))


# --- calls ---------------------------------------------------------------------------------

def whoami() -> Call[WhoAmI]:
    return WHOAMI()


def policies() -> Call[list[Policy]]:
    return POLICIES()


def policy(name: str) -> Call[Policy]:
    return POLICY(name=name)


def create_policy(name: str, *, pool: str | None = None, description: str | None = None) -> Call[Policy]:
    return CREATE_POLICY(body={"name": name, "pool": pool, "description": description})


def revisions(policy: str, *, cursor: int | None = None, limit: int | None = None) -> Call[RevisionPage]:
    return REVISIONS(name=policy, params={"cursor": cursor, "limit": limit})


def create_revision(policy: str, document: str, *, message: str = "", if_match: str | None = None) -> Call[Revision]:
    """A new revision from the document's text (errors come back with line numbers).

    ``if_match`` is the If-Match header as sent: ``'"<head id>"'`` builds on that
    head (412 when another was saved since), ``"*"`` on whatever the head is.
    """
    headers = {"If-Match": if_match} if if_match is not None else None
    return CREATE_REVISION(name=policy, body={"document": document, "message": message}, headers=headers)


def validate(policy: str, document: str, *, shapes: Sequence[Mapping[str, Any]] = ()) -> Call[DraftCheck]:
    """Checks a draft of the policy's next revision; nothing is stored (an invalid one is a 422 problem)."""
    return VALIDATE(name=policy, body={"document": document, "shapes": [dict(s) for s in shapes]})


def diff(policy: str, *, from_revision: str, to_revision: str) -> Call[Diff]:
    return DIFF(name=policy, params={"from": from_revision, "to": to_revision})


def revision(revision_id: str) -> Call[Revision]:
    return REVISION(revision_id=revision_id)


def evaluate(revision_id: str, shapes: Sequence[Mapping[str, Any]]) -> Call[list[Evaluation]]:
    return EVALUATE(revision_id=revision_id, body={"shapes": [dict(s) for s in shapes]})


def rollback(policy: str, revision: str, *, reason: str) -> Call[RollbackResult]:
    return ROLLBACK(name=policy, body={"revision": revision, "reason": reason})


def rollouts(*, policy: str | None = None, state: str | None = None, cursor: str | None = None,
             limit: int | None = None) -> Call[RolloutPage]:
    return ROLLOUTS(params={"policy": policy, "state": state, "cursor": cursor, "limit": limit})


def rollout(rollout_id: str) -> Call[Rollout]:
    return ROLLOUT(rollout_id=rollout_id)


def start_rollout(*, policy: str, revision: str, mode: str, steps: Sequence[float], reason: str,
                  pool: str | None = None, labels: Mapping[str, str] | None = None) -> Call[Rollout]:
    target: dict[str, Any] = {}
    if pool:
        target["pool"] = pool
    if labels:
        target["labels"] = dict(labels)
    return START_ROLLOUT(body={"policy": policy, "revision": revision, "mode": mode, "steps": list(steps),
                               "target": target, "reason": reason})


def rollout_action(rollout_id: str, action: str, *, reason: str = "",
                   expected_step: int | None = None) -> Call[Rollout]:
    """promote, pause, resume or abort (abort needs a reason).

    ``expected_step`` (promote only) is the step the caller saw: the control plane refuses with 409 when
    the rollout has moved on since, instead of promoting a step nobody looked at.
    """
    try:
        endpoint = ROLLOUT_ACTIONS[action]
    except KeyError:
        raise ValueError(f"unknown rollout action {action!r}: one of {', '.join(ROLLOUT_ACTIONS)}") from None
    body: dict[str, Any] = {"reason": reason}
    if expected_step is not None:
        if endpoint is not PROMOTE:
            raise ValueError("expected_step is for promote only")
        body["expected_step"] = expected_step
    return endpoint(rollout_id=rollout_id, body=body)


def guardrails(rollout_id: str, *, limit: int | None = None) -> Call[GuardrailHistory]:
    """The guardrail evaluations of a rollout's steps, newest first."""
    return GUARDRAILS(rollout_id=rollout_id, params={"limit": limit})


def evaluate_guardrails(rollout_id: str) -> Call[GuardrailEvaluation]:
    return EVALUATE_GUARDRAILS(rollout_id=rollout_id)


def kill_switch() -> Call[KillSwitch]:
    return KILL_SWITCH()


def set_kill_switch(enabled: bool, *, reason: str) -> Call[KillSwitchChange]:
    return SET_KILL_SWITCH(body={"enabled": enabled, "reason": reason})


def fleet() -> Call[Fleet]:
    return FLEET()


def workers(*, pool: str | None = None, kind: str | None = None, cursor: str | None = None,
            limit: int | None = None) -> Call[WorkerPage]:
    """``kind``: "worker" or "gateway"; None lists both."""
    return WORKERS(params={"pool": pool, "kind": kind, "cursor": cursor, "limit": limit})


def audit(*, q: str | None = None, action: str | None = None, actor: str | None = None,
          target_type: str | None = None, cursor: int | None = None, limit: int | None = None) -> Call[AuditPage]:
    return AUDIT(params={"q": q, "action": action, "actor": actor, "target_type": target_type, "cursor": cursor,
                         "limit": limit})


def rollups(*, group_by: Sequence[str], since: When = None, until: When = None, policy: str | None = None,
            revision: str | None = None, route: str | None = None, engine: str | None = None,
            limit: int | None = None) -> Call[RollupReport]:
    return ROLLUPS(params={"group_by": ",".join(group_by), **_window(since, until), "policy": policy,
                           "revision": revision, "route": route, "engine": engine, "limit": limit})


def summary(*, group_by: str, policy: str | None = None, route: str | None = None, window: str | None = None,
            since: When = None, until: When = None, revision: str | None = None,
            limit: int | None = None) -> Call[SummaryReport]:
    return SUMMARY(params={"policy": policy, "revision": revision, "route": route, "group_by": group_by,
                           "window": window, **_window(since, until), "limit": limit})


def speedups(policy: str, *, route: str | None = None, rollout: str | None = None, since: When = None,
             until: When = None) -> Call[SpeedupReport]:
    return SPEEDUPS(params={"policy": policy, "route": route, "rollout": rollout, **_window(since, until)})


def before_after(*, rollout: str | None = None, policy: str | None = None, from_revision: str | None = None,
                 to_revision: str | None = None, since: When = None, until: When = None) -> Call[BeforeAfter]:
    return BEFORE_AFTER(params={"rollout": rollout, "policy": policy, "from_revision": from_revision,
                                "to_revision": to_revision, **_window(since, until)})


def cells(policy: str, *, since: When = None, until: When = None) -> Call[Cells]:
    return CELLS(params={"policy": policy, **_window(since, until)})


def switchback(policy: str, *, since: When = None, until: When = None) -> Call[Switchback]:
    return SWITCHBACK(params={"policy": policy, **_window(since, until)})


def what_if(policy: str, *, revision: str | None = None, document: Mapping[str, Any] | None = None,
            since: When = None, until: When = None) -> Call[WhatIf]:
    """Scores a stored revision, or a candidate document, on the recorded window."""
    body = {"policy": policy, "revision": revision, "document": document, **_window(since, until)}
    return WHAT_IF(body={k: v for k, v in body.items() if v is not None})


def recommendations(policy: str, *, since: When = None, until: When = None,
                    min_samples: int | None = None) -> Call[RecommendationList]:
    return RECOMMENDATIONS(params={"policy": policy, **_window(since, until), "min_samples": min_samples})


def autopilot(policy: str) -> Call[Autopilot]:
    return AUTOPILOT(name=policy)


def set_autopilot(policy: str, setting: Mapping[str, Any]) -> Call[Autopilot]:
    """Replaces the policy's autopilot setting (``enabled`` and the fields to set; the others take the API's
    defaults)."""
    return SET_AUTOPILOT(name=policy, body=dict(setting))


def apply_recommendation(recommendation_id: str, policy: str, *, since: When = None, until: When = None,
                         min_samples: int | None = None, head: str | None = None) -> Call[AppliedRecommendation]:
    """Creates a draft revision with the edit; pass the window and parameters the listing had, and its ``head``.

    The draft builds on ``head`` (sent as If-Match): a revision saved since the listing is a 412 with the
    current head, not left out of the new head. Without it, the draft must build on the revision the
    recommendation was computed against.
    """
    headers = {"If-Match": f'"{head}"'} if head is not None else None
    return APPLY_RECOMMENDATION(recommendation_id=recommendation_id,
                                params={"policy": policy, **_window(since, until), "min_samples": min_samples},
                                headers=headers)
