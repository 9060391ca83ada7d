"""Read and validate a PEFT LoRA folder against the base model.

Anything the engine would not apply exactly as peft does is refused with an error naming the
adapter and the reason: nothing is ever silently ignored.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import regex
import torch

from loraplex.adapters.variants import ModulePatterns, ModuleWeights, ProjectionTerms, dora_factor, folded_b, fuse_terms
from loraplex.adapters.moe_weights import MOE_KEY, MoELoRA, check_target_parameters, read_moe_weights
from loraplex.adapters.saved_norms import NORM_KEY, read_saved_norms
from loraplex.adapters.tokenizer_overlay import read_tokenizer
from loraplex.adapters.saved_projections import fuse_replacements, is_projection_entry, saved_module
from loraplex.adapters.vocab_weights import (VOCAB_KEY, VOCAB_MODULES, BaseTables, layer_entries, read_vocab_weights,
                                             vocab_shapes)
from loraplex.platform.models.experts import lora_refusal
from loraplex.platform.models.family import FUSED_PROJECTIONS, PREFUSED_PROJECTIONS, PROJECTION_BLOCKS
from loraplex.platform.models.model_config import ModelConfig

# peft module name -> (our fused layer, slice index within it), of every family (`_collect` refuses a module
# the base model does not have: Phi-3's qkv_proj on a Llama, q_proj on a Phi-3)
TARGETS = {part: (fused, i) for projections in (FUSED_PROJECTIONS, PREFUSED_PROJECTIONS)
           for fused, parts in projections.items() for i, part in enumerate(parts)}
FUSED_OF = {part: fused for part, (fused, _) in TARGETS.items()}


def module_name(layer: int, module: str) -> str:
    """A projection's full name in the model, as peft matches patterns and modules_to_save against it."""
    return f"model.layers.{layer}.{PROJECTION_BLOCKS[FUSED_OF[module]]}.{module}"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.(.+)$")
# the part of a projection's key after its module -> what it is (variants.py says what each does)
_PARTS = ((re.compile(r"^lora_A(?:\.[\w-]+)?\.weight$"), "A"), (re.compile(r"^lora_B(?:\.[\w-]+)?\.weight$"), "B"),
          (re.compile(r"^lora_B(?:\.[\w-]+)?\.bias$"), "lora_bias"),
          (re.compile(r"^lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?$"), "magnitude"),
          (re.compile(r"^(?:base_layer\.|modules_to_save(?:\.[\w-]+)?\.)?bias$"), "bias"),
          (re.compile(r"^(?:modules_to_save(?:\.[\w-]+)?\.)?weight$"), "weight"))
# LoRA variants whose forward is not y = x W^T + s (x A^T) B^T (or whose weights are not plain A / B)
_VARIANTS = {"use_qalora": "QA-LoRA (use_qalora=true)",
             "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
             "use_bdlora": "block-diagonal LoRA (use_bdlora)", "arrow_config": "Arrow routing (arrow_config)",
             "monteclora_config": "MonteCLoRA (monteclora_config)", "kasa_config": "KaSA (kasa_config)"}


class AdapterError(ValueError):
    """A PEFT folder that cannot be served; the message names the adapter and the reason."""


