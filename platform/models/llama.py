"""The shared decoder over a paged KV cache (`DecoderModel`), which every family runs: what a family changes is
a `ModelConfig` field its declaration sets, or a decoder layer of its own (`families.py`, docs/families.md).

q/k/v and gate/up are fused into one matmul each; weights load straight from safetensors, each linear layer's
through its format. The model knows no adapters: LoRA layers wrap its modules (`adapters/lora_layers.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loraplex.kernels.custom_ops import (GeluTanhAndMul, PagedAttention, RMSNorm, RopeKVWrite, SiluAndMul,
                                        pointwise_op)
from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import tile_table_into_head
from loraplex.kernels.paged_attention import PagedAttentionMetadata
from loraplex.kernels.quant import concat
from loraplex.platform.distributed import all_gather_rows, all_reduce, identity
from loraplex.platform.models.experts import is_sparse_layer
from loraplex.platform.models.family import PROJECTION_BLOCKS
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.model_config import ModelConfig
from loraplex.platform.models.moe import SparseMoEBlock
from loraplex.platform.models.quantized import gguf_blocks, head_format, projection_format, read_prequantized
from loraplex.platform.models.rope import RotaryEmbedding
from loraplex.platform.models.sharding import column, gate_up_rows, o_cols, qkv_rows, row, span, vocab_rows


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelConfig, index: int) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        weights, plan = projection_format(kernels.quantization), config.shard
        self.qkv_proj = Linear(config.hidden_size, (heads + 2 * kv_heads) * head_dim, config.qkv_bias, kernels,
                               weights, plan and column(qkv_rows(plan)))
        self.o_proj = Linear(self.q_size, config.hidden_size, False, kernels, weights, plan and row(o_cols(plan)))
        self.reduce = all_reduce if plan else identity  # o is row-parallel: each rank holds a partial sum
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, kernels)
        self.rope_kv_write = RopeKVWrite(heads, kv_heads, head_dim, kernels)
        self.attn = PagedAttention(config.attention_scale, kernels, sliding_window=config.layer_windows[index],
                                   prefill=kernels.prefill_attention,
                                   softcap=config.attn_logit_softcap)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache, meta: PagedAttentionMetadata):
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if self.qk_norm:
            qkv = self.norm_heads(qkv)
        q = self.rope_kv_write(qkv, rope, k_cache, v_cache, meta)
        out = self.attn(q, k_cache, v_cache, meta)
        return self.reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Each q and k head RMS-normalized over head_dim (before RoPE, as Qwen3 and Gemma 3 do)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous().view(-1, self.num_heads, self.head_dim))  # the norm reads contiguous rows
        k = self.k_norm(k.contiguous().view(-1, self.num_kv_heads, self.head_dim))
        return torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)


def activation_and_mul(name: str, kernels: KernelConfig) -> nn.Module:
    """The MLP's gate activation times up, by transformers' activation name (ModelConfig checks it)."""
    return GeluTanhAndMul(kernels) if name == "gelu_pytorch_tanh" else SiluAndMul(kernels)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelConfig) -> None:
        super().__init__()
        weights, plan = projection_format(kernels.quantization), config.shard
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, kernels, weights,
                                   plan and column(gate_up_rows(plan.intermediate, plan.intermediate_size)))
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, kernels, weights,
                                plan and row(span(*plan.intermediate)))
        self.act = activation_and_mul(config.hidden_act, kernels)
        self.reduce = all_reduce if plan else identity  # down is row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.down_proj(self.act(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: KernelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, kernels, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.post_norms = config.post_norms
        if config.post_norms:  # Gemma: post_attention_layernorm normalizes the attention output itself
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.residual_multiplier = config.residual_multiplier
        self.mlp = SparseMoEBlock(config, kernels) if is_sparse_layer(config, index) else MLP(config, kernels)

    def forward(self, x, residual, rope, kv_cache, meta):
        """-> (this layer's MLP output, the residual stream before adding it); the add happens in
        the next norm (fused with it)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        if self.post_norms:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(self.scaled(h), residual)
        return self.scaled(self.mlp(h)), residual

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream: times Granite's residual_multiplier."""
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class VocabEmbedding(nn.Embedding):
    """The token embedding; a tied table held once, in the head's weight format (`hold_in`), is read from there.
    Under tensor parallelism each rank holds the rows `vocab` = [first, end): a token outside them reads zeros,
    and the all-reduce gives every rank its row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab: tuple[int, int] | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.read_rows = super().forward
        self.vocab = vocab
        if vocab is not None:
            self.forward = self.sharded_forward

    def hold_in(self, head: Linear) -> None:
        """The table is the head's (its tiles): drop this copy and read rows from the head."""
        self.weight = None
        self.read_rows = head.rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.read_rows(input_ids)

    def sharded_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        first, end = self.vocab
        held = (input_ids >= first) & (input_ids < end)
        rows = self.read_rows((input_ids - first).clamp_(0, end - first - 1))
        return all_reduce(rows * held.unsqueeze(-1).to(rows.dtype))


class ParallelHead(Linear):
    """The vocabulary-parallel LM head: each rank's rows of the logits, gathered into every rank's whole row."""

    def __init__(self, hidden: int, vocab: list[tuple[int, int]], rank: int, kernels: KernelConfig, weights) -> None:
        first, end = vocab[rank]
        super().__init__(hidden, end - first, False, kernels, weights, column(span(first, end)))
        sizes, own = [e - f for f, e in vocab], self.method.apply
        self.apply_method = lambda layer, x: all_gather_rows(own(layer, x), sizes)  # what LoRAHead calls too


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int, kernels: KernelConfig | None = None) -> None:
        super().__init__()
        kernels = kernels or KernelConfig()
        self.config, self.kernels = config, kernels
        plan = config.shard
        vocab = plan.vocab if plan else (0, config.vocab_size)
        self.embed_tokens = VocabEmbedding(vocab[1] - vocab[0], config.hidden_size, plan and plan.vocab)
        layer = config.family.decoder_layer or DecoderLayer  # a family whose layers differ declares its own
        self.layers = nn.ModuleList(layer(config, kernels, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.rope = RotaryEmbedding(config, max_len)
        self.embed_scale = float(torch.tensor(config.embedding_multiplier, device="cpu").to(kernels.dtype))
        self.lm_head = ParallelHead(config.hidden_size, plan.every_rank("vocab"), plan.rank, kernels,
                                    head_format(kernels.quantization)) if plan else \
            Linear(config.hidden_size, config.vocab_size, False, kernels, head_format(kernels.quantization))
        self.tanh = pointwise_op(kernels, torch.tanh)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.shared_weight = True  # kept when the head's weight is processed: it is the table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """Flat batch of tokens -> final hidden states [T, hidden]."""
        x, residual = self.scale_embeddings(self.embed_tokens(input_ids)), None
        ropes = self.rope.at(positions, x.dtype)
        for layer, kv_cache, rope in zip(self.layers, kv_caches, ropes):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> their rows of the embedding table, wherever the table is held."""
        return self.embed_tokens(input_ids)

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma's sqrt(hidden) and Granite's embedding_multiplier (rounded to the model's dtype in `__init__`,
        as transformers' Gemma rounds it), on the embedding's output: adapters' rows and deltas included, as
        transformers does for Granite and peft for Gemma's scaled embedding."""
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only where it needs float32."""
        return self.shape_logits(self.lm_head(hidden))

    def shape_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's logits_scaling (a division) and Gemma's final soft cap c tanh(logits / c)."""
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        return logits if cap is None else self.tanh(logits / cap) * cap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).float()

    @torch.no_grad()
    def load_weights(self, folder: str | Path, tensors: dict[str, torch.Tensor] | None = None,
                     blocks: dict | None = None) -> None:
        """Every checkpoint tensor into its parameter; each linear layer's through its format's `weight_loader`.
        `blocks`: quantized bits the checkpoint (or its GGUF) holds, by (layer, module) and "lm_head"."""
        tensors = _read_safetensors(Path(folder)) if tensors is None else tensors
        loader = _Loader(dict(self.named_parameters()), tensors, folder, blocks or {})
        embedding = loader.take("model.embed_tokens.weight")
        plan = self.config.shard
        loader.put("embed_tokens.weight", embedding[vocab_rows(plan)] if plan else embedding)
        loader.put("norm.weight", loader.take("model.norm.weight"))
        head = embedding if self.config.tie_word_embeddings else loader.take("lm_head.weight")
        loader.linear("lm_head", self.lm_head, head, loader.blocks.get("lm_head"))
        for i, layer in enumerate(self.layers):
            self._load_layer(loader, i, layer)
        tensors.pop("lm_head.weight", None)  # tied checkpoints may still carry a copy
        loader.finish()
        if self.config.norm_offset:  # Gemma's norms multiply by (1 + w): the 1 added once, here
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight += self.config.norm_offset

    def _load_layer(self, loader: "_Loader", i: int, layer: nn.Module) -> None:
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm, module in layer.named_modules():  # the layer's norms, q/k norms included
            if isinstance(module, RMSNorm):
                loader.put(dst + norm + ".weight", loader.take(src + norm + ".weight"))
        sparse = isinstance(layer.mlp, SparseMoEBlock)
        for fused, parts in self.config.family.projections.items():
            block = PROJECTION_BLOCKS[fused]
            if block == "mlp" and sparse:
                continue  # the block reads its own names below
            names = [f"{src}{block}.{part}" for part in parts]
            weight = torch.cat([loader.take(name + ".weight") for name in names])
            bits = loader.bits(i, parts)
            loader.linear(dst + block + "." + fused, getattr(getattr(layer, block), fused), weight, bits)
            if fused == "qkv_proj" and self.config.qkv_bias:
                bias = torch.cat([loader.take(n + ".bias") for n in names])
                loader.put(dst + block + "." + fused + ".bias", getattr(layer, block).qkv_proj.shard_bias(bias))
        if sparse:  # router, experts, shared expert
            layer.mlp.load_weights(loader.take, src)
            loader.loaded.update(dst + "mlp." + name for name, _ in layer.mlp.named_parameters())


class _Loader:
    """One checkpoint's tensors taken by name (each once), parameters filled and counted: what is left over or
    never filled is an error naming it."""

    def __init__(self, params: dict[str, nn.Parameter], tensors: dict[str, torch.Tensor], folder, blocks: dict
                 ) -> None:
        self.params, self.tensors, self.folder, self.blocks = params, tensors, folder, blocks
        self.loaded: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"weight {name} missing from {self.folder}")
        return self.tensors.pop(name)

    def put(self, name: str, value: torch.Tensor) -> None:
        param = self.params[name]
        if param.shape != value.shape:
            raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(value.shape)}")
        param.copy_(value)
        self.loaded.add(name)

    def linear(self, name: str, layer: Linear, weight: torch.Tensor, bits=None) -> None:
        try:
            layer.weight_loader(weight, bits)
        except ValueError as exc:
            raise ValueError(f"weight {name}: {exc}") from None
        self.loaded.add(name + ".weight")

    def bits(self, layer: int, parts: tuple[str, ...]):
        """The checkpoint's quantized bits of these modules of `layer`, stacked; None where it holds none."""
        if not self.blocks:
            return None
        return concat([self.blocks[(layer, part)] for part in parts])

    def finish(self) -> None:
        leftovers = [k for k in self.tensors if not k.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ValueError(f"unexpected weights in {self.folder}: {leftovers[:5]}")
        missing = set(self.params) - self.loaded
        if missing:
            raise ValueError(f"weights not loaded: {sorted(missing)[:5]}")


def _read_safetensors(folder: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (`names`: only these)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}")
    tensors = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                if names is None or key in names:
                    tensors[key] = f.get_tensor(key)
    return tensors


def checkpoint_weights(folder: str | Path, config: ModelConfig, dtype: torch.dtype):
    """(dense(module), projection(layer, fused)): the checkpoint's embedding table or head [vocab, hidden] and a
    layer's fused projection [out_total, in], in `dtype`, read when asked (what a process holding no model, or a
    shard of it, checks an adapter against)."""
    folder = Path(folder)

    def read(names: list[str]) -> torch.Tensor:
        found = _read_safetensors(folder, set(names))
        return torch.cat([found[name] for name in names]).to(dtype)

    def dense(module: str) -> torch.Tensor:
        tied = module == "embed_tokens" or config.tie_word_embeddings
        return read(["model.embed_tokens.weight" if tied else "lm_head.weight"])

    def projection(layer: int, fused: str) -> torch.Tensor:
        block = PROJECTION_BLOCKS[fused]
        return read([f"model.layers.{layer}.{block}.{part}.weight" for part in config.family.projections[fused]])

    return dense, projection


def load_model(folder: str | Path, config: ModelConfig, kernels: KernelConfig, max_len: int,
               gguf: Path | None = None, device: torch.device = torch.device("cpu")) -> DecoderModel:
    """The model in `kernels.dtype` on `device`, each linear layer's weight processed into its format. Built in
    that dtype on that device, each checkpoint tensor converted as it is copied in: a float32 model converted
    after would hold twice the weights (an 8B model: 32 GB to load into 16). A quantized format quantizes each
    weight from the checkpoint's own numbers as it arrives (or keeps the GGUF's / GPTQ / AWQ bits, checked)."""
    with torch.device("meta"):
        model = DecoderModel(config, max_len, kernels)
    model = model.to(kernels.dtype).to_empty(device=device)  # on meta the dtype costs nothing
    model.rope = RotaryEmbedding(config, max_len).to(device=device, dtype=kernels.dtype)  # computed, not loaded
    tensors = _read_safetensors(Path(folder))
    blocks = read_prequantized(tensors, config) if config.prequantized else None  # GPTQ / AWQ: bits kept
    if blocks is not None and kernels.quantization != "q4":
        raise ValueError(f"{Path(folder).name} is a {config.prequantized[0]} 4-bit checkpoint: serve it with "
                         f"quantization q4 (its bits as they are), not {kernels.quantization}")
    if blocks is None and kernels.quantization == "q4" and gguf is not None:
        blocks = gguf_blocks(gguf, config)  # the folder's GGUF: its Q4_1 / Q8_0 bits as they are
    model.load_weights(folder, tensors, blocks)
    model.tie_weights()
    # never trained here: without this, a matmul outside inference_mode on an unpacked weight
    # (prompt logprobs in bfloat16 on CPU, anything on CUDA) fails on the step's inference tensors
    model = model.eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
    if config.tie_word_embeddings and tile_table_into_head(kernels, model.lm_head, model.embed_tokens.weight):
        model.embed_tokens.hold_in(model.lm_head)
    return model
