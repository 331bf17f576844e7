"""Every SQL statement of the analysis: policies, revision documents, recorded request shapes.

Latency figures come from the telemetry rollups (``controlplane.telemetry``);
the raw events are read here only where a question needs what rollups do not
keep: the request shapes a what-if replays, and per-worker and per-replica totals.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, literal_column, select
from sqlalchemy.orm import Session

from controlplane.models import Policy, Revision, Rollout, TelemetryEventRecord

E = TelemetryEventRecord


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
    requests: int
    speculated: int


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
        query = (select(*keys, func.count().label("n"), func.sum(case((E.speculate, 1), else_=0)).label("spec"))
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
                requests=int(m["n"]), speculated=int(m["spec"] or 0)))
        return out

    def worker_totals(self, *, policy: str | None, route: str | None, start: dt.datetime | None,
                      end: dt.datetime | None, limit: int, by_replica: bool = False,
                      engine: str | None = None) -> list[dict[str, Any]]:
        """Per-worker counters from the raw events (rollups have no worker): counts, sums and means.

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
        query = (select(*keys,
                        func.count().label("requests"),
                        func.sum(case((E.status != "ok", 1), else_=0)).label("errors"),
                        func.sum(case((E.status == "client_disconnect", 1), else_=0)).label("client_disconnects"),
                        func.sum(E.retries).label("retries"),
                        func.sum(case((E.fallback, 1), else_=0)).label("fallbacks"),
                        func.sum(case((E.structured_valid.is_not(None), 1), else_=0)).label("structured_checked"),
                        func.sum(case((E.structured_valid.is_(True), 1), else_=0)).label("structured_valid"),
                        func.sum(E.spec_draft_tokens).label("draft_tokens"),
                        func.sum(E.spec_accepted_tokens).label("accepted_tokens"),
                        cast(func.avg(E.itl_ms), Float).label("itl_ms_mean"),
                        cast(func.avg(E.ttft_ms), Float).label("ttft_ms_mean"),
                        cast(func.avg(E.e2e_ms), Float).label("e2e_ms_mean"))
                 .where(*conds).group_by(*keys).order_by(*keys).limit(limit))
        return [dict(row._mapping) for row in self.session.execute(query)]