@dataclass
class LoRAWeights:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks (rank_pattern)
    scaling: float  # lora_alpha / r: the embedding's and head's (each projection's own is in `terms`)
    target_modules: frozenset[str]
    # (layer, fused projection) -> (A [num_slices * r, in], B transposed [r, out_total]) on the CPU, in the
    # engine's dtype, contiguous: the layout the multi-LoRA kernels read in place (kernels/sgmv.py
    # LoRATable). A module the adapter does not target is a zero slice of a projection it touches.
    projections: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    content_hash: str = ""
    # LoRA on the embedding table: (A^T [vocab, r], B^T [r, hidden]); on the head: (A [r, hidden], B^T [r, vocab])
    embedding: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    head: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # "embed_tokens" / "lm_head" -> the adapter's own full weight [vocab, hidden] (adapters/vocab_weights.py)
    replacements: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    modules_to_save: frozenset[str] = frozenset()
    # (layer, fused projection) -> its scale, and B's bias and DoRA's factor where the adapter has them
    terms: dict[tuple[int, str], ProjectionTerms] = field(default_factory=dict, repr=False)
    kinds: tuple[str, ...] = ("lora",)  # what /v1/adapters lists: "lora", "dora", "lora_bias", "rank_pattern", ...
    # (layer, norm module) -> the adapter's own weight for it, in the model's dtype (saved_norms.py; the final
    # norm's layer is saved_norms.FINAL)
    norms: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    # "embed_tokens" / "lm_head" -> (token ids sorted, their trained rows) (trainable_tokens.py)
    tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    # sparse layer -> its router / experts / shared expert LoRA (moe_weights.py)
    moe: dict[int, MoELoRA] = field(default_factory=dict, repr=False)
    tokenizer: object = field(default=None, repr=False)  # its own tokenizer where it has one (tokenizer_overlay.py)
    # whether a step using it runs without decode graphs (extras, norms, MoE): decided on the whole adapter, so
    # that tensor-parallel ranks holding different shards of it agree
    eager: bool = False

    @cached_property
    def nbytes(self) -> int:
        """Every tensor the adapter holds, full weights included (one tensor two modules share counts once). Summed
        once (nothing changes an adapter's tensors once read): the registry asks at each cache entry and eviction."""
        pairs = [*self.projections.values(), self.embedding or (), self.head or (), *self.tokens.values(),
                 *(m.tensors() for m in self.moe.values())]
        tensors = {id(t): t for t in [*(t for pair in pairs for t in pair), *self.replacements.values()]}
        return sum(t.nbytes for t in tensors.values()) + sum(t.nbytes for t in self.terms.values()) + \
            sum(t.nbytes for t in self.norms.values())

    @property
    def dora(self) -> bool:
        return "dora" in self.kinds

    def scale_of(self, key: tuple[int, str]) -> float:
        terms = self.terms.get(key)
        return self.scaling if terms is None else terms.scale


