"""Every SQL statement of the analysis: policies, revision documents, recorded request shapes.

Latency figures come from the telemetry rollups (``controlplane.telemetry``);
the raw events are read here only where a question needs what rollups do not
keep: the request shapes a what-if replays, and per-worker and per-replica totals.

A raw event may be a sample: a pre-aggregating worker (``telemetry.raw_sample_rate``) sends every
request in its rollup deltas and only a share of them as events, each with ``sample_weight``, the
requests it stands for. Every count and sum over raw events is therefore weighted (an ordinary
event, weight NULL, counts once), and each query also says how many rows it read and how many of
them were samples, so that an answer can say what it rests on.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, func, literal_column, select
from sqlalchemy.orm import Session

from controlplane.models import Policy, Revision, Rollout, TelemetryEventRecord

E = TelemetryEventRecord
# The requests one row stands for. The literal 1 keeps sums of ordinary events integer on SQLite; the
# service turns a sum without samples back into an int on PostgreSQL (where the column's type wins).
WEIGHT = func.coalesce(E.sample_weight, literal_column("1"))


def _weighted_count(condition: Any) -> Any:
    return func.sum(case((condition, WEIGHT), else_=literal_column("0")))


def _basis_columns() -> list[Any]:
    return [func.count().label("events"), func.count(E.sample_weight).label("sampled_events")]


@dataclass(frozen=True, slots=True)
class ShapeGroup:
    """Recorded requests with one request shape, and how many of them were speculated."""

    route: str
    model: str
    batch_size: int
    structured_output: bool
    tools: bool
    stream: bool
    max_tokens: int | None
    prompt_tokens: int
    labels: str
    requests: float
    speculated: float
    events: int = 0  # rows read: requests counts them with their weights
    sampled_events: int = 0


class AnalysisRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- policies and revisions ----------------------------------------------------------------

    def policy(self, name: str) -> Policy | None:
        return self.session.scalar(select(Policy).where(Policy.name == name))

    def policy_by_id(self, policy_id: str) -> Policy | None:
        return self.session.get(Policy, policy_id)

    def revision(self, revision_id: str) -> Revision | None:
        return self.session.get(Revision, revision_id)

    def head(self, policy_id: str) -> Revision | None:
        return self.session.scalar(select(Revision).where(Revision.policy_id == policy_id)
                                   .order_by(Revision.seq.desc()).limit(1))

    def documents(self, policy_id: str, revision_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        if not revision_ids:
            return {}
        rows = self.session.execute(select(Revision.id, Revision.document)
                                    .where(Revision.policy_id == policy_id, Revision.id.in_(set(revision_ids))))
        return {rid: doc for rid, doc in rows}

    # -- rollouts --------------------------------------------------------------------------------

    def rollout(self, rollout_id: str) -> Rollout | None:
        return self.session.get(Rollout, rollout_id)

    # -- raw events --------------------------------------------------------------------------------

    def shape_groups(self, *, policy: str, start: dt.datetime | None, end: dt.datetime | None, limit: int,
                     fields: Collection[str], cuts: Mapping[str, Sequence[int]]) -> list[ShapeGroup]:
        """Recorded request shapes of a policy's requests in ``start <= time < end``, with counts.

        Only ``fields`` (of model, structured_output, tools, stream, max_tokens, prompt_tokens, labels)
        are read; the others come back as their defaults. ``max_tokens`` and ``prompt_tokens`` are
        read as the lower end of their interval between ``cuts`` (ascending): the rules can only
        tell those intervals apart, and far fewer shapes remain to decide.
        """
        def interval(column: Any, name: str) -> Any:
            points = sorted(set(cuts.get(name, ())))
            if not points:
                return literal_column("0")
            whens: list[tuple[Any, Any]] = [(column < point, literal_column(str(low)))
                                            for low, point in zip([0, *points], points, strict=False)]
            return case(*whens, else_=literal_column(str(points[-1])))

        available: dict[str, Any] = {
            "model": E.model, "structured_output": E.structured_output, "tools": E.tools, "stream": E.stream,
            "max_tokens": case((E.max_tokens.is_(None), None), else_=interval(E.max_tokens, "max_tokens")),
            "prompt_tokens": interval(func.coalesce(E.shape_prompt_tokens, E.prompt_tokens, 0), "prompt_tokens"),
            "labels": E.labels,
        }
        names = [name for name in available if name in fields]
        keys = [E.route, E.batch_size, *(available[name].label(name) for name in names)]
        conds = [E.policy == policy]
        if start is not None:
            conds.append(E.time >= start)
        if end is not None:
            conds.append(E.time < end)
        query = (select(*keys, func.sum(WEIGHT).label("n"), _weighted_count(E.speculate).label("spec"),
                        *_basis_columns())
                 .where(and_(*conds)).group_by(*keys).limit(limit))
        out = []
        for row in self.session.execute(query):
            m = row._mapping
            got = {name: m[name] for name in names}
            out.append(ShapeGroup(
                route=m["route"], model=got.get("model", ""), batch_size=m["batch_size"],
                structured_output=bool(got.get("structured_output", False)), tools=bool(got.get("tools", False)),
                stream=bool(got.get("stream", False)), max_tokens=got.get("max_tokens"),
                prompt_tokens=int(got.get("prompt_tokens") or 0), labels=got.get("labels", "{}"),
                requests=m["n"], speculated=m["spec"] or 0, events=int(m["events"]),
                sampled_events=int(m["sampled_events"])))
        return out

    def worker_totals(self, *, policy: str | None, route: str | None, start: dt.datetime | None,
                      end: dt.datetime | None, limit: int, by_replica: bool = False,
                      engine: str | None = None) -> list[dict[str, Any]]:
        """Per-worker counters from the raw events (rollups have no worker): weighted counts and sums, and
        for each mean its weighted sum and the weight of the rows that have the value (``*_weight``).

        With ``by_replica``, per engine and replica instead (rollups have no replica either); events
        that name no replica (older sidecars) form their engine's group with replica None.
        """
        keys: list[Any] = [E.engine, E.replica] if by_replica else [E.worker_id]
        conds = []
        for column, value in ((E.policy, policy), (E.route, route), (E.engine, engine)):
            if value is not None:
                conds.append(column == value)
        if start is not None:
            conds.append(E.time >= start)
        if end is not None:
            conds.append(E.time < end)

        def weighted_mean(column: Any, name: str) -> list[Any]:
            return [func.sum(column * WEIGHT).label(f"{name}_sum"),
                    _weighted_count(column.is_not(None)).label(f"{name}_weight")]

        query = (select(*keys,
                        func.sum(WEIGHT).label("requests"),
                        _weighted_count(E.status != "ok").label("errors"),
                        _weighted_count(E.status == "client_disconnect").label("client_disconnects"),
                        func.sum(E.retries * WEIGHT).label("retries"),
                        _weighted_count(E.fallback).label("fallbacks"),
                        _weighted_count(E.structured_valid.is_not(None)).label("structured_checked"),
                        _weighted_count(E.structured_valid.is_(True)).label("structured_valid"),
                        func.sum(E.spec_draft_tokens * WEIGHT).label("draft_tokens"),
                        func.sum(E.spec_accepted_tokens * WEIGHT).label("accepted_tokens"),
                        *weighted_mean(E.itl_ms, "itl_ms"), *weighted_mean(E.ttft_ms, "ttft_ms"),
                        *weighted_mean(E.e2e_ms, "e2e_ms"), *_basis_columns())
                 .where(*conds).group_by(*keys).order_by(*keys).limit(limit))
        return [dict(row._mapping) for row in self.session.execute(query)]
