"""Rows for tests that need policies before the policy API is the thing under test."""

from __future__ import annotations

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session

from controlplane.db import make_engine, make_sessionmaker, unit_of_work
from controlplane.distribution.publish import bump_generation
from controlplane.models import Policy, Revision
from policies import canonical_document, canonical_json, canonical_yaml, load_policy, revision_id

SEED_TEXT = """\
apiVersion: specgate/v1
name: {name}
engines:
  base: {{method: none}}
  draft: {{method: draft_model, model: models/draft, num_speculative_tokens: 3}}
rules:
  - name: chat-low-batch
    when: {{route: [chat], batch_size: {{max: {threshold}}}, structured_output: false}}
    then: {{engine: draft}}
default: {{engine: base}}
"""


def seed_text(name: str = "seed", threshold: int = 4) -> str:
    return SEED_TEXT.format(name=name, threshold=threshold)


def add_revision(session: Session, policy: Policy, text: str, *, activate: bool,
                 author: str = "admin:test", message: str = "") -> Revision:
    doc = load_policy(text)
    assert doc.name == policy.name
    rid = revision_id(doc)
    existing = session.get(Revision, rid)
    if existing is not None:
        return existing
    head = session.scalar(select(Revision).where(Revision.policy_id == policy.id)
                          .order_by(Revision.seq.desc()).limit(1))
    seq = (session.scalar(select(func.max(Revision.seq)).where(Revision.policy_id == policy.id)) or 0) + 1
    normal = canonical_document(doc)
    revision = Revision(id=rid, policy_id=policy.id, seq=seq, parent_id=head.id if head else None,
                        document=normal, canonical_json=canonical_json(normal).decode(),
                        canonical_yaml=canonical_yaml(doc), source_text=text, author=author, message=message)
    session.add(revision)
    session.flush()
    if activate:
        policy.active_revision_id = rid
        bump_generation(session)
    return revision


def seed_policy(database_url: str, text: str | None = None, *, name: str = "seed", pool: str | None = None,
                extra_revisions: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """Create a policy with an active first revision (and inactive later ones).

    Returns the policy id and the revision ids in order.
    """
    engine = make_engine(database_url)
    try:
        with unit_of_work(make_sessionmaker(engine)) as session:
            policy = Policy(name=name, pool=pool, created_by="admin:test")
            session.add(policy)
            session.flush()
            ids = [add_revision(session, policy, text or seed_text(name), activate=True).id]
            for extra in extra_revisions:
                ids.append(add_revision(session, policy, extra, activate=False).id)
            return policy.id, ids
    finally:
        engine.dispose()


def empty_postgres_schema(url: str) -> str:
    """Drop everything in the PostgreSQL database's public schema (a run's own database, reused per test)."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
    finally:
        engine.dispose()
    return url