def fused_parts(fused: str, shapes: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """The peft modules a fused projection stacks: itself where the base model has it as one module (Phi-3's
    qkv_proj and gate_up_proj are in its `module_shapes`), else its separate parts."""
    return (fused,) if fused in shapes else FUSED_PROJECTIONS[fused]


def fused_offsets(fused: str, shapes: dict[str, tuple[int, int]]) -> list[int]:
    """Output offset of each slice of a fused projection, plus the total."""
    offsets = [0]
    for part in fused_parts(fused, shapes):
        offsets.append(offsets[-1] + shapes[part][1])
    return offsets


def adapter_bytes(config: ModelConfig, rank: int, dtype: torch.dtype, modules=tuple(TARGETS)) -> int:
    """Bytes of one adapter of `rank` targeting `modules` in every layer, in our fused layout
    (a projection that is touched stores all of its slices), plus a LoRA on the embedding / head where
    `modules` names them (full weights from modules_to_save are not counted: `LoRAWeights.nbytes` is)."""
    shapes = module_shapes(config)
    fused = {TARGETS[m][0] for m in modules if m in TARGETS}
    per_layer = sum((len(fused_parts(f, shapes)) * shapes[fused_parts(f, shapes)[0]][0]
                     + fused_offsets(f, shapes)[-1]) * rank for f in fused)
    vocab = sum(sum(rows * cols for rows, cols in vocab_shapes(config)[m]) * rank for m in VOCAB_MODULES
                if m in modules)
    return (per_layer * config.num_layers + vocab) * torch.empty(0, dtype=dtype).element_size()


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """peft module -> (in_features, out_features) of the base model: the separate projections' (every family's
    geometry), and the fused modules of a family whose checkpoint holds them fused (Phi-3)."""
    q, kv, h, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    for fused, parts in config.family.projections.items():
        if parts == (fused,) and fused not in shapes:
            shapes[fused] = (h, sum(shapes[p][1] for p in FUSED_PROJECTIONS[fused]))
    return shapes


def read_peft_adapter(name: str, path: str | Path, config: ModelConfig, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32, confined: bool = False,
                      base: BaseTables | None = None, norm_dims: dict[str, int] | None = None,
                      base_tokenizer=None) -> LoRAWeights:
    """`confined`: the folder came from a client (an adapter root): `path` must be absolute and
    free of symbolic links, and it is opened one component at a time without following any, its
    files as regular, singly linked files (no hard link to elsewhere), all through one
    directory handle, so a link swapped in after the caller's check cannot redirect the read.
    `base`: the served model's embedding table and head, which copies of them in the folder are
    checked against (equal: dropped; else the adapter's own full weight, in the model's dtype). `norm_dims`: the
    served model's norms and their widths, which saved norms are checked against (None: refused).
    `base_tokenizer`: the served model's, which a tokenizer in the folder is checked against (None: not read)."""
    folder = Path(path)
    fail = lambda reason: AdapterError(f"adapter {name!r} ({folder}): {reason}")  # noqa: E731
    try:
        with _Folder(folder, confined) as files:
            raw = _read_config(files, fail)
            _refuse_moe_targets(config, raw, (), fail)  # named before the other checks of the config
            _check_config(raw, max_lora_rank, fail)
            tensors = _read_weights(files, fail)
            _refuse_moe_targets(config, raw, tensors, fail)
            tokenizer, tokenizer_bytes = read_tokenizer(files, base_tokenizer, config.vocab_size, fail)
    except (FileNotFoundError, NotADirectoryError):
        raise fail("not a folder") from None
    except OSError as exc:  # a link loop, a name too long, a link where none may be
        raise fail(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    _refuse_duplicates(tensors, fail)
    _refuse_non_finite(tensors, fail)
    patterns = ModulePatterns(raw, max_lora_rank, fail)
    rank, scaling = patterns.rank, patterns.scale
    check_target_parameters(raw, config, fail)
    targets = _target_modules(raw.get("target_modules"), fail, bool(raw.get("target_parameters")))
    _refuse_vocab_variants(raw, targets, patterns, fail)
    layers = _layers(raw, config, fail)
    served_dtype = base.dtype if base is not None else dtype  # full weights: the model's; LoRA factors: `dtype`
    vocab_keys = {key for key in tensors if VOCAB_KEY.match(key)}
    norm_keys = {key for key in tensors if NORM_KEY.match(key)}
    moe_keys = {key for key in tensors if config.moe is not None and MOE_KEY.match(key)}
    vocab = read_vocab_weights({k: tensors[k] for k in vocab_keys}, raw, targets, rank, config, dtype, base, fail)
    norms = read_saved_norms({k: tensors[k] for k in norm_keys}, layer_entries(raw), norm_dims,
                             config.num_layers, config.norm_offset, served_dtype, fail)
    moe = read_moe_weights({k: tensors[k] for k in moe_keys}, config, rank, scaling, dtype, fail)
    weights, saved = _collect({k: t for k, t in tensors.items() if k not in vocab_keys | norm_keys | moe_keys},
                              targets, patterns, config, raw, fail)
    _check_variants(raw, weights, fail)
    if not weights and vocab.embedding is None and vocab.head is None and not vocab.replacements and not norms \
            and not vocab.tokens and not moe and not saved:
        raise fail("no LoRA weights found")
    stray = sorted({layer for layer, _ in weights} - layers)
    if stray:
        raise fail(f"weights for layers {stray[:5]}, which layers_to_transform does not list")
    shapes = module_shapes(config)
    projections, terms = _fuse(weights, shapes, dtype)
    _replace(terms, saved, shapes, scaling, served_dtype, fail)
    if raw.get("use_dora"):
        _dora_factors(projections, terms, shapes, base, fail)
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode())
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(tokenizer_bytes)
    eager = bool(norms or moe or any(t.bias is not None or t.factor is not None or t.replacement is not None
                                     for t in terms.values()))
    return LoRAWeights(
        name=name, path=str(folder), rank=max([rank, *(w.rank for w in weights.values())]), scaling=scaling,
        target_modules=frozenset(targets), projections=projections, content_hash=digest.hexdigest(),
        embedding=vocab.embedding, head=vocab.head, replacements=vocab.replacements,
        modules_to_save=vocab.modules_to_save, terms=terms, kinds=_kinds(raw, vocab, norms, moe, tokenizer, saved),
        norms=norms, tokens=vocab.tokens, moe=moe, tokenizer=tokenizer, eager=eager)


def _kinds(raw: dict, vocab, norms, moe, tokenizer, saved) -> tuple[str, ...]:
    kinds = ["dora" if raw.get("use_dora") else "lora"]
    kinds += [kind for kind, on in (("lora_bias", raw.get("lora_bias")), ("rank_pattern", raw.get("rank_pattern")),
                                    ("alpha_pattern", raw.get("alpha_pattern")),
                                    ("modules_to_save", vocab.modules_to_save or norms or
                                     any("weight" in own for own in saved.values())),
                                    ("trained_bias", any(set(own) == {"bias"} for own in saved.values())),
                                    ("trainable_tokens", vocab.tokens),
                                    ("experts", any(m.gate_up or m.down for m in moe.values())),
                                    ("router", any(m.router for m in moe.values())),
                                    ("shared_expert", any(m.shared for m in moe.values())),
                                    ("tokenizer", tokenizer is not None)) if on]
    return tuple(kinds)


def _refuse_vocab_variants(raw: dict, targets: set[str], patterns: ModulePatterns, fail) -> None:
    """The embedding's and head's LoRA takes one rank and scale and no variant (peft's DoRA on an embedding
    and a head's bias are not served)."""
    vocab = sorted(targets & {"embed_tokens", "lm_head"})
    for module in vocab:
        name = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
        if patterns.rank_and_scale(name, fail) != (patterns.rank, patterns.scale):
            raise fail(f"rank_pattern / alpha_pattern give {module} a rank or alpha of its own, which is not "
                       "supported (only on the decoder layers' projections)")
    if vocab and raw.get("use_dora"):
        raise fail(f"DoRA on {vocab} is not supported (only on the decoder layers' projections)")
    if vocab and raw.get("lora_bias"):
        raise fail(f"lora_bias on {vocab} is not supported (only on the decoder layers' projections)")


def _check_variants(raw: dict, weights: dict[tuple[int, str], ModuleWeights], fail) -> None:
    """Each module holds what the config says it trained: DoRA's magnitude (and only under use_dora), B's bias
    (and only under lora_bias)."""
    if raw.get("use_dora") and raw.get("lora_bias"):
        raise fail("DoRA with lora_bias is not supported (peft does not train it either)")
    for (layer, module), w in sorted(weights.items()):
        for present, wanted, what, flag in ((w.magnitude is not None, bool(raw.get("use_dora")),
                                             "lora_magnitude_vector", "use_dora"),
                                            (w.lora_bias is not None, bool(raw.get("lora_bias")),
                                             "lora_B bias", "lora_bias")):
            if present != wanted:
                raise fail(f"layer {layer} {module}: {'a' if present else 'no'} {what}, but {flag} is "
                           f"{'false' if present else 'true'}")


def _dora_factors(projections, terms, shapes, base: BaseTables | None, fail) -> None:
    """Each DoRA projection's factor, from the served base weights (`base.projection`)."""
    if base is None or base.projection is None:
        raise fail("DoRA needs the served base weights to compute its norms (read without a model)")
    for key, (a, b_t) in projections.items():
        if terms[key].magnitude is not None:
            fused = key[1]
            terms[key].factor = dora_factor(terms[key], base.projection(*key), a, b_t, fused_offsets(fused, shapes))


def _fuse(weights: dict[tuple[int, str], ModuleWeights], shapes: dict[str, tuple[int, int]], dtype: torch.dtype
          ) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dict[tuple[int, str], ProjectionTerms]]:
    """Per-module A/B -> per fused projection A [n * r, in] and B transposed, Bt [r, out_total]
    (zeros where the adapter leaves a slice alone, or where a part's rank is below the projection's largest),
    all views of one buffer in the order a decode step reads them: each token streams its own adapter, and one
    contiguous stream per layer reads faster than separate allocations (TLB and hardware prefetch;
    benchmarks/multi_lora.py). Beside them, each projection's terms (`variants.py`)."""
    layout = [(layer, fused, parts, fused_offsets(fused, shapes),  # the order a step reads them in
               max(weights[(layer, p)].rank for p in parts if (layer, p) in weights))
              for layer in sorted({layer for layer, _ in weights})
              for fused, parts in ((fused, fused_parts(fused, shapes)) for fused in FUSED_PROJECTIONS)
              if any((layer, part) in weights for part in parts)]
    buffer = torch.zeros(sum(rank * (len(parts) * shapes[parts[0]][0] + offsets[-1])
                             for _, _, parts, offsets, rank in layout), dtype=dtype)
    out, terms, at = {}, {}, 0
    for layer, fused, parts, offsets, rank in layout:
        present = [weights.get((layer, part)) for part in parts]
        a_size, b_size = len(parts) * rank * shapes[parts[0]][0], rank * offsets[-1]
        a = buffer[at:at + a_size].view(len(parts) * rank, shapes[parts[0]][0])
        b = buffer[at + a_size:at + a_size + b_size].view(rank, offsets[-1])
        at += a_size + b_size
        terms[(layer, fused)] = fuse_terms(present, offsets)
        for i, part in enumerate(present):
            if part is not None:
                a[i * rank:i * rank + part.rank] = part.a
                b[:part.rank, offsets[i]:offsets[i + 1]] = folded_b(part, terms[(layer, fused)].scale).T
        out[(layer, fused)] = (a, b)
    return out, terms


