"""An adapter's own tokenizer (a fine-tune that added tokens, or changed the chat template), used for its requests'
prompts, chat template and outputs in place of the base model's.

Trainers save the tokenizer beside the adapter. It is read only where the folder holds a `tokenizer.json` whose
vocabulary or chat template differs from the base's; one equal to the base's is dropped. It must keep every
base token at its id (so the base's grammars, tool-call and reasoning markers and stop tokens mean the same), and
each token it adds must have a row in the base model (a vocabulary padded beyond the base tokenizer, as most are):
the adapter gives that row its values (trainable tokens, or a saved embedding). A token past the base model's rows
is refused by name: serving it needs a resized vocabulary.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# what AutoTokenizer reads from a folder; only tokenizer.json's presence makes an overlay
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja")
MAX_BYTES = 64 << 20


def read_tokenizer(files, base_tokenizer, vocab_size: int, fail) -> tuple[object | None, bytes]:
    """(the adapter's tokenizer, or None where it has none or one the base already is; the bytes of its files, for
    the adapter's content hash). `files`: the folder, read without following links."""
    if base_tokenizer is None:
        return None, b""
    data = {name: files.read(name, MAX_BYTES, fail) for name in FILES}
    if data["tokenizer.json"] is None:
        return None, b""
    data["tokenizer_config.json"] = _inert(data["tokenizer_config.json"], fail)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="loraplex-tokenizer-") as tmp:
        for name, content in data.items():
            if content is not None:
                Path(tmp, name).write_bytes(content)
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False, local_files_only=True)
        except Exception as exc:  # a malformed file is the adapter's fault
            raise fail(f"its tokenizer cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
    blob = b"".join(name.encode() + (content or b"") for name, content in sorted(data.items()))
    return _checked(tokenizer, base_tokenizer, vocab_size, fail), blob


def _inert(config: bytes | None, fail) -> bytes | None:
    """tokenizer_config.json without what could reach past the folder: a class to import from elsewhere
    (`auto_map`) or another file to read (`*_file`)."""
    if config is None:
        return None
    try:
        raw = json.loads(config)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise fail("its tokenizer_config.json is not valid JSON") from None
    if not isinstance(raw, dict):
        raise fail("its tokenizer_config.json must hold a JSON object")
    return json.dumps({k: v for k, v in raw.items() if k != "auto_map" and not k.endswith("_file")}).encode()


def _checked(tokenizer, base_tokenizer, vocab_size: int, fail):
    if tokenizer.chat_template is None:  # saved without one: the base's template stands
        tokenizer.chat_template = base_tokenizer.chat_template
    vocab, base = tokenizer.get_vocab(), base_tokenizer.get_vocab()
    if vocab == base and tokenizer.chat_template == base_tokenizer.chat_template:
        return None
    moved = sorted(token for token, i in base.items() if vocab.get(token) != i)
    if moved:
        raise fail(f"its tokenizer gives {len(moved)} base tokens other ids (as {moved[:3]}): it must keep the "
                   "base tokenizer's ids and add to them")
    outside = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if outside:
        raise fail(f"its tokenizer adds tokens past the base model's {vocab_size} rows (as {outside[0][1]!r} at "
                   f"{outside[0][0]}): serving them needs a resized vocabulary")
    log.info("an adapter brings its own tokenizer (%d tokens added%s)", len(vocab) - len(base),
             ", its own chat template" if tokenizer.chat_template != base_tokenizer.chat_template else "")
    return tokenizer
