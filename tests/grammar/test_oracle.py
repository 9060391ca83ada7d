"""The soundness oracle: over the official JSON-Schema-Test-Suite, every backend either refuses a
schema by naming a keyword, or accepts exactly its valid instances. Zero exceptions. Then the
cases that once slipped through, `strict: false`, and the validator backstop.

Compile + match only, no model: the default model's tokenizer, since its tokens are what the
grammars are built over.
"""

import collections
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle
from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.schema.disjoint import disjoint
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError, normalize
from loraplex.grammar.manager import GrammarManager

SUITE = Path(__file__).resolve().parent / "json-schema-test-suite"  # vendored: MIT, see its SOURCE.md
CASES = oracle.suite_cases(SUITE)
CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschema"  # beside the checkout, if there
REAL_WORLD = oracle.corpus_cases(CORPUS) if CORPUS.is_dir() else []
# outlines compiles a schema in ~0.3 s here: every 8th case in `make test`, all with -m slow
OUTLINES_EVERY = 8


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def managers(tok) -> dict[str, GrammarManager]:
    return {name: GrammarManager(tok, len(tok), [tok.eos_token_id], backend=name, timeout_s=60)
            for name in ("llguidance", "xgrammar", "outlines", "auto")}


@pytest.fixture(scope="module")
def by_backend(tok):
    return managers(tok)


def run_oracle(manager, tok, cases) -> list[str]:
    """Each wrong answer, described; and the refusals must name a keyword."""
    wrong = []
    for case in cases:
        outcome = oracle.check(manager, tok, case, tok.eos_token_id)
        if outcome.status == "refused":
            assert "json schema keyword '" in outcome.message, outcome.message
        for text, valid, description in outcome.wrong:
            wrong.append(f"{case.source} {case.description!r}: {'valid rejected' if valid else 'INVALID ACCEPTED'} "
                         f"{text[:80]} ({description})")
    return wrong


def test_the_suite_is_there():
    assert len(CASES) > 600 and {c.source.split("/")[0] for c in CASES} == {"draft2020-12", "draft7"}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "auto"])
def test_every_compiled_schema_accepts_exactly_its_valid_instances(by_backend, tok, backend):
    wrong = run_oracle(by_backend[backend], tok, CASES)
    assert not wrong, "\n".join(wrong)


def test_real_world_schemas_through_the_default_backend(by_backend, tok):
    """The 697-schema corpus (its instances labelled by a validator): the same verdict. It lives
    beside the checkout (../shared/data), not in the repo: skipped where it is absent."""
    if not REAL_WORLD:
        pytest.skip(f"no corpus at {CORPUS}")
    wrong = run_oracle(by_backend["auto"], tok, REAL_WORLD)
    assert len(REAL_WORLD) > 600 and not wrong, "\n".join(wrong)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_real_world_schemas_through_each_backend(by_backend, tok, backend):
    if not REAL_WORLD:
        pytest.skip(f"no corpus at {CORPUS}")
    wrong = run_oracle(by_backend[backend], tok, REAL_WORLD)
    assert not wrong, "\n".join(wrong)


def test_outlines_sample_of_the_oracle(by_backend, tok):
    wrong = run_oracle(by_backend["outlines"], tok, CASES[::OUTLINES_EVERY])
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_outlines_whole_oracle(by_backend, tok):
    wrong = run_oracle(by_backend["outlines"], tok, CASES)
    assert not wrong, "\n".join(wrong)


def test_auto_compiles_most_of_the_suite(by_backend, tok):
    """What each keyword's cases compile under auto (refusals are the rest); the floor guards
    against rules that refuse everything, which the oracle alone would let pass."""
    compiled = collections.Counter()
    for case in CASES:
        compiled[oracle.check(by_backend["auto"], tok, case, tok.eos_token_id).status] += 1
    assert compiled["compiled"] >= 0.5 * len(CASES), compiled


SIBLINGS = {  # issue 16: `anyOf` beside `properties` / `additionalProperties` lost its siblings
    "type": "object", "additionalProperties": False,
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "string", "maxLength": 3}},
    "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}


@pytest.mark.parametrize("combinator", ["anyOf", "oneOf", "allOf"])
def test_combinators_beside_properties_keep_their_siblings(by_backend, tok, combinator):
    schema = {**{k: v for k, v in SIBLINGS.items() if k != "anyOf"}, combinator: SIBLINGS["anyOf"]}
    instances = [({"a": 1}, True), ({"b": "xy"}, True), ({"a": 1, "b": "x"}, combinator != "oneOf"),
                 ({"a": 1, "c": 2}, False), ({"a": 99}, False), ({"b": "long"}, False), ({}, False)]
    if combinator == "allOf":
        instances = [({"a": 1, "b": "x"}, True), ({"a": 1}, False), ({"a": 1, "b": "x", "c": 0}, False)]
    case = oracle.Case("siblings", combinator, schema, [(d, v, "") for d, v in instances])
    for name in ("llguidance", "xgrammar", "auto"):
        outcome = oracle.check(by_backend[name], tok, case, tok.eos_token_id)
        assert outcome.status in ("compiled", "refused"), (name, outcome.message)
        assert not outcome.wrong, (name, outcome.wrong)
    # oneOf: {"a": 1, "b": "x"} meets both branches, so it is not an anyOf: each branch is
    # enforced with the negation of the other (exact), not coerced
    assert oracle.check(by_backend["auto"], tok, case, tok.eos_token_id).status == "compiled"