MAX_CONFIG_BYTES, MAX_WEIGHT_BYTES = 1 << 20, 4 << 30


class _Folder:
    """The adapter folder's files, read through one directory handle (see read_peft_adapter)."""

    def __init__(self, folder: Path, confined: bool) -> None:
        self.folder, self.confined, self.fd = folder, confined, -1

    def __enter__(self) -> "_Folder":
        flags = os.O_RDONLY | os.O_DIRECTORY
        if not self.confined:
            self.fd = os.open(self.folder, flags)
            return self
        if not self.folder.is_absolute():
            raise OSError(errno.EINVAL, "not an absolute path")
        self.fd = os.open("/", flags)
        for part in self.folder.parts[1:]:  # O_NOFOLLOW on every component: no link anywhere
            parent, self.fd = self.fd, -1
            try:
                self.fd = os.open(part, flags | os.O_NOFOLLOW, dir_fd=parent)
            finally:
                os.close(parent)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)

    def read(self, name: str, limit: int, fail) -> bytes | None:
        """The file's bytes; None if it does not exist."""
        # O_NONBLOCK: opening a FIFO planted in the folder must not wait for a writer forever
        flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if self.confined else 0)
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise fail(f"{name} is not a regular file")
            if self.confined and info.st_nlink != 1:
                raise fail(f"{name} is hard-linked (it may be a file from outside the adapter root)")
            if info.st_size > limit:
                raise fail(f"{name} is larger than {limit} bytes")
            return f.read(limit + 1)


