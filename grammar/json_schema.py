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


def _refuse(keyword: str, path: str, why: str = "it would be ignored") -> GrammarError:
    return GrammarError(f"json schema keyword {keyword!r} at {path} is not supported by the grammar backend "
                        f"({why}, so the request is refused)")


def check_schema(schema, path: str = "#") -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"json schema at {path} must be an object or a boolean")
    # combinations xgrammar 0.2.9 accepts but only approximates (it says so in a log warning)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise _refuse("allOf", path, "with several schemas it is not enforced exactly")
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1:
        raise _refuse("oneOf", path, "it is enforced as anyOf")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise _refuse("minLength/maxLength", path, "beside a pattern they would be ignored")
    for key, value in schema.items():
        if key in UNENFORCED:
            raise _refuse(key, path)
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
