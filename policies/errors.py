"""The policy library's own errors.

Every problem found in a document is a :class:`FieldError` with a path in the
document (``rules[2].when.batch_size.max``), a stable machine-readable
``code`` from the closed set :class:`ErrorCode` and a human message. A document with problems raises one
:class:`PolicyValidationError` carrying all of them, so an author fixes a
document in one round trip rather than one error at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ErrorCode(StrEnum):
    """Every code a policy document or a request shape can be refused with; the values cross the wire.

    Member names equal their values, so a member is interchangeable with its
    string wherever it is compared, hashed or encoded.
    """

    # reading the text
    document_too_large = "document_too_large"
    invalid_encoding = "invalid_encoding"
    empty_document = "empty_document"
    yaml_syntax = "yaml_syntax"
    json_syntax = "json_syntax"
    yaml_alias = "yaml_alias"
    duplicate_key = "duplicate_key"
    too_deep = "too_deep"
    # one field on its own (the models' checks, and pydantic's errors mapped by policies.validate)
    unsupported_api_version = "unsupported_api_version"
    unknown_field = "unknown_field"
    missing_field = "missing_field"
    wrong_type = "wrong_type"
    out_of_range = "out_of_range"
    empty = "empty"
    too_short = "too_short"
    too_long = "too_long"
    invalid_name = "invalid_name"
    invalid_format = "invalid_format"
    invalid_value = "invalid_value"
    inverted_range = "inverted_range"
    empty_range = "empty_range"
    reserved_name = "reserved_name"
    # the whole document
    undefined_engine = "undefined_engine"
    not_plain_engine = "not_plain_engine"
    no_plain_engine = "no_plain_engine"
    ambiguous_plain_engine = "ambiguous_plain_engine"
    plain_engine_k = "plain_engine_k"
    k_above_engine = "k_above_engine"
    not_speculative_engine = "not_speculative_engine"
    duplicate_rule_name = "duplicate_rule_name"
    shadowed_rule = "shadowed_rule"
    too_complex = "too_complex"
    schedule_conflict = "schedule_conflict"
    # a safeguard: a document that did not validate without any more precise error being found
    invalid = "invalid"


@dataclass(frozen=True, slots=True)
class FieldError:
    path: str
    code: ErrorCode
    message: str
    line: int | None = None
    column: int | None = None

    def __post_init__(self) -> None:
        # A code outside the closed set fails here, where it is made, not in a client that meets it.
        object.__setattr__(self, "code", ErrorCode(self.code))

    def to_dict(self) -> dict[str, object]:
        # The plain string, so that the dict encodes anywhere (YAML dumpers refuse str subclasses).
        out: dict[str, object] = {"path": self.path, "code": self.code.value, "message": self.message}
        if self.line is not None:
            out["line"] = self.line
        if self.column is not None:
            out["column"] = self.column
        return out

    def __str__(self) -> str:
        where = self.path or "<document>"
        if self.line is not None:
            where += f" (line {self.line})"
        return f"{where}: {self.message} [{self.code}]"


class PolicyError(Exception):
    """Base of every error this library raises on purpose."""


class PolicyValidationError(PolicyError):
    def __init__(self, errors: list[FieldError]) -> None:
        if not errors:
            raise ValueError("PolicyValidationError needs at least one FieldError")
        self.errors: tuple[FieldError, ...] = tuple(errors)
        summary = "; ".join(str(e) for e in self.errors[:5])
        more = f" (and {len(self.errors) - 5} more)" if len(self.errors) > 5 else ""
        super().__init__(f"invalid policy: {summary}{more}")


class BundleError(PolicyError):
    """A bundle could not be trusted or read; the caller keeps its previous one."""


class BundleFormatError(BundleError):
    pass


class BundleSignatureError(BundleError):
    pass


class RequestShapeError(PolicyError):
    """A request shape handed to the evaluator is malformed (e.g. from JSON)."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors: tuple[FieldError, ...] = tuple(errors)
        super().__init__("invalid request shape: " + "; ".join(str(e) for e in self.errors))