def _read_config(files: _Folder, fail) -> dict:
    text = files.read("adapter_config.json", MAX_CONFIG_BYTES, fail)
    if text is None:
        raise fail("adapter_config.json is missing")
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise fail(f"adapter_config.json is not valid JSON ({type(exc).__name__} at position "
                   f"{getattr(exc, 'pos', getattr(exc, 'start', '?'))})") from None
    except RecursionError:
        raise fail("adapter_config.json nests too deeply") from None
    if not isinstance(raw, dict):
        raise fail("adapter_config.json must hold a JSON object")
    return raw


def _refuse_moe_targets(config: ModelConfig, raw: dict, keys, fail) -> None:
    reason = lora_refusal(config, raw, keys)
    if reason is not None:
        raise fail(reason)


def _check_config(raw: dict, max_lora_rank: int, fail) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    for key, variant in _VARIANTS.items():
        if raw.get(key):
            raise fail(f"{variant} is not supported")
    if raw.get("bias", "none") not in ("none", "all", "lora_only"):
        raise fail(f"bias={raw.get('bias')!r} is not supported ('none', 'all' or 'lora_only')")
    if raw.get("layers_pattern") not in (None, "layers", ["layers"]):
        raise fail(f"layers_pattern {raw['layers_pattern']!r} is not supported (only 'layers')")
    for key in ("layer_replication",):
        if raw.get(key):
            raise fail(f"{key} is not supported")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"rank r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank={max_lora_rank}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a finite number, got {alpha!r}")


