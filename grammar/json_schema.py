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


class UnsupportedKeywordError(GrammarError):
    """A valid schema with a keyword the backend would not enforce."""


def _refuse(keyword: str, path: str, why: str = "it would be ignored", backend: str = "xgrammar") -> GrammarError:
    return UnsupportedKeywordError(f"json schema keyword {keyword!r} at {path} is not supported by the {backend} "
                                   f"grammar backend ({why}, so the request is refused)")


def check_schema(schema, path: str = "#", extra_unenforced: frozenset[str] | set[str] = frozenset(),
                 backend: str = "xgrammar", lenient_formats: frozenset[str] | set[str] = frozenset()) -> None:
    """Raise UnsupportedKeywordError for the first keyword (or `format` value) `backend` would
    not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"json schema at {path} must be an object or a boolean")
    # combinations xgrammar 0.2.9 accepts but only approximates (it says so in a log warning)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise _refuse("allOf", path, "with several schemas it is not enforced exactly", backend)
    if isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1:
        raise _refuse("oneOf", path, "it is enforced as anyOf", backend)
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise _refuse("minLength/maxLength", path, "beside a pattern they would be ignored", backend)
    if schema.get("format") in lenient_formats:
        raise _refuse(f"format: {schema['format']}", path, "it would accept values the format forbids", backend)
    for key, value in schema.items():
        if key in UNENFORCED or key in extra_unenforced:
            raise _refuse(key, path, backend=backend)
        if key in SUBSCHEMA and isinstance(value, (dict, bool)):
            check_schema(value, f"{path}/{key}", extra_unenforced, backend, lenient_formats)
        elif key in SUBSCHEMA and isinstance(value, list):  # draft-4 tuple items
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}/{key}/{i}", extra_unenforced, backend, lenient_formats)
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{path}/{key}/{name}", extra_unenforced, backend, lenient_formats)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}/{key}/{i}", extra_unenforced, backend, lenient_formats)
