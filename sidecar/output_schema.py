"""Validators of client-given output schemas whose regular expressions and ``uniqueItems`` run in linear time.

A structured request's ``json_schema`` comes from the client, and the answer it
is checked against can be steered by the client's prompt. jsonschema matches
``pattern`` and ``patternProperties`` with Python's backtracking ``re``, and a
pattern such as ``(a+)+$`` against a near miss takes exponential time while
holding the GIL, so no thread can keep the sidecar's event loop from stalling.
Here every pattern of a schema is compiled with RE2 (linear time, bounded
memory) when the schema is compiled, and the validator matches with those.

A schema with a pattern RE2 cannot express (backreferences, lookaround) gets
no validator: the request is still served, its event says no verdict
(``structured_valid`` null) rather than risk the stall. So does a schema that
combines ``unevaluatedProperties`` with ``patternProperties``, whose
evaluation inside jsonschema would match with ``re`` again.

References resolve within the schema and to the bundled metaschemas only:
jsonschema's default would fetch a remote ``$ref`` (http, file) with no
timeout while the answer is checked, on the loop, from the client's URL.
Such a reference leaves the request without a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

import jsonschema
import re2
from jsonschema_specifications import REGISTRY as METASCHEMAS

# Per pattern, what RE2 may use for its automata; a pattern needing more is refused (no verdict).
MAX_PATTERN_MEMORY: Final = 1 << 20

Search = Callable[[str, str], bool]


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is a client's input, not the sidecar's error
    options.max_mem = MAX_PATTERN_MEMORY
    return options


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of every object in ``node``, however deep (iteratively: schemas may nest deep)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, Mapping):
            for key, value in current.items():
                yield key, value
                stack.append(value)
        elif isinstance(current, list):
            stack.extend(current)


def _patterns(schema: Any) -> tuple[set[str], bool]:
    """The regular expressions ``schema`` uses, and whether it combines ``unevaluatedProperties`` with
    ``patternProperties`` (which jsonschema evaluates with ``re`` inside ``unevaluatedProperties``).

    A ``pattern`` key inside data (``const``, ``enum``, ``examples``) counts too: refusing a pattern that
    was never one costs a verdict, never a stall.
    """
    found: set[str] = set()
    unevaluated = pattern_properties = False
    for key, value in _walk(schema):
        if key == "pattern" and isinstance(value, str):
            found.add(value)
        elif key == "patternProperties":
            pattern_properties = True
            if isinstance(value, Mapping):
                found.update(k for k in value if isinstance(k, str))
        elif key == "unevaluatedProperties":
            unevaluated = True
    return found, unevaluated and pattern_properties


def _with_linear_keywords(cls: Any, search: Search) -> Any:
    """``cls`` with the keywords that match regular expressions matching through ``search``, and
    ``uniqueItems`` by hashing."""

    def pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for key, value in instance.items():
                if search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    def additional_properties(validator: Any, additional: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        properties = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extras = [key for key in instance
                  if key not in properties and not any(search(p, key) for p in patterns)]
        if validator.is_type(additional, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], additional, path=extra)
        elif not additional and extras:
            yield jsonschema.ValidationError(f"additional properties are not allowed ({sorted(extras)!r})")

    keywords = {"pattern": pattern, "patternProperties": pattern_properties,
                "additionalProperties": additional_properties, "uniqueItems": unique_items}
    return jsonschema.validators.extend(cls, keywords)  # type: ignore[no-untyped-call]


def _canonical(value: Any) -> Any:
    """A hashable form equal exactly when jsonschema's equality holds: 1 and 1.0 alike, True and 1 not,
    objects regardless of key order."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int | float):
        return ("n", int(value) if isinstance(value, float) and value.is_integer() else value)
    if isinstance(value, str):
        return ("s", value)
    if value is None:
        return ("z",)
    if isinstance(value, list):
        return ("l", tuple(_canonical(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, _canonical(v)) for k, v in value.items()))
    return ("o", id(value))  # JSON gives nothing else


def unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """``uniqueItems`` by hashing, linear in the array: jsonschema compares unhashable items pairwise, which
    for an answer of 8,000 small objects is about a minute on the loop."""
    if unique and validator.is_type(instance, "array"):
        seen = {_canonical(item) for item in instance}
        if len(seen) < len(instance):
            yield jsonschema.ValidationError(f"{instance!r} has non-unique elements")


def compile_output_schema(schema: Any) -> Any:
    """A validator of ``schema`` (``is_valid``), or None when it is no valid schema or cannot be checked in
    linear time. Seconds of pure Python for a large schema: call it off the event loop."""
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except (jsonschema.exceptions.SchemaError, RecursionError):
        return None
    patterns, unevaluated_with_pattern_properties = _patterns(schema)
    if unevaluated_with_pattern_properties:
        return None
    options = _options()
    compiled = {}
    for patrn in patterns:
        try:
            compiled[patrn] = re2.compile(patrn, options)
        except (re2.error, TypeError, ValueError):
            return None

    def search(patrn: str, text: str) -> bool:
        regex = compiled.get(patrn)
        if regex is None:  # not found by the walk (cannot happen for a schema's own keywords): no backtracking
            raise LookupError(f"pattern {patrn!r} was not compiled with the schema")
        return regex.search(text) is not None

    return _with_linear_keywords(cls, search)(schema, registry=METASCHEMAS)
