"""`--quantization`: a loaded model's linear layers switched to quantized weights.

`q4`: every projection in 4-bit groups of 32 and `lm_head` in 8-bit groups of 32 (the layout of
llama.cpp's Q4_1 files). From the GGUF the folder was converted from, the blocks are taken as
they are (GGUF's q/k row order undone, each checked against the folder's float weights: the
same numbers or a refusal); otherwise quantized at load. `int8`: every projection and
`lm_head` per output channel. Adapters stay float32 on top (`LoRALinear`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.kernels.quant import QuantizedWeight, concat, dequantize, from_gguf, quantize, rows
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def quantize_model(model, method: str, gguf: Path | None = None) -> None:
    config: ModelConfig = model.config
    blocks = _gguf_blocks(gguf, config) if method == "q4" and gguf is not None else None
    tied = config.tie_word_embeddings
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            module = getattr(layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp, fused)
            if blocks is not None:
                weight = concat([blocks[(i, p)] for p in parts])
                _check_same(weight, module.weight, f"layer {i} {fused}")
            else:
                weight = quantize(module.weight, "q4" if method == "q4" else "q8")
            module.quantize(weight)
    if blocks is not None and "lm_head" in blocks:
        head = blocks["lm_head"]
        _check_same(head, model.lm_head.weight, "lm_head")
    else:
        head = quantize(model.lm_head.weight, "q8", 32 if method == "q4" else None)
    model.lm_head.quantize(head, keep_weight=tied)  # a tied weight is also the embedding table


def _gguf_blocks(path: Path, config: ModelConfig) -> dict:
    """(layer, projection) -> its Q4_1 blocks in our row order; "lm_head" -> the Q8_0 output
    (or tied embedding) blocks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out: dict = {}
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    by_name = {t.name: t for t in reader.tensors}
    for i in range(config.num_layers):
        for proj, short in GGUF_NAMES.items():
            tensor = by_name.get(f"blk.{i}.{short}.weight")
            if tensor is None or tensor.tensor_type.name != "Q4_1":
                kind = tensor.tensor_type.name if tensor is not None else "missing"
                raise ValueError(f"{path.name}: blk.{i}.{short} is {kind}; q4 keeps Q4_1 blocks only")
            weight = from_gguf(tensor.data, "Q4_1", int(tensor.shape[0]))
            if proj in heads:  # llama.cpp's converter interleaves each head's rotary halves
                weight = rows(weight, _unpermute(weight.shape[0], heads[proj]))
            out[(i, proj)] = weight
    head = by_name.get("output.weight", by_name.get("token_embd.weight"))  # untied, else the tied table
    if head is not None and head.tensor_type.name == "Q8_0":
        out["lm_head"] = from_gguf(head.data, "Q8_0", int(head.shape[0]))
    return out


def _unpermute(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row index undoing llama.cpp's q/k permutation (transformers' reverse_permute_weights)."""
    index = torch.arange(num_rows)
    return index.reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(2, 1).reshape(num_rows)


def _check_same(weight: QuantizedWeight, dense: torch.Tensor, what: str) -> None:
    if not torch.allclose(dequantize(weight), dense.detach().float(), rtol=1e-5, atol=1e-6):
        raise ValueError(f"GGUF blocks of {what} do not match the model folder's weights: not its source")
