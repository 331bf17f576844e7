"""The policies API: policies, revisions (YAML or JSON), validation, diffs and dry-run decisions."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from controlplane.db import unit_of_work
from controlplane.deps import Admin, Announce, Reader, SessionDep
from controlplane.errors import (
    AUTH_RESPONSES,
    INVALID_RESPONSE,
    TOO_LARGE_RESPONSE,
    PolicyInvalid,
    PreconditionFailed,
    UnsupportedMediaType,
    ValidationFailed,
    parse_json_body,
    problem_response,
)
from controlplane.models import Policy, Revision
from controlplane.policy import service
from controlplane.policy.schemas import (
    SEED_EXAMPLE,
    ChangeSummaryRead,
    DecisionRead,
    DiffRead,
    DraftDiffRead,
    EvaluateRequest,
    Evaluation,
    PolicyCreate,
    PolicyRead,
    RevisionCreate,
    RevisionPage,
    RevisionRead,
    RevisionRef,
    RevisionSummary,
    ShapeRead,
    ValidateRequest,
    ValidationRead,
)
from policies.jsonschema import SCHEMA_PATH

router = APIRouter(prefix="/v1", tags=["policies"])

YAML_TYPES = ("application/yaml", "text/yaml", "application/x-yaml")
JSON_TYPE = "application/json"
_NO_NUL = r"^[^\x00]*$"
# Losing to a rival more often than this (SQLite only: PostgreSQL orders
# submissions with a row lock) answers 409 rather than holding the request.
_RACE_ATTEMPTS = 3

_AUTH = AUTH_RESPONSES
_NOT_FOUND = problem_response("no such policy or revision")


def _media_type(header: str | None) -> tuple[str, dict[str, str]]:
    if not header:
        return "", {}
    media, *params = header.split(";")
    parsed = {}
    for param in params:
        key, _, value = param.partition("=")
        parsed[key.strip().lower()] = value.strip().strip('"').lower()
    return media.strip().lower(), parsed


def _unsupported(got: str, accepted: tuple[str, ...]) -> UnsupportedMediaType:
    message = f"Content-Type {got or '(none)'!r} is not accepted; send one of: {', '.join(accepted)}"
    return UnsupportedMediaType(message, errors=[{"path": "Content-Type", "in": "header",
                                                  "code": "unsupported_media_type", "message": message}])


def _json_content(request: Request) -> None:
    # FastAPI would hand a non-JSON body to the model as bytes and report a
    # confusing type error; the media type is the actual mistake.
    media, _ = _media_type(request.headers.get("content-type"))
    if media != JSON_TYPE:
        raise _unsupported(media, (JSON_TYPE,))


async def _raw_body(request: Request) -> bytes:
    # Async so the sync endpoint below can have the body it cannot await.
    return await request.body()


def _policy_read(view: service.PolicyView) -> PolicyRead:
    p = view.policy
    return PolicyRead(id=p.id, name=p.name, description=p.description, pool=p.pool,
                      active_revision_id=p.active_revision_id, head_revision_id=view.head_revision_id,
                      revision_count=view.revision_count, created_at=p.created_at, created_by=p.created_by)


def _revision_summary(revision: Revision, policy: Policy) -> RevisionSummary:
    return RevisionSummary(id=revision.id, seq=revision.seq, parent_id=revision.parent_id,
                           author=revision.author, message=revision.message, created_at=revision.created_at,
                           active=policy.active_revision_id == revision.id)


def _revision_read(revision: Revision, policy: Policy) -> RevisionRead:
    return RevisionRead(**_revision_summary(revision, policy).model_dump(), policy=policy.name,
                        document=revision.document, canonical_yaml=revision.canonical_yaml,
                        source_text=revision.source_text)


# --- policies ----------------------------------------------------------------------------

@router.post("/policies", status_code=201, response_model=PolicyRead, summary="Create a policy",
             responses={**_AUTH, 409: problem_response("the name is taken, or another policy serves that pool"),
                        **TOO_LARGE_RESPONSE, 415: problem_response("the body is not application/json"),
                        **INVALID_RESPONSE})
def create_policy(body: PolicyCreate, session: SessionDep, announce: Announce, response: Response,
                  who: Admin, _json: Annotated[None, Depends(_json_content)]) -> PolicyRead:
    """A policy starts without revisions; its first revision becomes active at once."""
    policy, generation = service.create_policy(session, name=body.name, description=body.description,
                                               pool=body.pool, actor=who.actor)
    announce(generation)
    response.headers["Location"] = f"/v1/policies/{policy.name}"
    return _policy_read(service.PolicyView(policy, None, 0))


@router.get("/policies", response_model=list[PolicyRead], summary="List policies",
            responses={**_AUTH})
def list_policies(session: SessionDep, _: Reader) -> list[PolicyRead]:
    return [_policy_read(v) for v in service.list_policies(session)]


@router.get("/policies/{name}", response_model=PolicyRead, summary="Get a policy",
            responses={**_AUTH, 404: _NOT_FOUND, **INVALID_RESPONSE})
def get_policy(name: str, session: SessionDep, _: Reader) -> PolicyRead:
    return _policy_read(service.get_policy(session, name))


@router.post(
    "/policies/{name}/validate", response_model=ValidationRead, summary="Validate a draft without storing it",
    responses={**_AUTH, 404: _NOT_FOUND, **TOO_LARGE_RESPONSE,
               415: problem_response("the body is not application/json"),
               422: problem_response("the document is invalid: every error with its path, code, message and "
                                     "line (for text); or a shape is malformed", PolicyInvalid(
                   "the document has 1 error",
                   errors=[{"path": "rules[0].when.batch_size.max", "code": "inverted_range",
                            "message": "max (4) is below min (5): the range is empty", "line": 9,
                            "column": 40}]).to_problem())},
)
def validate(name: str, body: ValidateRequest, session: SessionDep, _: Reader,
             _json: Annotated[None, Depends(_json_content)]) -> ValidationRead:
    """Checks a draft of a new revision of the policy exactly as adding it would, and stores nothing:
    errors come back as a 422 problem with paths and, for text, lines. The answer carries the diff against
    the policy's active revision and, given `shapes`, the decisions the draft would make (a dry run)."""
    if isinstance(body.document, str):
        submission = service.Submission(text=body.document)
    else:
        submission = service.Submission(data=body.document)
    check = service.check_draft(session, submission=submission, policy_name=name, shapes=body.shapes)
    diff_read = None
    if check.active is not None and check.unified is not None and check.summary is not None:
        s = check.summary
        diff_read = DraftDiffRead(
            against=RevisionRef(id=check.active.id, seq=check.active.seq),
            identical=check.active.id == check.loaded.id, unified=check.unified,
            summary=ChangeSummaryRead.model_validate(s, from_attributes=True))
    return ValidationRead(
        valid=True, revision_id=check.loaded.id, name=check.loaded.document.name,
        canonical_yaml=check.loaded.canonical_yaml, existing=check.existing, diff=diff_read,
        evaluations=[Evaluation(shape=ShapeRead(**shape.to_dict()), decision=DecisionRead(**d.to_dict()))
                     for shape, d in check.decisions])


