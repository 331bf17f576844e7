"""Policies and their immutable, content-addressed revisions."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.audit.service import record
from controlplane.distribution.publish import bump_generation
from controlplane.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PolicyInvalid,
    PreconditionFailed,
    PreconditionRequired,
    ValidationFailed,
)
from controlplane.lru import LRU
from controlplane.models import Policy, Revision
from controlplane.policy.repository import PolicyRepository, RevisionRepository
from controlplane.rollout.service import fleet_cohort_secret
from policies import (
    CompiledPolicy,
    Decision,
    ErrorCode,
    FieldError,
    PolicyDocument,
    PolicyValidationError,
    RequestShape,
    RequestShapeError,
    canonical_document,
    canonical_json,
    canonical_yaml,
    compile_policy,
    load_policy,
    revision_id,
    validate_data,
)
from policies.model import Identifier

# Lookups reject what cannot be a name or an id before it reaches SQL:
# PostgreSQL refuses a NUL in a parameter with an error, not an empty result.
_NAME: TypeAdapter[str] = TypeAdapter(Identifier)
_REVISION_ID = re.compile(r"[0-9a-f]{64}")


def _is_name(value: str) -> bool:
    try:
        _NAME.validate_python(value)
    except ValidationError:
        return False
    return True


def _is_revision_id(value: str) -> bool:
    return _REVISION_ID.fullmatch(value) is not None


# --- policies --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PolicyView:
    policy: Policy
    head_revision_id: str | None
    revision_count: int


def create_policy(session: Session, *, name: str, description: str | None, pool: str | None,
                  actor: str) -> tuple[Policy, int]:
    """Returns the policy and the generation to announce after commit."""
    # Taken first: the generation row's lock serialises concurrent creates, so
    # the pool check below sees a rival that committed a moment ago (the pool
    # rule has no unique constraint to fall back on). The bump itself is
    # needed too: a pool that gains a policy stops falling back to the
    # pool-less one.
    generation = bump_generation(session)
    policies = PolicyRepository(session)
    if policies.get_by_name(name) is not None:
        raise Conflict(f"a policy named {name!r} already exists",
                       errors=[{"path": "name", "code": "duplicate", "message": "name is taken"}])
    rival = policies.get_by_pool(pool)
    if rival is not None:
        what = f"pool {pool!r}" if pool is not None else "every pool without a policy of its own"
        raise Conflict(f"policy {rival.name!r} already serves {what}", policy=rival.name,
                       errors=[{"path": "pool", "code": "pool_taken",
                                "message": f"already served by policy {rival.name!r}"}])
    policy = Policy(name=name, description=description, pool=pool, created_by=actor)
    try:
        policies.add(policy)
    except IntegrityError:
        raise Conflict(f"a policy named {name!r} already exists",
                       errors=[{"path": "name", "code": "duplicate", "message": "name is taken"}]) from None
    record(session, actor=actor, action="policy.create", target_type="policy", target_id=name,
           after={"id": policy.id, "name": name, "pool": pool, "description": description})
    return policy, generation


def list_policies(session: Session) -> list[PolicyView]:
    return [PolicyView(p, head, n) for p, head, n in PolicyRepository(session).list_with_stats()]


def get_policy(session: Session, name: str) -> PolicyView:
    policy = _policy(session, name)
    [(_, head, n)] = PolicyRepository(session).list_with_stats(policy.id)
    return PolicyView(policy, head, n)


def _policy(session: Session, name: str, *, for_update: bool = False) -> Policy:
    policy = PolicyRepository(session).get_by_name(name, for_update=for_update) if _is_name(name) else None
    if policy is None:
        raise NotFound(f"policy {name!r} does not exist")
    return policy


# --- submitting revisions ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Submission:
    """A document as sent: raw text (YAML or JSON) or an already parsed mapping."""

    text: str | bytes | None = None
    data: Mapping[str, Any] | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class LoadedDocument:
    document: PolicyDocument
    id: str
    canonical: dict[str, Any]
    canonical_json: str
    canonical_yaml: str
    source_text: str | None


def load_submission(submission: Submission) -> LoadedDocument:
    """Validate a submission, reporting every problem (with YAML lines for text) as one 422."""
    try:
        if submission.data is not None:
            document = validate_data(submission.data)
            source = json.dumps(submission.data, indent=2, ensure_ascii=False)
        else:
            raw = submission.text if submission.text is not None else b""
            document = load_policy(raw)
            source = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        canonical = canonical_document(document)
        loaded = LoadedDocument(document, revision_id(document), canonical,
                                canonical_json(canonical).decode("utf-8"), canonical_yaml(document), source)
        # The database stores UTF-8 text: a lone surrogate (from a \ud800 escape) cannot be stored.
        loaded.canonical_yaml.encode("utf-8")
        source.encode("utf-8")
    except PolicyValidationError as exc:
        raise PolicyInvalid.from_field_errors(exc.errors) from None
    except RecursionError:
        # The YAML reader recurses once per nesting level; no valid policy nests this deep.
        raise PolicyInvalid.from_field_errors([FieldError(
            "", ErrorCode.too_deep, "the document nests too deeply to be a policy")]) from None
    except UnicodeError:
        raise PolicyInvalid.from_field_errors([FieldError(
            "", ErrorCode.invalid_encoding, "the document contains text that is not valid Unicode "
            "(e.g. a lone surrogate escape)")]) from None
    return loaded


@dataclass(frozen=True, slots=True)
class IfMatch:
    """A parsed If-Match header: ``*`` or a set of strong entity tags."""

    any: bool
    tags: frozenset[str]

    def matches(self, head_id: str | None) -> bool:
        # `*` is accepted even before the first revision, so a client that
        # always sends it need not special-case a new policy.
        return self.any or (head_id is not None and head_id in self.tags)


def parse_if_match(value: str) -> IfMatch:
    """Quoted (``"id"``) or bare (``id``) tags, comma separated, or ``*``.

    Weak tags (``W/"id"``) are read but never match: If-Match compares strongly.
    """
    star = False
    tags: set[str] = set()
    seen = 0
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        seen += 1
        if part == "*":
            star = True
        elif part.startswith("W/"):
            continue
        elif part.startswith('"') or part.endswith('"'):
            if len(part) < 3 or not (part.startswith('"') and part.endswith('"')):
                raise _bad_if_match(f"entity tag {part!r} is not quoted properly")
            tags.add(part[1:-1])
        else:
            tags.add(part)
    if not seen:
        raise _bad_if_match("If-Match names no entity tag")
    return IfMatch(star, frozenset(tags))


def _bad_if_match(message: str) -> BadRequest:
    return BadRequest(message + '; send If-Match: "<head revision id>" or *',
                      errors=[{"path": "If-Match", "in": "header", "code": "malformed", "message": message}])


class RevisionRace(Conflict):
    """Another revision took this seq (or this id) between our read and our insert."""


@dataclass(frozen=True, slots=True)
class RevisionOutcome:
    revision: Revision
    policy: Policy
    created: bool
    generation: int | None  # to announce after commit; None when no bundle can have changed


def create_revision(session: Session, *, policy_name: str, submission: Submission,
                    if_match: IfMatch | None, actor: str) -> RevisionOutcome:
    # FOR UPDATE orders concurrent submissions to one policy on PostgreSQL; on
    # SQLite the (policy_id, seq) constraint catches the race instead.
    policy = _policy(session, policy_name, for_update=True)
    loaded = load_submission(submission)
    if loaded.document.name != policy.name:
        raise PolicyInvalid("the document's name must equal the policy's name", errors=[{
            "path": "name", "code": "name_mismatch",
            "message": f"document name {loaded.document.name!r} differs from policy {policy.name!r}",
        }])
    revisions = RevisionRepository(session)
    existing = revisions.get(loaded.id)
    if existing is not None:
        if existing.policy_id != policy.id:  # names are unique, so this cannot happen; say so if it does
            raise Conflict(f"revision {loaded.id} belongs to another policy")
        return RevisionOutcome(existing, policy, created=False, generation=None)

    head = revisions.head(policy.id)
    if head is not None and if_match is None:
        raise PreconditionRequired(
            f'policy {policy.name!r} has a head revision: send If-Match: "{head.id}" (or *) to build on it',
            current_head=head.id, errors=[{"path": "If-Match", "in": "header", "code": "missing",
                                           "message": "required once the policy has a revision"}])
    if if_match is not None and not if_match.matches(head.id if head else None):
        raise PreconditionFailed(
            "If-Match does not name the policy's head revision: fetch the head and submit against it",
            current_head=head.id if head else None,
            headers={"ETag": f'"{head.id}"'} if head else None,
            errors=[{"path": "If-Match", "in": "header", "code": "stale",
                     "message": f"the head is {head.id}" if head else "the policy has no revision yet"}])

    revision = Revision(
        id=loaded.id, policy_id=policy.id, seq=head.seq + 1 if head else 1,
        parent_id=head.id if head else None, document=loaded.canonical,
        canonical_json=loaded.canonical_json, canonical_yaml=loaded.canonical_yaml,
        source_text=loaded.source_text, author=actor, message=submission.message,
    )
    try:
        revisions.add(revision)
    except IntegrityError:
        raise RevisionRace("another revision of this policy was created at the same time; "
                           "fetch the head and submit again") from None

    generation: int | None = None
    activated = policy.active_revision_id is None
    if activated:
        # Nothing to roll out from: the first revision is what the policy means.
        policy.active_revision_id = revision.id
        generation = bump_generation(session)
    record(session, actor=actor, action="revision.create", target_type="revision", target_id=revision.id,
           after={"id": revision.id, "seq": revision.seq, "message": revision.message,
                  "policy": policy.name, "parent_id": revision.parent_id, "activated": activated})
    return RevisionOutcome(revision, policy, created=True, generation=generation)


# --- reading revisions -------------------------------------------------------------------

def revision_page(session: Session, policy_name: str, *, before_seq: int | None,
                  limit: int) -> tuple[Policy, list[Revision], int | None]:
    """A page of revisions, newest first, and the cursor of the next page (None at the end)."""
    policy = _policy(session, policy_name)
    rows = list(RevisionRepository(session).page(policy.id, before_seq=before_seq, limit=limit + 1))
    more = len(rows) > limit
    rows = rows[:limit]
    return policy, rows, rows[-1].seq if more else None


def get_revision(session: Session, rid: str) -> tuple[Revision, Policy]:
    revision = RevisionRepository(session).get(rid) if _is_revision_id(rid) else None
    if revision is None:
        raise NotFound(f"revision {rid!r} does not exist")
    policy = PolicyRepository(session).get(revision.policy_id)
    if policy is None:  # the foreign key cascades, so only a broken database gets here
        raise NotFound(f"revision {rid!r} has no policy")
    return revision, policy


# --- diffs -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChangeSummary:
    rules_added: tuple[str, ...] = ()
    rules_removed: tuple[str, ...] = ()
    rules_changed: tuple[str, ...] = ()
    rules_moved: tuple[str, ...] = ()
    engines_added: tuple[str, ...] = ()
    engines_removed: tuple[str, ...] = ()
    engines_changed: tuple[str, ...] = ()
    fields_changed: tuple[str, ...] = ()


def _rules_by_name(document: Mapping[str, Any]) -> dict[str, Any]:
    rules = document.get("rules") or []
    return {r["name"]: r for r in rules if isinstance(r, Mapping) and "name" in r}


def summarize_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> ChangeSummary:
    """What changed between two canonical documents, by rule and engine name."""
    old_rules, new_rules = _rules_by_name(before), _rules_by_name(after)
    common_before = [n for n in old_rules if n in new_rules]
    common_after = [n for n in new_rules if n in old_rules]
    old_engines: Mapping[str, Any] = before.get("engines") or {}
    new_engines: Mapping[str, Any] = after.get("engines") or {}
    other = [k for k in dict.fromkeys([*before, *after]) if k not in ("rules", "engines")]
    return ChangeSummary(
        rules_added=tuple(n for n in new_rules if n not in old_rules),
        rules_removed=tuple(n for n in old_rules if n not in new_rules),
        rules_changed=tuple(n for n in common_after if old_rules[n] != new_rules[n]),
        # First match wins, so a rule that only moved still changes decisions.
        rules_moved=tuple(n for a, n in zip(common_before, common_after, strict=True) if a != n),
        engines_added=tuple(n for n in new_engines if n not in old_engines),
        engines_removed=tuple(n for n in old_engines if n not in new_engines),
        engines_changed=tuple(n for n in new_engines
                              if n in old_engines and old_engines[n] != new_engines[n]),
        fields_changed=tuple(k for k in other if before.get(k) != after.get(k)),
    )


def unified_diff(before: str, after: str, *, from_label: str, to_label: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=from_label, tofile=to_label))


@dataclass(frozen=True, slots=True)
class RevisionDiff:
    policy: Policy
    before: Revision
    after: Revision
    unified: str
    summary: ChangeSummary


def diff_revisions(session: Session, policy_name: str, *, from_id: str | None,
                   to_id: str | None) -> RevisionDiff:
    """Diff two revisions of one policy; by default the active one against the head."""
    policy = _policy(session, policy_name)
    revisions = RevisionRepository(session)

    def pick(rid: str | None, param: str, fallback: Callable[[], Revision | None]) -> Revision:
        if rid is None:
            found = fallback()
            if found is None:
                raise NotFound(f"policy {policy.name!r} has no revisions to compare")
            return found
        revision = revisions.get(rid) if _is_revision_id(rid) else None
        if revision is None or revision.policy_id != policy.id:
            raise NotFound(f"{rid!r} is not a revision of policy {policy.name!r}", errors=[{
                "path": param, "in": "query", "code": "unknown_revision",
                "message": "no such revision of this policy"}])
        return revision

    before = pick(from_id, "from", lambda: revisions.get(policy.active_revision_id)
                  if policy.active_revision_id else None)
    after = pick(to_id, "to", lambda: revisions.head(policy.id))
    text = unified_diff(before.canonical_yaml, after.canonical_yaml,
                        from_label=f"{policy.name}@{before.seq} ({before.id[:12]})",
                        to_label=f"{policy.name}@{after.seq} ({after.id[:12]})")
    return RevisionDiff(policy, before, after, text, summarize_changes(before.document, after.document))


# --- evaluation --------------------------------------------------------------------------

# Revisions are immutable and their ids are content hashes, so an entry never
# goes stale; each keeps the cohort secret it was compiled with, so one cache
# may serve any database (each has its own secret).
compiled_policies: LRU[str, tuple[str, CompiledPolicy]] = LRU(64)


def _compiled(session: Session, rid: str) -> CompiledPolicy:
    revisions = RevisionRepository(session)
    if not _is_revision_id(rid) or not revisions.exists(rid):
        raise NotFound(f"revision {rid!r} does not exist")
    # Exploration cohorts are salted with the fleet's secret: decided with it, as the sidecars decide.
    secret = fleet_cohort_secret(session)
    cached = compiled_policies.get(rid)
    if cached is not None and cached[0] == secret:
        return cached[1]
    # Compiling outside the lock: two threads may both compile a cold
    # revision, which wastes a little work but never blocks readers.
    revision = revisions.get(rid)
    assert revision is not None
    compiled = compile_policy(validate_data(revision.document), rid, cohort_secret=secret)
    compiled_policies.put(rid, (secret, compiled))
    return compiled


def _read_shape(index: int, data: Any) -> tuple[RequestShape | None, list[dict[str, Any]]]:
    where = f"shapes[{index}]"
    try:
        shape = RequestShape.from_dict(data)
    except RequestShapeError as exc:
        return None, [{"path": f"{where}.{e.path}" if e.path else where, "in": "body", "code": e.code,
                       "message": e.message} for e in exc.errors]
    problems = []
    for key, value in data.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeError:
            # JSON lets a client send a lone surrogate (\ud800); it could not be echoed back.
            problems.append({"path": f"{where}.{key}", "in": "body", "code": "invalid_encoding",
                             "message": "contains text that is not valid Unicode (a lone surrogate)"})
    return shape, problems


def _read_shapes(shapes: Sequence[Any]) -> list[RequestShape]:
    """Read every shape, collecting all their problems into one 422 rather than stopping at the first."""
    parsed: list[RequestShape] = []
    errors: list[dict[str, Any]] = []
    for i, data in enumerate(shapes):
        shape, problems = _read_shape(i, data)
        errors.extend(problems)
        if shape is not None:
            parsed.append(shape)
    if errors:
        n = len(errors)
        raise ValidationFailed(f"{n} problem{'s' if n != 1 else ''} in the request shapes", errors=errors)
    return parsed


def evaluate(session: Session, rid: str, shapes: Sequence[Any]) -> list[tuple[RequestShape, Decision]]:
    """Decide each shape under one revision, as a worker running it would (kill switch aside)."""
    compiled = _compiled(session, rid)
    parsed = _read_shapes(shapes)
    return [(shape, compiled.decide(shape)) for shape in parsed]


# --- validating a draft ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DraftCheck:
    """A draft checked without being stored: what it would be, and how it differs from the active one."""

    loaded: LoadedDocument
    policy: Policy
    active: Revision | None
    unified: str | None
    summary: ChangeSummary | None
    decisions: list[tuple[RequestShape, Decision]]
    existing: bool


def check_draft(session: Session, *, submission: Submission, policy_name: str,
                shapes: Sequence[Any]) -> DraftCheck:
    """Validate a draft of a policy's next revision as ``create_revision`` would, store nothing, and
    dry-run shapes under it. The diff is against the policy's active revision."""
    policy = _policy(session, policy_name)
    loaded = load_submission(submission)
    if loaded.document.name != policy.name:
        raise PolicyInvalid("the document's name must equal the policy's name", errors=[{
            "path": "name", "code": "name_mismatch",
            "message": f"document name {loaded.document.name!r} differs from policy {policy.name!r}",
        }])
    active = None
    unified = summary = None
    if policy.active_revision_id is not None:
        active = RevisionRepository(session).get(policy.active_revision_id)
        if active is not None:
            unified = unified_diff(active.canonical_yaml, loaded.canonical_yaml,
                                   from_label=f"{policy.name}@{active.seq} (active)",
                                   to_label=f"{policy.name} (draft {loaded.id[:12]})")
            summary = summarize_changes(active.document, loaded.canonical)
    parsed = _read_shapes(shapes)
    compiled = (compile_policy(loaded.document, loaded.id, cohort_secret=fleet_cohort_secret(session))
                if parsed else None)
    decisions = [(shape, compiled.decide(shape)) for shape in parsed] if compiled is not None else []
    existing = RevisionRepository(session).exists(loaded.id)
    return DraftCheck(loaded, policy, active, unified, summary, decisions, existing)
