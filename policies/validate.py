"""Reading a policy document: text -> raw data -> validated model.

All problems of a document are collected and raised together as one
:class:`PolicyValidationError`: structural errors from the models, then the
whole-document rules (engine references, duplicate names, shadowed rules),
which run on every piece that is valid on its own so that a typo in one rule
does not hide a dangling reference in another.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from policies.errors import ErrorCode, FieldError, PolicyValidationError
from policies.evaluate import ROUTE_COST, compiled_size, compiled_tests
from policies.model import (
    API_VERSION,
    ENGINE_METHODS,
    ENGINE_MODELS,
    NAME_PATTERN,
    Engine,
    Exploration,
    Guardrails,
    PlainEngine,
    PolicyDocument,
    Quality,
    Range,
    Rule,
    Telemetry,
    Then,
    When,
    engine_k,
    schedules_in_engine,
)
from policies.schedule import CatchAll, catch_alls, contributors, describe

MAX_DOCUMENT_BYTES = 256 * 1024
# The most a document may cost its compiled form (policies.evaluate.compiled_size): a rule's line and tests,
# once per route it names, and each route's function. At the limit compiling took 0.15-0.27 s and 50-90 MiB
# of peak RSS on a 2-core AMD EPYC (tests/policies/test_compile_bounds.py counts, never times, it);
# bench/policies/fifty_rules.yaml costs 190.
MAX_COMPILED_TESTS = 20_000

_ENGINE_ADAPTER: TypeAdapter[Any] = TypeAdapter(Engine)
_RULE_ADAPTER: TypeAdapter[Rule] = TypeAdapter(Rule)
_THEN_ADAPTER: TypeAdapter[Then] = TypeAdapter(Then)
_EXPLORATION_ADAPTER: TypeAdapter[Exploration] = TypeAdapter(Exploration)

_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def format_path(loc: tuple[str | int, ...] | list[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.replace("_", "").replace("-", "").isalnum() and "." not in part:
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


class _LineIndex:
    """Maps document paths to the YAML line they start on (1-based)."""

    def __init__(self) -> None:
        self.lines: dict[tuple[str | int, ...], tuple[int, int]] = {}

    def locate(self, loc: tuple[str | int, ...]) -> tuple[int | None, int | None]:
        # A missing field has no line of its own: point at its nearest parent.
        for end in range(len(loc), -1, -1):
            hit = self.lines.get(loc[:end])
            if hit is not None:
                return hit
        return None, None


MAX_NESTING = 32


def _index_yaml(node: yaml.Node, loc: tuple[str | int, ...], index: _LineIndex,
                errors: list[FieldError], seen: set[int]) -> None:
    mark = node.start_mark
    if id(node) in seen:
        # An alias: a policy is small enough to write out, and aliases allow
        # documents that expand exponentially (or refer to themselves).
        errors.append(FieldError(format_path(loc), ErrorCode.yaml_alias,
                                 "YAML anchors and aliases are not supported in policy documents",
                                 mark.line + 1, mark.column + 1))
        return
    seen.add(id(node))
    if len(loc) > MAX_NESTING:
        errors.append(FieldError(format_path(loc), ErrorCode.too_deep,
                                 f"the document nests deeper than {MAX_NESTING} levels",
                                 mark.line + 1, mark.column + 1))
        return
    index.lines[loc] = (mark.line + 1, mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        keys_seen: set[tuple[str, str]] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            # Compare resolved keys: `1` and `'1'` are different YAML keys.
            identity = (key_node.tag, key)
            if identity in keys_seen:
                # PyYAML keeps the last of duplicate keys without a word; an
                # author who wrote a key twice meant one of them, so say so.
                errors.append(FieldError(
                    format_path((*loc, key)), ErrorCode.duplicate_key,
                    f"key '{key}' appears more than once in this mapping",
                    key_node.start_mark.line + 1, key_node.start_mark.column + 1,
                ))
            keys_seen.add(identity)
            _index_yaml(value_node, (*loc, key), index, errors, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index_yaml(item, (*loc, i), index, errors, seen)


def _too_deep() -> PolicyValidationError:
    return PolicyValidationError([FieldError(
        "", ErrorCode.too_deep, f"the document nests deeper than {MAX_NESTING} levels")])


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateJsonKey(key)
        out[key] = value
    return out


class _DuplicateJsonKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class OversizedInt:
    """Stands for an integer with more digits than Python reads (``sys.get_int_max_str_digits``): ``int()``
    refuses it with an error that says nothing of where it is, so readers put this in its place and
    :func:`find_oversized_ints` names the place."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"

    def message(self) -> str:
        return f"an integer of {self.digits} digits is out of range"