# --- revisions ---------------------------------------------------------------------------

_REVISION_BODY = {
    "required": True,
    "description": "The document as YAML (or JSON) text with a YAML content type, or a JSON object "
                   "{document, message}. Errors in text come back with line numbers.",
    "content": {
        "application/yaml": {"schema": {"type": "string"}, "example": SEED_EXAMPLE},
        "text/yaml": {"schema": {"type": "string"}},
        "application/x-yaml": {"schema": {"type": "string"}},
        JSON_TYPE: {"schema": RevisionCreate.model_json_schema()},
    },
}


def _header_text(value: str | None) -> str | None:
    # HTTP headers arrive as latin-1; a UTF-8 message sent raw reads back right this way.
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _submission(request: Request, body: bytes, message: str) -> service.Submission:
    media, params = _media_type(request.headers.get("content-type"))
    if media in YAML_TYPES:
        charset = params.get("charset", "utf-8")
        if charset not in ("utf-8", "utf8", "us-ascii"):
            raise _unsupported(f"{media}; charset={charset}",
                               tuple(f"{t}; charset=utf-8" for t in YAML_TYPES))
        return service.Submission(text=body, message=message)
    if media != JSON_TYPE:
        raise _unsupported(media, (*YAML_TYPES, JSON_TYPE))
    data = parse_json_body(body)
    try:
        payload = RevisionCreate.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None
    if isinstance(payload.document, str):
        return service.Submission(text=payload.document, message=payload.message or message)
    return service.Submission(data=payload.document, message=payload.message or message)