def _layers(raw: dict, config: ModelConfig, fail) -> set[int]:
    """The layers the adapter may touch (peft's layers_to_transform; absent: all)."""
    value = raw.get("layers_to_transform")
    if value is None:
        return set(range(config.num_layers))
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(x, int) and 0 <= x < config.num_layers for x in layers):
        raise fail(f"layers_to_transform must list layers in [0, {config.num_layers}), got {value!r}")
    return set(layers)


# each module we serve -> the full names peft matches a target_modules regex against
_MODULE_NAMES = {**{m: [f"model.layers.0.{block}.{m}" for block in ("self_attn", "mlp", "mlp.shared_expert",
                                                                   "mlp.experts.0")] for m in TARGETS},
                 "shared_expert_gate": ["model.layers.0.mlp.shared_expert_gate"],
                 # a MoE layer's router and (older transformers) its per-expert modules
                 "gate": ["model.layers.0.mlp.gate", "model.layers.0.block_sparse_moe.gate"],
                 **{w: [f"model.layers.0.block_sparse_moe.experts.0.{w}"] for w in ("w1", "w2", "w3")},
                 "embed_tokens": ["model.embed_tokens"], "lm_head": ["lm_head"]}


def _target_modules(value, fail, parameters: bool = False) -> set[str]:
    """Our module names of peft's `target_modules` (`parameters`: the adapter has target_parameters too, so
    none is fine). A listed name may carry the path above it (`shared_expert.gate_proj`), as peft matches the end
    of each module's name."""
    if isinstance(value, str) and value != "all-linear":  # peft: a regex matched against full module names
        if len(value) > 1024:
            raise fail("target_modules regex is longer than 1024 characters")
        try:  # the `regex` engine, with a time bound: a client's pattern may backtrack forever
            matched = {m for m, names in _MODULE_NAMES.items() if value == m or any(
                regex.fullmatch(value, name, timeout=0.05) for name in names)}
        except regex.error as exc:
            raise fail(f"target_modules regex is invalid ({exc})") from None
        except TimeoutError:
            raise fail("target_modules regex takes too long to match (catastrophic backtracking)") from None
        if not matched:
            raise fail(f"target_modules regex {value!r} matches none of {sorted(_MODULE_NAMES)}")
        return matched
    if value == "all-linear":  # peft: every linear layer but the output layer
        return set(TARGETS)
    if value is not None and (not isinstance(value, list) or not all(isinstance(m, str) for m in value)):
        raise fail(f"target_modules must be a list of module names or a regex, got {type(value).__name__}")
    modules = {m.rpartition(".")[2] if m.rpartition(".")[2] in _MODULE_NAMES else m for m in value or []}
    unknown = modules - set(_MODULE_NAMES)
    if unknown:
        raise fail(f"unsupported target modules {sorted(unknown)}; supported: {sorted(_MODULE_NAMES)}")
    if not modules and not parameters:
        raise fail("target_modules is empty")
    return modules