def parse_int(text: str) -> int | OversizedInt:
    """``json.loads(..., parse_int=parse_int)``: an integer, or an :class:`OversizedInt` where int() refuses."""
    try:
        return int(text)
    except ValueError:
        return OversizedInt(sum(c.isdigit() for c in text))


def find_oversized_ints(data: Any) -> list[tuple[tuple[str | int, ...], OversizedInt]]:
    """Where :func:`parse_int` (or the YAML reader of this module) put an :class:`OversizedInt`, in order.

    One used as a mapping key is renamed to its repr (a mapping's keys must be strings to be reported) and
    reported at that key. Walks without recursion: the data may nest as deep as its parser allowed.
    """
    found: list[tuple[tuple[str | int, ...], OversizedInt]] = []
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, OversizedInt):
            found.append((loc, value))
        elif isinstance(value, dict):
            for key in [k for k in value if isinstance(k, OversizedInt)]:
                value[repr(key)] = value.pop(key)
                found.append(((*loc, repr(key)), key))
            stack.extend(((*loc, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*loc, i), v) for i, v in reversed(list(enumerate(value))))
    return found


class _PolicyLoader(yaml.SafeLoader):
    """SafeLoader, except that an integer too long for int() is an :class:`OversizedInt`, not an error."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            return OversizedInt(sum(c.isdigit() for c in str(node.value)))


_PolicyLoader.add_constructor("tag:yaml.org,2002:int", _PolicyLoader.construct_yaml_int)


def _parse_json(decoded: str) -> tuple[Any, _LineIndex]:
    """Strict JSON, read as JSON: YAML 1.1 would read 1e-05 as a string and refuse tabs."""
    try:
        data = json.loads(decoded, object_pairs_hook=_reject_duplicate_json_keys, parse_int=parse_int)
    except _DuplicateJsonKey as exc:
        raise PolicyValidationError([FieldError(
            "", ErrorCode.duplicate_key, f"key '{exc.key}' appears more than once in one JSON object")]) from None
    except json.JSONDecodeError as exc:
        raise PolicyValidationError([FieldError(
            "", ErrorCode.json_syntax, f"JSON syntax error at line {exc.lineno}, column {exc.colno}: {exc.msg}",
            exc.lineno, exc.colno)]) from None
    except RecursionError:
        raise _too_deep() from None
    # Line numbers come from reading the same text as YAML, where it can be.
    index = _LineIndex()
    errors: list[FieldError] = []
    try:
        node = yaml.compose(decoded, Loader=yaml.SafeLoader)
        if node is not None:
            _index_yaml(node, (), index, errors, set())
    except (yaml.YAMLError, RecursionError):
        index = _LineIndex()
    if any(e.code is ErrorCode.too_deep for e in errors):
        raise _too_deep()
    return data, index


def _check_encodable(data: Any) -> None:
    try:
        json.dumps(data, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        raise PolicyValidationError([FieldError(
            "", ErrorCode.invalid_encoding, "the document contains an unpaired UTF-16 surrogate escape")]) from None
    except RecursionError:
        raise _too_deep() from None
    except (TypeError, ValueError):
        pass  # non-string keys and the like: the structural pass names them


def parse_text(text: str | bytes, *, max_bytes: int = MAX_DOCUMENT_BYTES) -> tuple[Any, _LineIndex]:
    """YAML or JSON text -> raw data, with a path-to-line index for messages."""
    raw_bytes = text if isinstance(text, bytes) else text.encode("utf-8", errors="surrogatepass")
    if len(raw_bytes) > max_bytes:
        raise PolicyValidationError([FieldError(
            "", ErrorCode.document_too_large,
            f"document is {len(raw_bytes)} bytes; the limit is {max_bytes} bytes",
        )])
    try:
        decoded = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyValidationError([FieldError(
            "", ErrorCode.invalid_encoding, f"document is not UTF-8: {exc.reason} at byte {exc.start}",
        )]) from None
    if decoded.lstrip().startswith(("{", "[")):
        data, index = _parse_json(decoded)
        _check_encodable(data)
        return data, index
    index = _LineIndex()
    errors: list[FieldError] = []
    try:
        node = yaml.compose(decoded, Loader=yaml.SafeLoader)
        if node is None:
            raise PolicyValidationError([FieldError("", ErrorCode.empty_document, "document is empty")])
        _index_yaml(node, (), index, errors, set())
        if errors:
            raise PolicyValidationError(errors)
        data = yaml.load(decoded, Loader=_PolicyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        column = mark.column + 1 if mark else None
        problem = exc.problem or exc.context or "unreadable YAML"
        where = f" at line {line}, column {column}" if line else ""
        raise PolicyValidationError([FieldError(
            "", ErrorCode.yaml_syntax, f"YAML syntax error{where}: {problem}", line, column,
        )]) from None
    except yaml.YAMLError as exc:
        raise PolicyValidationError([FieldError("", ErrorCode.yaml_syntax, f"YAML error: {exc}")]) from None
    except RecursionError:
        raise _too_deep() from None
    _check_encodable(data)
    return data, index


# pydantic's error types by the closed code they become. Types not named here are matched by kind below: a
# too-short value, a pattern mismatch, one of our own validators' codes, a type family; the rest is invalid_value.
_CODE_OF_TYPE: dict[str, ErrorCode] = {
    "extra_forbidden": ErrorCode.unknown_field,
    "missing": ErrorCode.missing_field,
    "missing_argument": ErrorCode.missing_field,
    "missing_keyword_only_argument": ErrorCode.missing_field,
    "missing_positional_only_argument": ErrorCode.missing_field,
    "union_tag_not_found": ErrorCode.missing_field,
    "int_from_float": ErrorCode.wrong_type,
    "json_type": ErrorCode.wrong_type,
    "none_required": ErrorCode.wrong_type,
    "string_unicode": ErrorCode.wrong_type,
    "greater_than": ErrorCode.out_of_range,
    "greater_than_equal": ErrorCode.out_of_range,
    "less_than": ErrorCode.out_of_range,
    "less_than_equal": ErrorCode.out_of_range,
    "finite_number": ErrorCode.out_of_range,
    "int_parsing_size": ErrorCode.out_of_range,
    "too_long": ErrorCode.too_long,
    "string_too_long": ErrorCode.too_long,
    "bytes_too_long": ErrorCode.too_long,
    "url_too_long": ErrorCode.too_long,
    "literal_error": ErrorCode.invalid_value,
    "enum": ErrorCode.invalid_value,
    "union_tag_invalid": ErrorCode.invalid_value,
}
_TOO_SHORT = frozenset({"too_short", "string_too_short", "bytes_too_short"})
_OWN_CODES = frozenset(code.value for code in ErrorCode)


def pydantic_error_code(error: Mapping[str, Any]) -> ErrorCode:
    """The closed code of one pydantic error (an item of ``ValidationError.errors()``).

    The one mapping from pydantic's open set of error types to :class:`ErrorCode`: policy documents use it
    here, the control plane for its request bodies, parameters and telemetry events (through
    ``wire.problems.problem_code``), so that one kind of mistake has one code everywhere. Unknown types
    become ``invalid_value``; pydantic's message still says what was wrong.
    """
    kind = str(error.get("type", ""))
    code = _CODE_OF_TYPE.get(kind)
    if code is not None:
        return code
    ctx = error.get("ctx") or {}
    if kind in _TOO_SHORT:
        # Every minimum length of a policy is 1, and "empty" says what is wrong with such a value exactly.
        return ErrorCode.empty if ctx.get("min_length", 1) <= 1 else ErrorCode.too_short
    if kind == "string_pattern_mismatch":
        return ErrorCode.invalid_name if ctx.get("pattern") == NAME_PATTERN else ErrorCode.invalid_format
    if kind in _OWN_CODES:  # raised by the models' own validators (PydanticCustomError)
        return ErrorCode(kind)
    if kind.endswith(("_type", "_parsing")):
        return ErrorCode.wrong_type
    return ErrorCode.invalid_value


def _convert_pydantic(exc: ValidationError, prefix: tuple[str | int, ...], index: _LineIndex | None,
                      raw: Any) -> list[FieldError]:
    out: list[FieldError] = []
    for err in exc.errors(include_url=False):
        loc = _strip_union_tags(prefix + tuple(err["loc"]))
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = (*loc, "method")  # the discriminator is at fault, not the engine as a whole
        code = pydantic_error_code(err)
        line, column = index.locate(loc) if index else (None, None)
        out.append(FieldError(format_path(loc), code, _message(err, code, loc, raw), line, column))
    return out


def _message(err: ErrorDetails, code: ErrorCode, loc: tuple[str | int, ...], raw: Any) -> str:
    """What an author reads for one pydantic error: in the document's terms where pydantic's are not."""
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        field = loc[-1] if loc else "?"
        message = f"unknown field '{field}'"
        hint = _suggest(field, _allowed_fields(loc[:-1], raw))
        return f"{message}; did you mean '{hint}'?" if hint else message
    if kind == "missing":
        return f"required field '{loc[-1]}' is missing"
    if kind in _TYPE_NAMES:
        return f"expected {_TYPE_NAMES[kind]}, got {_describe(value)}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return f"{_describe(value)} is out of range: {err['msg'].lower()}"
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_too_short":
        return "must not be an empty string"
    if code is ErrorCode.invalid_name:
        return (f"{_describe(value)} is not a valid name: use letters, digits, '_', '.', '-' "
                "(at most 63, starting with a letter or digit)")
    if kind == "literal_error":
        return f"{_describe(value)} is not allowed: {err['msg'].lower()}"
    if kind == "union_tag_invalid":
        return (f"unknown engine method {_describe(err.get('ctx', {}).get('tag'))}; "
                f"expected one of {', '.join(ENGINE_METHODS)}")
    if kind == "union_tag_not_found":
        return f"required field 'method' is missing (one of {', '.join(ENGINE_METHODS)})"
    return err["msg"]


def _strip_union_tags(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    # A bad mapping key is reported by pydantic one level deeper, under "[key]".
    loc = tuple(part for part in loc if part != "[key]")
    # Pydantic puts the discriminator's value into the path of union members
    # (engines.draft.draft_model.model); the document has no such level.
    if len(loc) >= 3 and loc[0] == "engines" and loc[2] in ENGINE_METHODS:
        return loc[:2] + loc[3:]
    return loc


def _allowed_fields(parent: tuple[str | int, ...], raw: Any) -> list[str]:
    if parent == ():
        return [f.alias or n for n, f in PolicyDocument.model_fields.items()]
    model: Any = None
    last = parent[-1]
    if len(parent) == 3 and parent[0] == "rules" and last == "when":
        model = When
    elif len(parent) == 2 and parent[0] == "rules":
        model = Rule
    elif last == "then" or parent == ("default",):
        model = Then
    elif last in ("batch_size", "max_tokens", "prompt_tokens"):
        model = Range
    elif parent == ("exploration",):
        model = Exploration
    elif parent == ("guardrails",):
        model = Guardrails
    elif parent == ("quality",):
        model = Quality
    elif parent == ("telemetry",):
        model = Telemetry
    elif len(parent) == 2 and parent[0] == "engines":
        return sorted({f for m in ENGINE_MODELS for f in m.model_fields})
    if model is None:
        return []
    return list(model.model_fields)


def _suggest(word: str | int, options: list[str]) -> str | None:
    if not isinstance(word, str) or not options:
        return None
    hits = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return hits[0] if hits else None


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"string '{value}'" if len(value) < 60 else "a long string"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int) and not -10**40 < value < 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    if isinstance(value, OversizedInt):
        return repr(value)
    if isinstance(value, (int, float)):
        return f"number {value}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_UNBOUNDED = float("inf")


@dataclass(frozen=True, slots=True)
class _Facts:
    """A rule's predicates as the shadowing check compares them, made once per rule instead of once per pair.

    The three ranges are bounds with a missing one at -inf or +inf and a missing range as (-inf, +inf): one
    range covers another exactly when its low is at most the other's and its high at least.
    """

    route: frozenset[str] | None
    model: frozenset[str] | None
    lows: tuple[float, float, float]  # batch_size, max_tokens, prompt_tokens
    highs: tuple[float, float, float]
    flags: tuple[bool | None, bool | None, bool | None]  # structured_output, tools, stream
    labels: dict[str, frozenset[str]]
    # The engine whose batch the rule's batch_size predicate reads (RequestShape.engine_batch), None without one
    batch_engine: str | None = None

    @classmethod
    def of(cls, when: When, engine: str | None = None) -> _Facts:
        ranges = (when.batch_size, when.max_tokens, when.prompt_tokens)
        lows = tuple(-_UNBOUNDED if r is None or r.min is None else r.min for r in ranges)
        highs = tuple(_UNBOUNDED if r is None or r.max is None else r.max for r in ranges)
        return cls(
            frozenset(when.route) if when.route is not None else None,
            frozenset(when.model) if when.model is not None else None,
            (lows[0], lows[1], lows[2]), (highs[0], highs[1], highs[2]),
            (when.structured_output, when.tools, when.stream),
            when.label_sets(),
            engine if when.batch_size is not None else None,
        )


def _covers(earlier: _Facts, later: _Facts) -> bool:
    """True when every request that ``later`` matches is matched by ``earlier``.

    Written out rather than looped: it runs for many pairs of rules, and the ranges usually decide it.
    """
    if earlier.batch_engine is not None and earlier.batch_engine != later.batch_engine:
        # Each reads the batch of its own engine (in replica pools they differ): the earlier rule's batch says
        # nothing about the later one's, so a later rule for another pool is where load spills.
        return False
    el, ll, eh, lh = earlier.lows, later.lows, earlier.highs, later.highs
    if el[0] > ll[0] or el[1] > ll[1] or el[2] > ll[2] or eh[0] < lh[0] or eh[1] < lh[1] or eh[2] < lh[2]:
        return False
    ef, lf = earlier.flags, later.flags
    if ((ef[0] is not None and ef[0] != lf[0]) or (ef[1] is not None and ef[1] != lf[1])
            or (ef[2] is not None and ef[2] != lf[2])):
        return False
    if earlier.route is not None and (later.route is None or not later.route <= earlier.route):
        return False
    if earlier.model is not None and (later.model is None or not later.model <= earlier.model):
        return False
    for key, allowed in earlier.labels.items():
        theirs = later.labels.get(key)
        if theirs is None or not theirs <= allowed:
            return False
    return True


def _semantic_errors(raw: Mapping[str, Any]) -> list[FieldError]:
    """Whole-document rules, checked on every piece that is valid on its own.

    Without an engine table no reference can be judged, so only the rules' names and their shadowing are.
    """
    engines = _engines_of(raw.get("engines"))
    errors: list[FieldError] = []
    if engines is not None:
        errors += _plain_engine_errors(raw.get("plain_engine"), engines)
    rule_errors, valid_rules = _rule_errors(raw.get("rules"), engines)
    errors += rule_errors
    errors += _then_errors("default", raw.get("default"), engines)
    shadowed = _shadowed_rules(valid_rules)
    errors += shadowed
    in_engine = {name for name, engine in (engines or {}).items() if schedules_in_engine(engine)}
    added = catch_alls(valid_rules, in_engine)
    errors += _compiled_size_errors(valid_rules, [c.rule for c in added])
    errors += _shadow_guardrail_errors(raw)
    if engines is not None:
        errors += _exploration_errors(raw.get("exploration"), engines)
        errors += _in_engine_errors(raw, engines, valid_rules, added, {e.path for e in shadowed})
    return errors


def _engines_of(raw_engines: Any) -> dict[str, Any] | None:
    """Each engine by name, None for one that is invalid on its own; None when there is no engine table."""
    if not isinstance(raw_engines, Mapping):
        return None
    engines: dict[str, Any] = {}
    for name, spec in raw_engines.items():
        try:
            engines[str(name)] = _ENGINE_ADAPTER.validate_python(spec, strict=True)
        except ValidationError:
            engines[str(name)] = None  # reported by the structural pass
    return engines


def _plain_engine_errors(plain_engine: Any, engines: Mapping[str, Any]) -> list[FieldError]:
    """Fallback, the kill switch and exploration need one engine that does not speculate, known by name."""
    if isinstance(plain_engine, str):
        if plain_engine not in engines:
            return [_undefined("plain_engine", plain_engine, engines)]
        if engines[plain_engine] is not None and not isinstance(engines[plain_engine], PlainEngine):
            return [FieldError("plain_engine", ErrorCode.not_plain_engine,
                               f"engine '{plain_engine}' speculates; plain_engine must name an "
                               "engine with method none")]
        return []
    # An invalid engine might be the plain one its author meant: judge the choice only when all are valid.
    if plain_engine is not None or None in engines.values():
        return []
    plain_names = [n for n, e in engines.items() if isinstance(e, PlainEngine)]
    if not plain_names:
        return [FieldError("engines", ErrorCode.no_plain_engine,
                           "at least one engine needs method none: fallback, the kill switch "
                           "and exploration route requests to it")]
    if len(plain_names) > 1:
        return [FieldError("plain_engine", ErrorCode.ambiguous_plain_engine,
                           f"several engines have method none ({', '.join(plain_names)}); "
                           "name the one for fallback and the kill switch in plain_engine")]
    return []


def _then_errors(path: str, then: Any, engines: Mapping[str, Any] | None) -> list[FieldError]:
    """A decision's engine must exist, and its k must be one that engine can draft."""
    if not isinstance(then, Mapping) or engines is None:
        return []
    name = then.get("engine")
    if not isinstance(name, str):
        return []
    if name not in engines:
        return [_undefined(f"{path}.engine", name, engines)]
    engine = engines[name]
    k = then.get("num_speculative_tokens")
    if engine is None or not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        return []  # a k outside 1..16 is already reported by the structural pass
    if isinstance(engine, PlainEngine):
        return [FieldError(f"{path}.num_speculative_tokens", ErrorCode.plain_engine_k,
                           f"engine '{name}' does not speculate; num_speculative_tokens "
                           "applies to speculative engines only")]
    if k > engine_k(engine):
        return [FieldError(f"{path}.num_speculative_tokens", ErrorCode.k_above_engine,
                           f"{k} exceeds engine '{name}''s num_speculative_tokens "
                           f"({engine_k(engine)}); an engine cannot draft more than it is "
                           "configured for")]
    return []