def _submit_once(request: Request, name: str, submission: service.Submission,
                 if_match: service.IfMatch | None,
                 actor: str) -> tuple[RevisionRead, service.RevisionOutcome]:
    with unit_of_work(request.app.state.sessions) as session:
        outcome = service.create_revision(session, policy_name=name, submission=submission,
                                          if_match=if_match, actor=actor)
        return _revision_read(outcome.revision, outcome.policy), outcome


def _submit(request: Request, name: str, submission: service.Submission, if_match: service.IfMatch | None,
            actor: str) -> tuple[RevisionRead, service.RevisionOutcome]:
    for _ in range(_RACE_ATTEMPTS - 1):
        try:
            return _submit_once(request, name, submission, if_match, actor)
        except service.RevisionRace:
            # The rival has committed by now, so the next pass answers as if
            # it had come second all along: unchanged, 412 against the new
            # head, or (for If-Match: *) the next seq.
            continue
    return _submit_once(request, name, submission, if_match, actor)


@router.post(
    "/policies/{name}/revisions", status_code=201, response_model=RevisionRead,
    summary="Add a revision (YAML or JSON)",
    openapi_extra={"requestBody": _REVISION_BODY},
    responses={
        200: {"description": "an equal document is already a revision of this policy: nothing was created "
                             "(header X-Specgate-Unchanged: true)", "model": RevisionRead},
        201: {"description": "created; ETag is the revision id, Location its URL"},
        400: problem_response("If-Match is malformed"),
        **_AUTH, 404: _NOT_FOUND,
        409: problem_response("another revision was created at the same moment; retry against the new head"),
        412: problem_response("If-Match does not name the head revision", PreconditionFailed(
            "If-Match does not name the policy's head revision", current_head="4f0c...e1").to_problem()),
        **TOO_LARGE_RESPONSE,
        415: problem_response("unsupported Content-Type"),
        422: problem_response("the document is invalid: every error with its path, code, message and line",
                              PolicyInvalid("the document has 1 error", errors=[
                                  {"path": "rules[0].then.engine", "code": "undefined_engine",
                                   "message": "engine 'drfat' is not defined in engines (defined: base, draft); "
                                              "did you mean 'draft'?", "line": 9, "column": 25}]).to_problem()),
        428: problem_response("the policy has a head revision and If-Match is missing"),
    },
)
def create_revision(
    name: str, request: Request, response: Response, who: Admin,
    body: Annotated[bytes, Depends(_raw_body)],
    message: str | None = Query(None, max_length=4000, pattern=_NO_NUL,
                                description="the revision message, for YAML bodies"),
    x_specgate_message: str | None = Header(None, max_length=4000,
                                            description="the revision message, if not in the query"),
    if_match: str | None = Header(None, alias="If-Match",
                                  description='"<head revision id>" (quoted or bare) or *; required once '
                                              "the policy has a revision"),
) -> RevisionRead:
    """Adds an immutable revision. The first revision becomes active; later ones are drafts until a
    rollout completes or a rollback names them."""
    fallback_message = message if message is not None else (_header_text(x_specgate_message) or "")
    submission = _submission(request, body, fallback_message)
    condition = service.parse_if_match(if_match) if if_match is not None else None
    read, outcome = _submit(request, name, submission, condition, who.actor)
    if outcome.generation is not None:
        request.app.state.hub.publish(outcome.generation)
    response.headers["ETag"] = f'"{read.id}"'
    response.headers["Location"] = f"/v1/revisions/{read.id}"
    if not outcome.created:
        response.status_code = 200
        response.headers["X-Specgate-Unchanged"] = "true"
    return read


