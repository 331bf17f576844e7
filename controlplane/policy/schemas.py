"""Request and response models of the policies API: policies, revisions, diffs, validation, dry runs."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from policies.model import Identifier

# PostgreSQL text cannot hold NUL; refusing it here keeps such input a 422 instead of a driver error.
PlainText = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$")]
Message = Annotated[PlainText, Field(max_length=4000, description="why this revision exists")]
MAX_SHAPES = 1000
PoolName = Annotated[str, StringConstraints(pattern=r"^[^\s\x00-\x1f\x7f]{1,128}$")]

SEED_EXAMPLE = """\
apiVersion: specgate/v1
name: seed
engines:
  base: {method: none}
  draft: {method: draft_model, model: models/draft, num_speculative_tokens: 3}
rules:
  - name: chat-low-batch
    when: {route: [chat], batch_size: {max: 4}, structured_output: false}
    then: {engine: draft}
default: {engine: base}
"""


def _one_document_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # One error at `document` instead of one per union member (document.str, document.dict[...]).
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("wrong_type", "expected a mapping, or YAML/JSON text") from None


DocumentValue = Annotated[dict[str, Any] | str, WrapValidator(_one_document_error)]


class PolicyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"name": "seed", "description": "chat traffic on pool a", "pool": "a"}]})

    name: Identifier = Field(description="letters, digits, '_', '.', '-'; at most 63, starting with a "
                                         "letter or digit. Every revision's document must carry this name.")
    description: Annotated[PlainText, Field(max_length=4000)] | None = None
    pool: PoolName | None = Field(
        default=None,
        description="the pool whose workers run this policy; null serves every pool without a policy "
                    "of its own. At most one policy per pool and one without a pool.")


class PolicyRead(BaseModel):
    id: str
    name: str
    description: str | None
    pool: str | None
    active_revision_id: str | None = Field(description="what workers run; null until the first revision")
    head_revision_id: str | None = Field(description="the highest-seq revision: what If-Match must name")
    revision_count: int
    created_at: dt.datetime
    created_by: str


class RevisionCreate(BaseModel):
    """The JSON form of a new revision."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"document": SEED_EXAMPLE, "message": "first version"}]})

    document: DocumentValue = Field(
        description="the policy document: a JSON object, or YAML/JSON text (text gives line numbers "
                    "in errors)")
    message: Message | None = Field(default=None, description="why this revision exists; falls back to "
                                                              "the message query parameter or header")


class RevisionSummary(BaseModel):
    id: str = Field(description="sha256 of the canonical document; also the revision's ETag")
    seq: int
    parent_id: str | None = Field(description="the head this revision was based on")
    author: str
    message: str
    created_at: dt.datetime
    active: bool = Field(description="whether this is the policy's active revision now")


class RevisionRead(RevisionSummary):
    policy: str
    document: dict[str, Any] = Field(description="the canonical document")
    canonical_yaml: str
    source_text: str | None = Field(description="the text as submitted (a JSON object is stored as "
                                                "indented JSON)")


class RevisionPage(BaseModel):
    items: list[RevisionSummary]
    next_cursor: int | None = Field(description="pass as cursor for the next (older) page; null at the end")


class RevisionRef(BaseModel):
    id: str
    seq: int


class ChangeSummaryRead(BaseModel):
    rules_added: list[str]
    rules_removed: list[str]
    rules_changed: list[str]
    rules_moved: list[str] = Field(description="rules whose order changed; first match wins, so order "
                                               "is behaviour")
    engines_added: list[str]
    engines_removed: list[str]
    engines_changed: list[str]
    fields_changed: list[str] = Field(description="other top-level fields that differ, e.g. default")


class DiffRead(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    policy: str
    from_revision: RevisionRef = Field(alias="from")
    to_revision: RevisionRef = Field(alias="to")
    identical: bool
    unified: str = Field(description="unified diff of the canonical YAML")
    summary: ChangeSummaryRead


class EvaluateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"shapes": [
        {"route": "chat", "batch_size": 2}, {"route": "chat", "batch_size": 8},
    ]}]})

    shapes: list[Any] = Field(min_length=1, max_length=MAX_SHAPES,
                              description="request shapes: route, model, batch_size, structured_output, "
                                          "tools, stream, max_tokens, prompt_tokens, labels, request_id")


class ShapeRead(BaseModel):
    route: str
    model: str
    batch_size: int
    structured_output: bool
    tools: bool
    stream: bool
    max_tokens: int | None
    prompt_tokens: int
    labels: dict[str, str]
    request_id: str | None


class DecisionRead(BaseModel):
    engine: str
    speculate: bool
    num_speculative_tokens: int
    rule: str
    policy: str
    revision: str
    explored: bool


class Evaluation(BaseModel):
    shape: ShapeRead = Field(description="the shape with defaults filled in")
    decision: DecisionRead


class ValidateRequest(BaseModel):
    """A draft to check without storing it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"document": SEED_EXAMPLE, "shapes": [{"route": "chat", "batch_size": 2}]}]})

    document: DocumentValue = Field(
        description="the policy document: a JSON object, or YAML/JSON text (text gives line numbers in errors)")
    shapes: list[Any] = Field(default_factory=list, max_length=MAX_SHAPES,
                              description="request shapes to decide under the draft (a dry run)")


class DraftDiffRead(BaseModel):
    against: RevisionRef = Field(description="the policy's active revision")
    identical: bool
    unified: str = Field(description="unified diff of the canonical YAML, active -> draft")
    summary: ChangeSummaryRead


class ValidationRead(BaseModel):
    valid: bool = Field(description="always true: an invalid document is a 422 problem with every error")
    revision_id: str = Field(description="the id the draft would have as a revision")
    name: str = Field(description="the document's policy name")
    canonical_yaml: str
    existing: bool = Field(description="the draft equals a revision already stored")
    diff: DraftDiffRead | None = Field(description="against the active revision; null when the policy has none")
    evaluations: list[Evaluation] = Field(description="the decisions for `shapes`, in order")