@pytest.mark.parametrize("sibling", [{"$ref": "#/$defs/n"}, {"anyOf": [{"minimum": 1}]}])
def test_xgrammar_refuses_references_and_combinators_with_siblings(by_backend, sibling):
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "integer", "maximum": 5, **sibling}
    with pytest.raises(UnsupportedKeywordError, match="sibling keywords"):
        by_backend["xgrammar"].compile(StructuredOutputs(json=schema))


def test_draft7_ref_replaces_its_siblings_and_disjoint_oneof_becomes_anyof():
    old = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {"type": "array"}},
           "properties": {"x": {"$ref": "#/definitions/a", "maxItems": 1}}}
    assert normalize(old)["properties"]["x"] == {"$ref": "#/definitions/a"}
    new = {**old, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert normalize(new)["properties"]["x"]["maxItems"] == 1
    cat = {"type": "object", "properties": {"k": {"const": "cat"}}, "required": ["k"]}
    dog = {"type": "object", "properties": {"k": {"const": "dog"}}, "required": ["k"]}
    assert disjoint([{"type": "string"}, {"type": "integer"}]) and disjoint([cat, dog])
    assert disjoint([{"type": "object", "additionalProperties": False, "properties": {"a": {}}, "required": ["a"]},
                     {"type": "object", "additionalProperties": False, "properties": {"b": {}}, "required": ["b"]}])
    assert not disjoint([{"type": "integer"}, {"type": "number"}])  # 1 is both
    assert not disjoint([{"properties": {"k": {"const": "a"}}, "required": ["k"]},
                         {"properties": {"k": {"const": "b"}}, "required": ["k"]}])  # a string satisfies both
    assert "anyOf" in normalize({"oneOf": [cat, dog]}) and "oneOf" not in normalize({"oneOf": [cat, dog]})


def test_disjoint_oneof_compiles_on_xgrammar_and_stays_exact(by_backend, tok):
    cat = {"type": "object", "additionalProperties": False, "required": ["k"], "properties": {"k": {"const": "cat"}}}
    dog = {"type": "object", "additionalProperties": False, "required": ["k", "n"],
           "properties": {"k": {"const": "dog"}, "n": {"type": "integer"}}}
    case = oracle.Case("oneOf", "tagged union", {"oneOf": [cat, dog]},
                       [({"k": "cat"}, True, ""), ({"k": "dog", "n": 1}, True, ""), ({"k": "cat", "n": 1}, False, ""),
                        ({"k": "dog"}, False, "")])
    outcome = oracle.check(by_backend["xgrammar"], tok, case, tok.eos_token_id)
    assert outcome.status == "compiled" and not outcome.wrong, (outcome.message, outcome.wrong)


def test_pattern_with_length_is_enforced_by_intersection_on_llguidance(by_backend, tok):
    schema = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}
    case = oracle.Case("pattern", "with lengths", schema,
                       [("ab", True, ""), ("abcd", True, ""), ("a", False, ""), ("abcde", False, ""), ("aB", False, "")])
    outcome = oracle.check(by_backend["auto"], tok, case, tok.eos_token_id)
    assert outcome.status == "compiled" and not outcome.wrong
    with pytest.raises(UnsupportedKeywordError, match="minLength/maxLength"):
        by_backend["xgrammar"].compile(StructuredOutputs(json=schema))


