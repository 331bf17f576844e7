"""The policy library's own errors.

Every problem found in a document is a :class:`FieldError` with a path in the
document (``rules[2].when.batch_size.max``), a stable machine-readable
``code`` and a human message. A document with problems raises one
:class:`PolicyValidationError` carrying all of them, so an author fixes a
document in one round trip rather than one error at a time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FieldError:
    path: str
    code: str
    message: str
    line: int | None = None
    column: int | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"path": self.path, "code": self.code, "message": self.message}
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