def _rule_errors(rules: Any, engines: Mapping[str, Any] | None) -> tuple[list[FieldError], list[tuple[int, Rule]]]:
    """Each rule's name once, each rule's decision; and the rules valid on their own, for the shadowing check."""
    errors: list[FieldError] = []
    valid_rules: list[tuple[int, Rule]] = []
    if not isinstance(rules, list):
        return errors, valid_rules
    first_seen: dict[str, int] = {}
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping):
            continue
        name = rule.get("name")
        if isinstance(name, str):
            if name in first_seen:
                errors.append(FieldError(f"rules[{i}].name", ErrorCode.duplicate_rule_name,
                                         f"rule name '{name}' is already used by rules[{first_seen[name]}]"))
            else:
                first_seen[name] = i
        errors += _then_errors(f"rules[{i}].then", rule.get("then"), engines)
        with contextlib.suppress(ValidationError):  # reported by the structural pass
            valid_rules.append((i, _RULE_ADAPTER.validate_python(rule, strict=True)))
    return errors, valid_rules


# An earlier rule as the shadowing check keeps it: its index in the document, the rule, its facts.
_Earlier = tuple[int, Rule, _Facts]


def _shadowed_rules(valid_rules: list[tuple[int, Rule]]) -> list[FieldError]:
    """A rule that an earlier one covers never matches: almost always a mistake in the order.

    Comparing every pair would cost rules squared, so each rule is compared only with the earlier rules that
    could cover it. Those are indexed by one predicate each, one that a rule they cover must share: a label (it
    must have that key, with values among theirs), else a route (it must name only routes among theirs), else
    nothing (they are compared with every later rule).
    """
    errors: list[FieldError] = []
    everywhere: list[_Earlier] = []
    by_label: dict[tuple[str, str], list[_Earlier]] = {}
    by_route: dict[str, list[_Earlier]] = {}
    for later_index, later in valid_rules:
        facts = _Facts.of(later.when, later.then.engine)
        routes = facts.route
        candidates = [everywhere]
        candidates += [by_label.get((key, min(values)), []) for key, values in facts.labels.items()]
        if routes:
            candidates.append(by_route.get(min(routes), []))
        first: _Earlier | None = None
        for earlier_rules in candidates:
            for earlier in earlier_rules:
                if first is not None and earlier[0] > first[0]:
                    break
                if _covers(earlier[2], facts):
                    first = earlier
                    break
        if first is not None:
            earlier_index, earlier_rule, _ = first
            errors.append(FieldError(
                f"rules[{later_index}]", ErrorCode.shadowed_rule,
                f"rule '{later.name}' (rules[{later_index}]) can never match: "
                f"rules[{earlier_index}] ('{earlier_rule.name}') comes first and matches every "
                "request it would match",
            ))
        entry = (later_index, later, facts)
        if facts.labels:
            key = min(facts.labels)
            for value in facts.labels[key]:
                by_label.setdefault((key, value), []).append(entry)
        elif routes is not None:
            for route in routes:
                by_route.setdefault(route, []).append(entry)
        else:
            everywhere.append(entry)
    return errors


