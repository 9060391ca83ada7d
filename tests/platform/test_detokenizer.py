import pytest
from transformers import AutoTokenizer

from loraplex.platform.engine.detokenizer import Detokenizer

TEXT = "Grüße aus München 日本語 🙂🚀 done"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_never_emits_half_a_character(tok):
    ids = tok(TEXT).input_ids
    assert len(ids) > len(TEXT.encode()) // 4  # multi-byte characters really span tokens
    d = Detokenizer(tok, tok("Hi").input_ids)
    pieces = []
    for t in ids:
        before = d.text
        d.append(t)
        pieces.append(d.text[len(before):])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT == d.text


def test_stop_string_across_token_boundaries_is_cut(tok):
    ids = tok("hello world, hello adapters").input_ids
    d = Detokenizer(tok, [], stop=["o ad"])
    hit = None
    for t in ids:
        hit = d.append(t)
        if hit:
            break
    assert hit == "o ad"
    assert d.text == "hello world, hell"
    kept = Detokenizer(tok, [], stop=["o ad"], include_stop=True)  # vLLM's include_stop_str_in_output
    assert next(h for h in map(kept.append, ids) if h) == "o ad" and kept.text == "hello world, hello ad"


def test_streamed_text_holds_back_a_possible_stop_prefix(tok):
    d = Detokenizer(tok, [], stop=["STOP!"])
    for t in tok("abc ST").input_ids:
        d.append(t)
    shown = d.text[:d.stream_end(finished=False)]
    assert "ST" not in shown and d.text.startswith(shown)
    assert d.stream_end(finished=True) == len(d.text)