@router.get("/policies/{name}/revisions", response_model=RevisionPage, summary="List a policy's revisions",
            responses={**_AUTH, 404: _NOT_FOUND, **INVALID_RESPONSE})
def list_revisions(name: str, session: SessionDep, _: Reader,
                   cursor: int | None = Query(None, ge=1, le=2**31 - 1,
                                              description="next_cursor of the previous page"),
                   limit: int = Query(50, ge=1, le=500)) -> RevisionPage:
    """Newest first (by seq)."""
    policy, rows, next_cursor = service.revision_page(session, name, before_seq=cursor, limit=limit)
    return RevisionPage(items=[_revision_summary(r, policy) for r in rows], next_cursor=next_cursor)


@router.get("/policies/{name}/diff", response_model=DiffRead, summary="Diff two revisions of a policy",
            responses={**_AUTH, 404: problem_response("no such policy, or from/to is not one of its revisions"),
                       **INVALID_RESPONSE})
def diff(name: str, session: SessionDep, _: Reader,
         from_: str | None = Query(None, alias="from", description="revision id; default: the active one"),
         to: str | None = Query(None, description="revision id; default: the head")) -> DiffRead:
    """A unified diff of the canonical YAML, and which rules and engines changed."""
    d = service.diff_revisions(session, name, from_id=from_, to_id=to)
    return DiffRead(
        policy=d.policy.name,
        from_revision=RevisionRef(id=d.before.id, seq=d.before.seq),
        to_revision=RevisionRef(id=d.after.id, seq=d.after.seq),
        identical=d.before.id == d.after.id, unified=d.unified,
        summary=ChangeSummaryRead.model_validate(d.summary, from_attributes=True),
    )


@router.get("/revisions/{revision_id}", response_model=RevisionRead, summary="Get a revision",
            responses={200: {"description": "the revision; ETag is its id"}, **_AUTH, 404: _NOT_FOUND,
                       **INVALID_RESPONSE})
def get_revision(revision_id: str, session: SessionDep, response: Response,
                 _: Reader) -> RevisionRead:
    revision, policy = service.get_revision(session, revision_id)
    response.headers["ETag"] = f'"{revision.id}"'
    return _revision_read(revision, policy)


@router.post("/revisions/{revision_id}/evaluate", response_model=list[Evaluation],
             summary="Decide request shapes under a revision",
             responses={**_AUTH, 404: _NOT_FOUND, **TOO_LARGE_RESPONSE,
                        415: problem_response("the body is not application/json"),
                        422: problem_response("a shape is malformed", ValidationFailed(
                            "1 problem in the request shapes",
                            errors=[{"path": "shapes[3].batch_size", "in": "body", "code": "wrong_type",
                                     "message": "expected an integer, got str"}]).to_problem())})
def evaluate(revision_id: str, body: EvaluateRequest, session: SessionDep,
             _: Reader, _json: Annotated[None, Depends(_json_content)]) -> list[Evaluation]:
    """What a worker running this revision would decide for each shape (ignoring the kill switch and
    canaries). Up to 1000 shapes."""
    results = service.evaluate(session, revision_id, body.shapes)
    return [Evaluation(shape=ShapeRead(**shape.to_dict()), decision=DecisionRead(**decision.to_dict()))
            for shape, decision in results]


# --- the document schema -------------------------------------------------------------------------

SCHEMA_TYPE = "application/schema+json"


@functools.cache
def _policy_schema() -> bytes:
    # The committed file, byte for byte: what the examples' editors load (a test keeps it generated).
    return SCHEMA_PATH.read_bytes()


@router.get("/schema/policy", response_class=Response, summary="The JSON Schema of a policy document",
            responses={200: {"description": "JSON Schema (draft 2020-12) of a specgate/v1 document",
                             "content": {SCHEMA_TYPE: {"schema": {"type": "object"}}}}})
def policy_schema() -> Response:
    """For editors and tools that check a policy as it is typed; no key needed, like /openapi.json. It checks
    each value on its own; references between fields (engine names, shadowed rules) are checked when a revision
    is validated or added."""
    return Response(_policy_schema(), media_type=SCHEMA_TYPE)