def _compiled_size_errors(valid_rules: list[tuple[int, Rule]], catch_all_rules: list[Rule]) -> list[FieldError]:
    """Rules x routes: every rule is compiled into the function of each route it names, so the two multiply.

    The catch-alls of in-engine groups are compiled like rules (policies.evaluate.routed_rules), so they count.
    """
    total = compiled_size([*(rule for _, rule in valid_rules), *catch_all_rules])
    if total <= MAX_COMPILED_TESTS:
        return []
    biggest, where = max((compiled_tests(rule), i) for i, rule in valid_rules)
    routes = len({route for _, rule in valid_rules for route in rule.when.route or ()})
    return [FieldError("rules", ErrorCode.too_complex,
                       f"the rules cost {total} tests once compiled, over the limit of {MAX_COMPILED_TESTS}: a "
                       "rule costs 1, plus 1 per predicate and per label key (the route aside), for every route "
                       f"it names, and each of the {routes} routes {ROUTE_COST} more. rules[{where}] costs the "
                       f"most ({biggest}). Name fewer routes per rule, or split the policy")]


def _shadow_guardrail_errors(raw: Mapping[str, Any]) -> list[FieldError]:
    """A minimum shadow match rate needs shadow comparisons: without them the guardrail could never pass, and
    every rollout of the policy would wait forever."""
    guardrails, quality = raw.get("guardrails"), raw.get("quality")
    if not isinstance(guardrails, Mapping) or guardrails.get("min_shadow_match_rate") is None:
        return []
    rate = quality.get("shadow_rate") if isinstance(quality, Mapping) else None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate <= 0:
        return [FieldError("quality.shadow_rate", ErrorCode.out_of_range,
                           "must be above 0 when guardrails.min_shadow_match_rate is set: the guardrail is "
                           "measured on shadow comparisons")]
    if quality is None:
        return [FieldError("quality", ErrorCode.missing_field,
                           "required when guardrails.min_shadow_match_rate is set: the guardrail is measured "
                           "on shadow comparisons (quality.shadow_rate)")]
    return []