def _read_weights(files: _Folder, fail) -> dict[str, torch.Tensor]:
    for name, load in (("adapter_model.safetensors", _load_safetensors), ("adapter_model.bin", _load_bin)):
        data = files.read(name, MAX_WEIGHT_BYTES, fail)
        if data is None:
            continue
        try:
            tensors = load(data)
        except Exception as exc:  # corrupt or truncated file: any reader error is the adapter's fault
            raise fail(f"cannot read weights: {type(exc).__name__}: {str(exc)[:200]}") from None
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                    for k, t in tensors.items()):
            raise fail(f"{name} must map weight names to tensors")
        return tensors
    raise fail("adapter_model.safetensors (or .bin) is missing")


# spellings of one tensor: peft's `base_model.model.` prefix, an adapter-name segment after the factor
# or in modules_to_save, a `.weight` suffix or none; what is left names the tensor
_SPELLINGS = (re.compile(r"^base_model\.model\."), re.compile(r"\.weight$"),
              re.compile(r"\.base_layer(?=\.bias$)|(?<=\.lora_B)\.[\w-]+(?=\.bias$)"),
              re.compile(r"(?<=\.lora_[AB])\.(?!bias$)[\w-]+$|(?<=\.lora_embedding_[AB])\.[\w-]+$"
                         r"|(?<=\.lora_magnitude_vector)\.[\w-]+$"),
              re.compile(r"\.modules_to_save(?:\.[\w-]+)?$"))


def tensor_name(key: str) -> str:
    """The tensor a weight key names, whatever its spelling."""
    for spelling in _SPELLINGS:
        key = spelling.sub("", key)
    return key


def _refuse_duplicates(tensors: dict[str, torch.Tensor], fail) -> None:
    """Each tensor under one key: a second spelling would be read in place of the first, and only
    one of them checked."""
    seen: dict[str, str] = {}
    for key in tensors:
        first = seen.setdefault(tensor_name(key), key)
        if first != key:
            raise fail(f"weights {first!r} and {key!r} are the same tensor under two spellings")


def _refuse_non_finite(tensors: dict[str, torch.Tensor], fail) -> None:
    """NaN or infinite weights would turn every output of a request on the adapter into garbage."""
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            nan = int(torch.isnan(tensor).sum())
            raise fail(f"weight {key!r} has {nan} NaN and {int((~finite).sum()) - nan} infinite values")


