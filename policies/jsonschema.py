"""The JSON Schema (draft 2020-12) of a specgate/v1 policy document, generated from the models in model.py.

Editors validate policies with it as people type. It states what the models
state about each value on its own: types, required and unknown fields, bounds,
lengths, name patterns and allowed values (and two conditional fields:
exploring needs ``speculative_engine``, a minimum shadow match rate needs
``quality`` with a shadow rate above 0). Rules that relate values to each other
(an engine a rule names must exist, a range's max is not below its min, rule
names are unique, no rule is shadowed) cannot be written in JSON Schema;
``python -m policies validate`` and the control plane check those too.

The generated schema is committed (``schema/specgate-v1.json``, shipped with
the package) so that editors can use it offline; a test keeps it equal to
what this module generates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic.json_schema import GenerateJsonSchema

from policies.model import API_VERSION, RESERVED_RULE_NAMES, PolicyDocument

SCHEMA_ID = "https://specgate.dev/schema/specgate-v1.json"
SCHEMA_PATH = Path(__file__).parent / "schema" / "specgate-v1.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


class _Generator(GenerateJsonSchema):
    def field_title_should_be_set(self, schema: Any) -> bool:
        # Titles made from field names ("Num Speculative Tokens") only repeat the key an editor already shows.
        return False


def policy_schema() -> dict[str, Any]:
    """The schema as a JSON value."""
    schema = PolicyDocument.model_json_schema(by_alias=True, mode="validation", schema_generator=_Generator)
    defs = schema["$defs"]
    _engine_names_are_identifiers(schema)
    _labels_take_one_value_or_a_list(defs["When"])
    _a_range_has_a_bound(defs["Range"])
    _rule_names_are_not_reserved(defs["Rule"])
    _exploring_names_its_engine(defs["Exploration"])
    _a_shadow_guardrail_needs_shadows(schema)
    head = {
        "$schema": DIALECT,
        "$id": SCHEMA_ID,
        "title": f"specgate policy document ({API_VERSION})",
        "description": "Which engine variant, and how many speculative tokens, serve each request shape. "
                       "References between fields (engine names, shadowed rules) are checked by "
                       "`python -m policies validate` and by the control plane.",
    }
    # The document's own fields first and the definitions last, as a person reads it; within them,
    # the models' field order.
    body = {key: value for key, value in schema.items() if key not in ("title", "$defs")}
    return {**head, **body, "$defs": defs}


def schema_text() -> str:
    """The schema as the committed file holds it (and GET /v1/schema/policy serves it)."""
    return json.dumps(policy_schema(), indent=2, ensure_ascii=False) + "\n"


def _engine_names_are_identifiers(schema: dict[str, Any]) -> None:
    # pydantic writes a dict with pattern-constrained keys as patternProperties, which lets any other key
    # through unchecked; the model refuses such a key, so the schema says the pattern of every name.
    engines = schema["properties"]["engines"]
    ((pattern, engine),) = engines.pop("patternProperties").items()
    # `discriminator` is OpenAPI's keyword, not JSON Schema's; the `method` constants already pick one branch.
    engine.pop("discriminator", None)
    engines["propertyNames"] = {"pattern": pattern}
    engines["additionalProperties"] = engine


def _labels_take_one_value_or_a_list(when: dict[str, Any]) -> None:
    # The model reads `tenant: gold` as `tenant: [gold]` before it checks the list.
    (mapping,) = [branch for branch in when["properties"]["labels"]["anyOf"] if branch.get("type") == "object"]
    values = mapping["additionalProperties"]
    assert values["type"] == "array", values
    mapping["additionalProperties"] = {"anyOf": [values["items"], values]}


def _a_range_has_a_bound(range_: dict[str, Any]) -> None:
    # Both bounds are optional (and may be null), but a range with neither would match everything.
    range_["anyOf"] = [{"required": [bound], "properties": {bound: {"type": "integer"}}} for bound in ("min", "max")]


def _rule_names_are_not_reserved(rule: dict[str, Any]) -> None:
    rule["properties"]["name"]["not"] = {"enum": sorted(RESERVED_RULE_NAMES)}


def _a_shadow_guardrail_needs_shadows(document: dict[str, Any]) -> None:
    # validate.py: guardrails.min_shadow_match_rate is measured on shadow comparisons; two top-level fields.
    assert {"guardrails", "quality"} <= document["properties"].keys()
    document["if"] = {"required": ["guardrails"], "properties": {"guardrails": {
        "type": "object", "required": ["min_shadow_match_rate"],
        "properties": {"min_shadow_match_rate": {"type": "number"}}}}}
    document["then"] = {"required": ["quality"], "properties": {"quality": {
        "type": "object", "properties": {"shadow_rate": {"exclusiveMinimum": 0}}}}}


def _exploring_names_its_engine(exploration: dict[str, Any]) -> None:
    # validate.py requires it of the whole document; it depends on this mapping alone, so a schema can say it.
    assert {"rate", "speculative_engine"} <= exploration["properties"].keys()
    exploration["if"] = {"required": ["rate"], "properties": {"rate": {"type": "number", "exclusiveMinimum": 0}}}
    exploration["then"] = {"required": ["speculative_engine"],
                           "properties": {"speculative_engine": {"type": "string"}}}

