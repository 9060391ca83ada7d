"""Refuse JSON Schema keywords that the grammar would not enforce, naming them, instead of
silently generating output that ignores them."""

from __future__ import annotations

from loraplex.grammar.backend import GrammarError

# Keywords xgrammar does not enforce (or that we have not verified it enforces): refused.
UNENFORCED = {
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "uniqueItems", "multipleOf", "patternProperties", "propertyNames", "contains", "minContains",
    "maxContains", "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties",
    "$dynamicRef", "$recursiveRef",
}
# Keywords whose value is a schema, or a map / list of schemas, to walk into.
SUBSCHEMA = {"items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
             "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
SUBSCHEMA_MAPS = {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}


def check_schema(schema, path: str = "#") -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"json schema at {path} must be an object or a boolean")
    for key, value in schema.items():
        if key in UNENFORCED:
            raise GrammarError(f"json schema keyword {key!r} at {path} is not supported by the grammar backend "
                               f"(it would be ignored, so the request is refused)")
        if key in SUBSCHEMA and isinstance(value, (dict, bool)):
            check_schema(value, f"{path}/{key}")
        elif key in SUBSCHEMA and isinstance(value, list):  # draft-4 tuple items
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}/{key}/{i}")
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{path}/{key}/{name}")
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}/{key}/{i}")