UNENFORCEABLE = {"type": "object", "additionalProperties": False, "required": ["tags", "n"],
                 "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                                "n": {"type": "integer", "not": {"multipleOf": 3}}}}


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_strict_refuses_and_non_strict_lists_what_it_dropped(by_backend, backend):
    manager = by_backend[backend]
    with pytest.raises(UnsupportedKeywordError):
        manager.compile(StructuredOutputs(json=UNENFORCEABLE))
    compiled = manager.compile(StructuredOutputs(json=UNENFORCEABLE, strict=False))
    assert sorted(compiled.unenforced) == ["not at #/properties/n", "uniqueItems at #/properties/tags"]
    assert "uniqueItems" not in json.dumps(compiled.spec.json) and "not" not in compiled.spec.json["properties"]["n"]
    # the dropped keywords are still checked after the fact, against the schema as given
    assert compiled.violation('{"tags":["a","a"],"n":1}') is not None
    assert compiled.violation('{"tags":["a","b"],"n":6}') is not None
    assert compiled.violation('{"tags":["a","b"],"n":1}') is None


def test_not_and_conditionals_are_rewritten_exactly(by_backend, tok):
    schema = {"type": "object", "additionalProperties": False, "required": ["kind", "n"],
              "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "not": {"const": 3}},
                             "s": {"type": "string", "not": {"enum": ["x", "xy"]}}},
              "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["s"]},
              "dependentRequired": {"s": ["kind"]}}
    instances = [({"kind": "a", "n": 1, "s": "y"}, True), ({"kind": "b", "n": 1}, True), ({"kind": "a", "n": 1}, False),
                 ({"kind": "b", "n": 3}, False), ({"kind": "b", "n": 1, "s": "xy"}, False),
                 ({"kind": "b", "n": 1, "s": "x1"}, True), ({"kind": "b", "n": 1, "s": ""}, True)]
    case = oracle.Case("rewrite", "not / if / dependentRequired", schema, [(d, v, "") for d, v in instances])
    outcome = oracle.check(by_backend["llguidance"], tok, case, tok.eos_token_id)
    assert outcome.status == "compiled" and not outcome.wrong, (outcome.message, outcome.wrong)
    # xgrammar gets only the light rewrites: the user's own keyword is named
    with pytest.raises(UnsupportedKeywordError, match="'if' at #"):
        by_backend["xgrammar"].compile(StructuredOutputs(json=schema))


def test_the_backstop_names_what_an_output_breaks(by_backend):
    compiled = by_backend["auto"].compile(StructuredOutputs(json=SIBLINGS))
    assert compiled.violation('{"a":1}') is None
    assert "is not valid under any of the given schemas" in compiled.violation('{"c":1}') or \
        "Additional properties" in compiled.violation('{"c":1}')
    assert compiled.violation('{"a":1') .startswith("not JSON")
    assert by_backend["auto"].compile(StructuredOutputs(json_object=True)).violation("[1]").startswith("not a JSON object")
    assert by_backend["auto"].compile(StructuredOutputs(regex="a+")).violation("b") is None  # not JSON: not checked


def test_non_strict_without_anything_to_drop_is_refused_with_the_reason(by_backend):
    with pytest.raises(GrammarError, match="Default retriever does not fetch|only local JSON pointers"):
        by_backend["auto"].compile(StructuredOutputs(json={"$ref": "http://example.com/x.json"}, strict=False))


def test_refs_into_rewritten_parts_still_resolve(by_backend, tok):
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"a": {"not": {"type": "string"}}, "b": {"$ref": "#/properties/a/not"}}}
    case = oracle.Case("ref", "into a rewritten not", schema,
                       [({"a": 1, "b": "x"}, True, ""), ({"a": "x"}, False, ""), ({"b": 1}, False, ""), ({}, True, "")])
    outcome = oracle.check(by_backend["llguidance"], tok, case, tok.eos_token_id)
    assert outcome.status == "compiled" and not outcome.wrong, (outcome.message, outcome.wrong)


class _RewriteRanAway(BaseException):
    """Raised by the step spy past its cap; a BaseException, so no `except Exception` on the way swallows it."""


def test_a_rewrite_that_would_explode_falls_back_and_is_refused_by_name(by_backend, monkeypatch):
    """The work is counted in the rewrite's own steps (`spend`), not in seconds: the deep rewrite runs
    out of its MAX_STEPS budget (TooBig) and falls back, and the whole compile stays within a few
    budgets. Unbounded, it would take billions of steps (hours): the spy fails it at the cap instead."""
    from loraplex.grammar.schema import rewrite as rewrite_module
    from loraplex.grammar.schema.rewrite_state import MAX_STEPS, TooBig

    steps, ran_out, cap = [0], [0], 10 * MAX_STEPS  # one compile here spends about 1.5 budgets
    real_spend = rewrite_module.spend

    def counting_spend():
        steps[0] += 1
        if steps[0] > cap:
            raise _RewriteRanAway(f"more than {cap} rewrite steps")
        try:
            real_spend()
        except TooBig:
            ran_out[0] += 1
            raise

    monkeypatch.setattr(rewrite_module, "spend", counting_spend)
    bomb = {"type": "integer"}
    for i in range(10):  # each oneOf negates its branches: exponential if unbounded
        bomb = {"oneOf": [bomb, {"not": bomb}, {"minimum": i}]}
    with pytest.raises(UnsupportedKeywordError, match="json schema keyword '(oneOf|not)' at #/oneOf"):
        by_backend["auto"].compile(StructuredOutputs(json=bomb))
    assert ran_out[0] >= 1, steps  # the deep rewrite hit its budget and fell back to the light one
    assert MAX_STEPS < steps[0] <= cap, steps
