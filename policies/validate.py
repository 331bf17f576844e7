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
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from policies.errors import ErrorCode, FieldError, PolicyValidationError
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
    Range,
    Rule,
    Then,
    When,
    engine_k,
)

MAX_DOCUMENT_BYTES = 256 * 1024

_ENGINE_ADAPTER: TypeAdapter[Any] = TypeAdapter(Engine)
_RULE_ADAPTER: TypeAdapter[Rule] = TypeAdapter(Rule)

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


def _parse_json(decoded: str) -> tuple[Any, _LineIndex]:
    """Strict JSON, read as JSON: YAML 1.1 would read 1e-05 as a string and refuse tabs."""
    try:
        data = json.loads(decoded, object_pairs_hook=_reject_duplicate_json_keys)
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
        data = yaml.safe_load(decoded)
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
    if isinstance(value, (int, float)):
        return f"number {value}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _covers(earlier: When, later: When) -> bool:
    """True when every request that ``later`` matches is matched by ``earlier``."""
    for field in ("route", "model"):
        mine = getattr(earlier, field)
        if mine is not None:
            theirs = getattr(later, field)
            if theirs is None or not set(theirs) <= set(mine):
                return False
    for field in ("batch_size", "max_tokens", "prompt_tokens"):
        mine_range = getattr(earlier, field)
        if mine_range is not None:
            theirs_range = getattr(later, field)
            if theirs_range is None or not mine_range.covers(theirs_range):
                return False
    for field in ("structured_output", "tools", "stream"):
        mine_flag = getattr(earlier, field)
        if mine_flag is not None and getattr(later, field) != mine_flag:
            return False
    mine_labels = earlier.label_sets()
    theirs_labels = later.label_sets()
    for key, allowed in mine_labels.items():
        if key not in theirs_labels or not theirs_labels[key] <= allowed:
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
    errors += _shadowed_rules(valid_rules)
    if engines is not None:
        errors += _exploration_errors(raw.get("exploration"), engines)
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


def _shadowed_rules(valid_rules: list[tuple[int, Rule]]) -> list[FieldError]:
    """A rule that an earlier one covers never matches: almost always a mistake in the order."""
    errors: list[FieldError] = []
    for j, (later_index, later) in enumerate(valid_rules):
        for earlier_index, earlier in valid_rules[:j]:
            if _covers(earlier.when, later.when):
                errors.append(FieldError(
                    f"rules[{later_index}]", ErrorCode.shadowed_rule,
                    f"rule '{later.name}' (rules[{later_index}]) can never match: "
                    f"rules[{earlier_index}] ('{earlier.name}') comes first and matches every "
                    "request it would match",
                ))
                break
    return errors


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
    return validate_data(raw, _index=index)
