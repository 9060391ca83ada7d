"""`--quantization`: which quantized format each linear layer takes, and the bits a checkpoint already holds.

`q4`: every projection in 4-bit groups of 32 and `lm_head` in 8-bit groups of 32 (the layout of
llama.cpp's Q4_1 files). From the GGUF the folder was converted from, the blocks are taken as
they are (GGUF's q/k row order undone, each checked against the folder's float weights: the
same numbers or a refusal, in the layer's `weight_loader`); otherwise quantized at load. `int8`: every
projection and `lm_head` per output channel. Adapters stay float on top (`adapters/lora_layers.py`). GPTQ and
AWQ checkpoints (4-bit, groups of a multiple of 32) are read into the same q4 format, bits kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraplex.kernels.quant import QuantizedWeight, dequantize, from_gguf, q4_from_values, rows
from loraplex.platform.models.family import PROJECTION_BLOCKS
from loraplex.platform.models.model_config import ModelConfig

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def projection_format(method: str) -> tuple[str, int | None] | None:
    """(kind, group) of a decoder projection's weight under `--quantization method` (None: not quantized)."""
    return {"none": None, "q4": ("q4", 32), "int8": ("q8", None)}[method]


def head_format(method: str) -> tuple[str, int | None] | None:
    """(kind, group) of the LM head's weight: 8 bits, in GGUF Q8_0's groups of 32 beside q4."""
    return {"none": None, "q4": ("q8", 32), "int8": ("q8", None)}[method]


def gguf_blocks(path: Path, config: ModelConfig) -> dict:
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


# ---- GPTQ / AWQ checkpoints: 4-bit groups kept as q4 --------------------------------------------

NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_COLUMN_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7


def checkpoint_quantization(config: dict | None) -> tuple[str, int, bool] | None:
    """(method, group size, zeros stored minus one) of a GPTQ / AWQ folder's
    `quantization_config`, None for a float one; what we would not read exactly is refused by name."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"quantization_config quant_method {method!r} is not supported (gptq and awq 4-bit are)")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with bits={bits} are not supported (4-bit only)")
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"awq version {config.get('version')!r} is not supported (the GEMM packing is)")
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    if group != -1 and (group < 32 or group % 32):
        raise ValueError(f"{method} group size {group} is not supported (a multiple of 32, or -1 per channel)")
    v1_zeros = method == "gptq" and config.get("checkpoint_format", "gptq") == "gptq"
    return method, group, v1_zeros


def read_prequantized(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict:
    """(layer, projection) -> q4 weight, taken out of a GPTQ / AWQ checkpoint's tensors; each
    projection's dequantized float weight is put back under its usual name, so the float model
    loads as the checkpoint's and the bits are then kept (each layer's `weight_loader`)."""
    method, group, v1_zeros = config.prequantized
    out = {}
    for i in range(config.num_layers):
        for fused, parts in config.family.projections.items():
            block = PROJECTION_BLOCKS[fused]
            for proj in parts:
                prefix = f"model.layers.{i}.{block}.{proj}."
                if prefix + "qweight" not in tensors:
                    raise ValueError(f"{method} checkpoint: {prefix}qweight missing")
                weight = _gptq(tensors, prefix, group, v1_zeros) if method == "gptq" else _awq(tensors, prefix, group)
                bias = tensors.pop(prefix + "bias", None)  # GPTQ writers save zero biases for every layer
                if bias is not None and bool(bias.any()) and not (config.qkv_bias and fused == "qkv_proj"):
                    raise ValueError(f"{method} checkpoint: {prefix}bias is non-zero where the model has none")
                if bias is not None and config.qkv_bias and fused == "qkv_proj":
                    tensors[prefix + "bias"] = bias
                tensors[prefix + "weight"] = dequantize(weight)
                out[(i, proj)] = weight
    return out


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each -> [R, C, 8], nibble j at bits 4j."""
    return (packed.to(torch.int32)[..., None] >> NIBBLE_SHIFTS) & 0xF


def _gptq(tensors: dict, prefix: str, group: int, v1_zeros: bool) -> QuantizedWeight:
    """GPTQ: qweight [K/8, N] packed along K, qzeros [G, N/8] along N (stored minus one in the
    v1 format), scales [G, N]; w = s (q - z)."""
    qweight, qzeros, scales = (tensors.pop(prefix + n) for n in ("qweight", "qzeros", "scales"))
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q = _unpack_rows(qweight).permute(0, 2, 1).reshape(k, n).T  # [N, K]
    zeros = _unpack_rows(qzeros).reshape(qzeros.shape[0], n) + (1 if v1_zeros else 0)
    group = k if group == -1 else group
    g_idx = tensors.pop(prefix + "g_idx", None)
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ValueError(f"gptq checkpoint {prefix}: act-order (desc_act) group indices are not supported")
    return _q4(q, zeros, scales, group, prefix)


def _awq(tensors: dict, prefix: str, group: int) -> QuantizedWeight:
    """AWQ (GEMM): qweight [K, N/8] and qzeros [G, N/8] packed along N in AWQ's column order,
    scales [G, N]; w = s (q - z)."""
    qweight, qzeros, scales = (tensors.pop(prefix + n) for n in ("qweight", "qzeros", "scales"))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q = _unpack_rows(qweight)[..., AWQ_COLUMN_NIBBLE].reshape(k, n).T
    zeros = _unpack_rows(qzeros)[..., AWQ_COLUMN_NIBBLE].reshape(qzeros.shape[0], n)
    return _q4(q, zeros, scales, k if group == -1 else group, prefix)


def _q4(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, prefix: str) -> QuantizedWeight:
    """Groups of `group` (a multiple of 32) as q4's groups of 32: d = s, m = -s z (exact in
    float32: a float16 scale times a small integer)."""
    n, k = q.shape
    if group % 32 or k % group or scales.shape != (k // group, n):
        raise ValueError(f"{prefix}: group size {group} with scales {tuple(scales.shape)} does not fit "
                         f"[{n}, {k}] in groups of 32")
    repeat = group // 32
    d = scales.float().T.repeat_interleave(repeat, dim=1)  # [N, K / 32]
    m = -(scales.float() * zeros.float()).T.repeat_interleave(repeat, dim=1)
    return q4_from_values(q, d, m)