def _exploration_errors(exploration: Any, engines: Mapping[str, Any]) -> list[FieldError]:
    """Exploring a plain decision needs a speculative engine to explore it on."""
    if not isinstance(exploration, Mapping):
        return []
    rate = exploration.get("rate", 0.0)
    spec_name = exploration.get("speculative_engine")
    if isinstance(spec_name, str):
        if spec_name not in engines:
            return [_undefined("exploration.speculative_engine", spec_name, engines)]
        if isinstance(engines[spec_name], PlainEngine):
            return [FieldError("exploration.speculative_engine", ErrorCode.not_speculative_engine,
                               f"engine '{spec_name}' has method none; exploring a plain "
                               "decision needs an engine that speculates")]
        return []
    if spec_name is None and isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
        return [FieldError("exploration.speculative_engine", ErrorCode.missing_field,
                           "required when exploration.rate > 0: the engine that explored "
                           "plain decisions are sent to")]
    return []


def _valid_or_none(adapter: TypeAdapter[Any], raw: Any) -> Any:
    try:
        return adapter.validate_python(raw, strict=True)
    except ValidationError:
        return None  # reported by the structural pass


def _in_engine_errors(raw: Mapping[str, Any], engines: Mapping[str, Any], valid_rules: list[tuple[int, Rule]],
                      added: list[CatchAll], already_shadowed: set[str]) -> list[FieldError]:
    """An engine that schedules in the engine has one schedule (policies.schedule): every way requests reach it
    must imply the same one, and a later rule that its rules now take every request from can never match."""
    in_engine = {name: engine for name, engine in engines.items() if schedules_in_engine(engine)}
    if not in_engine:
        return []
    default = _valid_or_none(_THEN_ADAPTER, raw.get("default"))
    exploration = _valid_or_none(_EXPLORATION_ADAPTER, raw.get("exploration", {}))
    errors: list[FieldError] = []
    for name, engine in in_engine.items():
        found = contributors(name, engine_k(engine), valid_rules, default, exploration)
        for other in found[1:]:
            if other.segments == found[0].segments:
                continue
            why = ""
            if other.path == "exploration.speculative_engine":
                why = ("; explored requests there would get the engine's schedule instead of being speculated: "
                       "explore on another speculative engine")
            errors.append(FieldError(
                other.path, ErrorCode.schedule_conflict,
                f"engine '{name}' schedules in the engine (schedule: in_engine), one schedule for every request "
                f"it gets: {other.label} implies {describe(other.segments)}, but {found[0].label} implies "
                f"{describe(found[0].segments)}{why}"))
    # Batch sizes start at 1: a range that holds none of them would decide for a batch the engine never runs.
    for i, rule in valid_rules:
        r = rule.when.batch_size
        if rule.then.engine in in_engine and r is not None and r.max is not None and r.max < 1:
            errors.append(FieldError(
                f"rules[{i}].when.batch_size.max", ErrorCode.out_of_range,
                f"engine '{rule.then.engine}' schedules in the engine, which runs batches of 1 or more; a range "
                f"up to {r.max} holds none of them"))
    # After a group's last rule its catch-all takes every request of its other predicates, whatever the batch
    # (policies.evaluate.routed_rules): a later rule it covers is never reached.
    takers = [(c, _Facts.of(c.rule.when)) for c in added]
    for later_index, later in valid_rules:
        if f"rules[{later_index}]" in already_shadowed:
            continue
        facts = _Facts.of(later.when, later.then.engine)
        for catch_all, group_facts in takers:
            if catch_all.after >= later_index:
                break
            if _covers(group_facts, facts):
                errors.append(FieldError(
                    f"rules[{later_index}]", ErrorCode.shadowed_rule,
                    f"rule '{later.name}' (rules[{later_index}]) can never match: engine "
                    f"'{catch_all.rule.then.engine}' schedules in the engine (schedule: in_engine), so after "
                    f"rules[{catch_all.after}] it takes every request that rules[{catch_all.first}] "
                    f"('{catch_all.rule.name}') matches whatever the batch, and those include every request this "
                    "rule would match"))
                break
    return errors