def _load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def _load_bin(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _collect(tensors: dict[str, torch.Tensor], targets: set[str], patterns: ModulePatterns, config: ModelConfig,
             raw: dict, fail) -> tuple[dict[tuple[int, str], ModuleWeights], dict[tuple[int, str], dict]]:
    """(LoRA modules, modules whose own weight or trained bias the folder holds: saved_projections.py)."""
    shapes = module_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        part = match and next((kind for pattern, kind in _PARTS if pattern.match(match[3])), None)
        if part is None:
            raise fail(f"unexpected weight {key!r} (only LoRA A/B of {sorted(_MODULE_NAMES)}, their lora_B bias "
                       f"and DoRA magnitude, saved modules and trained biases, and full weights of "
                       f"{list(VOCAB_MODULES)} are supported)")
        layer, module = int(match[1]), match[2]
        if config.family.fused_of(module) is None:
            raise fail(f"weight {key!r} is for {module}, which a {config.architecture} does not have: wrong base "
                       "model?")
        if layer >= config.num_layers:
            raise fail(f"weight {key!r}: the base model has {config.num_layers} layers")
        found.setdefault((layer, module), {})[part] = tensor
    lora, saved = {}, {}
    for key, parts in sorted(found.items()):
        own = {k: parts.pop(k) for k in ("weight", "bias") if k in parts}
        if parts:
            if key[1] not in targets:
                raise fail(f"LoRA weights for layer {key[0]} {key[1]}, which target_modules does not list")
            lora[key] = _module(key, parts, patterns, shapes, fail)
        if own:
            saved[key] = _own(key, own, key in lora, layer_entries(raw), raw.get("bias", "none"), shapes, fail)
    _refuse_unsaved(saved, layer_entries(raw), fail)
    return lora, saved


def _refuse_unsaved(saved: dict[tuple[int, str], dict], entries: list[str], fail) -> None:
    """A modules_to_save entry naming projections that the folder holds no weight for."""
    names = [module_name(layer, module) for (layer, module), own in saved.items() if "weight" in own]
    missing = sorted(entry for entry in entries if is_projection_entry(entry)
                     and not any(saved_module(name, [entry]) for name in names))
    if missing:
        raise fail(f"modules_to_save lists {missing}, but the folder holds no weight for it")


def _own(key: tuple[int, str], own: dict[str, torch.Tensor], is_lora: bool, entries: list[str], bias_mode: str,
         shapes, fail) -> dict[str, torch.Tensor]:
    """A module's own weight (a saved module) or its trained bias, checked against the config and the shapes."""
    layer, module = key
    saved = saved_module(module_name(layer, module), entries)
    if "weight" in own and (is_lora or not saved):
        raise fail(f"layer {layer} {module}: a full weight, but it is " + ("a LoRA target too" if is_lora else
                                                                            "not in modules_to_save"))
    if "weight" not in own and (bias_mode == "none" or (bias_mode == "lora_only" and not is_lora)):
        raise fail(f"layer {layer} {module}: a trained bias, but bias={bias_mode!r}")
    in_f, out_f = shapes[module]
    for name, want in (("weight", (out_f, in_f)), ("bias", (out_f,))):
        if name in own and tuple(own[name].shape) != want:
            raise fail(f"layer {layer} {module}: its own {name} of shape {tuple(own[name].shape)} does not fit the "
                       f"base model {want}: wrong base model?")
    return own


def _replace(terms: dict[tuple[int, str], ProjectionTerms], saved: dict[tuple[int, str], dict], shapes,
             scaling: float, dtype: torch.dtype, fail) -> None:
    """Each fused projection's rows under the adapter's own values, into its terms (`dtype`: the model's)."""
    for layer, fused in sorted({(layer, FUSED_OF[module]) for layer, module in saved}):
        parts = [saved.get((layer, part)) for part in fused_parts(fused, shapes)]
        try:
            replacement = fuse_replacements(parts, fused_offsets(fused, shapes), dtype)
        except ValueError as exc:
            raise fail(f"layer {layer} {fused}: {exc}") from None
        term = terms.setdefault((layer, fused), ProjectionTerms(scaling))
        if term.magnitude is not None:
            raise fail(f"layer {layer} {fused}: DoRA beside saved modules or trained biases is not supported")
        term.replacement = replacement


def _module(key: tuple[int, str], parts: dict[str, torch.Tensor], patterns: ModulePatterns,
            shapes: dict[str, tuple[int, int]], fail) -> ModuleWeights:
    layer, module = key
    if not {"A", "B"} <= set(parts):
        raise fail(f"layer {layer} {module}: lora_A and lora_B must both be present")
    rank, scale = patterns.rank_and_scale(module_name(layer, module), fail)
    in_f, out_f = shapes[module]
    a, b = parts["A"], parts["B"]
    if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
        raise fail(f"layer {layer} {module}: shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit the base "
                   f"model (expected A({rank}, {in_f}) B({out_f}, {rank})): wrong base model or rank_pattern?")
    for part in ("lora_bias", "magnitude"):
        if part in parts and tuple(parts[part].shape) != (out_f,):
            raise fail(f"layer {layer} {module}: {part} of shape {tuple(parts[part].shape)} does not fit the base "
                       f"model (expected ({out_f},))")
    return ModuleWeights(a.float(), b.float(), scale, parts.get("lora_bias"), parts.get("magnitude"))