def _undefined(path: str, name: str, engines: Mapping[str, Any]) -> FieldError:
    hint = _suggest(name, list(engines))
    defined = ", ".join(sorted(engines)) or "none"
    message = f"engine '{name}' is not defined in engines (defined: {defined})"
    if hint:
        message += f"; did you mean '{hint}'?"
    return FieldError(path, ErrorCode.undefined_engine, message)


def validate_data(raw: Any, *, _index: _LineIndex | None = None) -> PolicyDocument:
    """Validate already-parsed data (a dict from YAML or JSON)."""
    if not isinstance(raw, Mapping):
        raise PolicyValidationError([FieldError(
            "", ErrorCode.wrong_type, f"a policy document is a mapping, got {_describe(raw)}",
        )])
    errors: list[FieldError] = []
    api_version = raw.get("apiVersion")
    if "apiVersion" in raw and api_version != API_VERSION:
        line, column = _index.locate(("apiVersion",)) if _index else (None, None)
        errors.append(FieldError("apiVersion", ErrorCode.unsupported_api_version,
                                 f"apiVersion {_describe(api_version)} is not supported; this library "
                                 f"reads {API_VERSION}", line, column))
    document: PolicyDocument | None = None
    try:
        document = PolicyDocument.model_validate(raw, strict=True)
    except ValidationError as exc:
        errors.extend(e for e in _convert_pydantic(exc, (), _index, raw)
                      if not (e.path == "apiVersion" and e.code is ErrorCode.invalid_value))
    for err in _semantic_errors(raw):
        if _index is not None and err.line is None:
            loc = _parse_path(err.path)
            line, column = _index.locate(loc)
            err = FieldError(err.path, err.code, err.message, line, column)
        errors.append(err)
    if errors or document is None:
        raise PolicyValidationError(errors or [FieldError("", ErrorCode.invalid, "the document did not validate")])
    return document


def _parse_path(path: str) -> tuple[str | int, ...]:
    out: list[str | int] = []
    for chunk in path.replace("]", "").split("."):
        if not chunk:
            continue
        head, *indexes = chunk.split("[")
        if head:
            out.append(head)
        out.extend(int(i) if i.isdigit() else json.loads(i) for i in indexes)
    return tuple(out)


def load_policy(text: str | bytes, *, max_bytes: int = MAX_DOCUMENT_BYTES) -> PolicyDocument:
    """Parse and validate a YAML or JSON policy document."""
    raw, index = parse_text(text, max_bytes=max_bytes)
    oversized = [FieldError(format_path(loc), ErrorCode.out_of_range, value.message(), *index.locate(loc))
                 for loc, value in find_oversized_ints(raw)]
    if not oversized:
        return validate_data(raw, _index=index)
    # The rest of the document is judged too; where such a number sits its own error replaces the type error
    # the models give an object that is not an int.
    at = {e.path for e in oversized}
    try:
        validate_data(raw, _index=index)
    except PolicyValidationError as exc:
        oversized += [e for e in exc.errors if not (e.path in at and e.code is ErrorCode.wrong_type)]
    raise PolicyValidationError(oversized)
