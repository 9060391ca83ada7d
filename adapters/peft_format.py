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
from pathlib import Path

import regex
import torch

from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS

# peft module name -> (our fused layer, slice index within it)
TARGETS = {part: (fused, i) for fused, parts in FUSED_PROJECTIONS.items() for i, part in enumerate(parts)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """A PEFT folder that cannot be served; the message names the adapter and the reason."""


@dataclass
class LoRAWeights:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    # (layer, fused projection) -> (A [num_slices * r, in], B transposed [r, out_total]) on the CPU, in the
    # engine's dtype, contiguous: the layout the multi-LoRA kernels read in place (kernels/sgmv.py
    # LoRATable). A module the adapter does not target is a zero slice of a projection it touches.
    projections: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    content_hash: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.projections.values())


def fused_offsets(fused: str, shapes: dict[str, tuple[int, int]]) -> list[int]:
    """Output offset of each slice of a fused projection, plus the total."""
    offsets = [0]
    for part in FUSED_PROJECTIONS[fused]:
        offsets.append(offsets[-1] + shapes[part][1])
    return offsets


def adapter_bytes(config: ModelConfig, rank: int, dtype: torch.dtype, modules=tuple(TARGETS)) -> int:
    """Bytes of one adapter of `rank` targeting `modules` in every layer, in our fused layout
    (a projection that is touched stores all of its slices)."""
    shapes = module_shapes(config)
    fused = {TARGETS[m][0] for m in modules}
    per_layer = sum((len(FUSED_PROJECTIONS[f]) * shapes[FUSED_PROJECTIONS[f][0]][0]
                     + sum(shapes[p][1] for p in FUSED_PROJECTIONS[f])) * rank for f in fused)
    return per_layer * config.num_layers * torch.empty(0, dtype=dtype).element_size()


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """peft module -> (in_features, out_features) of the base model."""
    q, kv, h, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_peft_adapter(name: str, path: str | Path, config: ModelConfig, max_lora_rank: int,
                      dtype: torch.dtype = torch.float32, confined: bool = False) -> LoRAWeights:
    """`confined`: the folder came from a client (an adapter root): `path` must be absolute and
    free of symbolic links, and it is opened one component at a time without following any, its
    files as regular, singly linked files (no hard link to elsewhere), all through one
    directory handle, so a link swapped in after the caller's check cannot redirect the read."""
    folder = Path(path)
    fail = lambda reason: AdapterError(f"adapter {name!r} ({folder}): {reason}")  # noqa: E731
    try:
        with _Folder(folder, confined) as files:
            raw = _read_config(files, fail)
            _check_config(raw, max_lora_rank, fail)
            tensors = _read_weights(files, fail)
    except (FileNotFoundError, NotADirectoryError):
        raise fail("not a folder") from None
    except OSError as exc:  # a link loop, a name too long, a link where none may be
        raise fail(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    rank = int(raw["r"])
    alpha = float(raw.get("lora_alpha", rank))
    scaling = alpha / rank ** 0.5 if raw.get("use_rslora") else alpha / rank
    targets = _target_modules(raw.get("target_modules"), fail)
    layers = _layers(raw, config, fail)
    weights = _collect(tensors, targets, rank, config, fail)
    stray = sorted({layer for layer, _ in weights} - layers)
    if stray:
        raise fail(f"weights for layers {stray[:5]}, which layers_to_transform does not list")
    shapes = module_shapes(config)
    projections = _fuse(weights, rank, shapes, dtype)
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode())
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].contiguous().view(torch.uint8).numpy().tobytes())
    return LoRAWeights(name, str(folder), rank, scaling, frozenset(targets), projections, digest.hexdigest())


def _fuse(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], rank: int,
          shapes: dict[str, tuple[int, int]], dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Per-module A/B -> per fused projection A [n * r, in] and B transposed, Bt [r, out_total]
    (zeros where the adapter leaves a slice alone), all views of one buffer in the order a decode
    step reads them: each token streams its own adapter, and one contiguous stream per layer reads
    ~1.2x faster than separate allocations (TLB and hardware prefetch; benchmarks/multi_lora.py)."""
    layout = [(layer, fused, parts, fused_offsets(fused, shapes))  # the order a step reads them in
              for layer in sorted({layer for layer, _ in weights}) for fused, parts in FUSED_PROJECTIONS.items()
              if any((layer, part) in weights for part in parts)]
    buffer = torch.zeros(sum(rank * (len(parts) * shapes[parts[0]][0] + offsets[-1])
                             for _, _, parts, offsets in layout), dtype=dtype)
    out, at = {}, 0
    for layer, fused, parts, offsets in layout:
        present = [weights.get((layer, part)) for part in parts]
        a_size, b_size = len(parts) * rank * shapes[parts[0]][0], rank * offsets[-1]
        a = buffer[at:at + a_size].view(len(parts) * rank, shapes[parts[0]][0])
        b = buffer[at + a_size:at + a_size + b_size].view(rank, offsets[-1])
        at += a_size + b_size
        for i, pair in enumerate(present):
            if pair is not None:
                a[i * rank:(i + 1) * rank] = pair[0]
                b[:, offsets[i]:offsets[i + 1]] = pair[1].T
        out[(layer, fused)] = (a, b)
    return out


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


def _check_config(raw: dict, max_lora_rank: int, fail) -> None:
    if raw.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    if raw.get("use_dora"):
        raise fail("DoRA (use_dora=true) is not supported")
    if raw.get("modules_to_save"):
        raise fail(f"modules_to_save {raw['modules_to_save']} is not supported (full weights, not LoRA)")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise fail(f"bias={raw.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise fail(f"{key} (per-module ranks or alphas) is not supported")
    if raw.get("layers_pattern") not in (None, "layers", ["layers"]):
        raise fail(f"layers_pattern {raw['layers_pattern']!r} is not supported (only 'layers')")
    for key in ("layer_replication", "target_parameters", "trainable_token_indices"):
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


def _target_modules(value, fail) -> set[str]:
    if isinstance(value, str):  # peft: a regex matched against full module names
        if len(value) > 1024:
            raise fail("target_modules regex is longer than 1024 characters")
        try:  # the `regex` engine, with a time bound: a client's pattern may backtrack forever
            matched = {m for m in TARGETS if value == m or any(
                regex.fullmatch(value, f"model.layers.0.{block}.{m}", timeout=0.05) for block in ("self_attn", "mlp"))}
        except regex.error as exc:
            raise fail(f"target_modules regex is invalid ({exc})") from None
        except TimeoutError:
            raise fail("target_modules regex takes too long to match (catastrophic backtracking)") from None
        if not matched:
            raise fail(f"target_modules regex {value!r} matches none of {sorted(TARGETS)}")
        return matched
    if value in ("all-linear",):
        raise fail("target_modules='all-linear' includes lm_head, which is not supported; list the modules")
    if value is not None and (not isinstance(value, list) or not all(isinstance(m, str) for m in value)):
        raise fail(f"target_modules must be a list of module names or a regex, got {type(value).__name__}")
    modules = set(value or [])
    unknown = modules - set(TARGETS)
    if unknown:
        raise fail(f"unsupported target modules {sorted(unknown)}; supported: {sorted(TARGETS)}")
    if not modules:
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


def _load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def _load_bin(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _collect(tensors: dict[str, torch.Tensor], targets: set[str], rank: int, config: ModelConfig, fail):
    shapes = module_shapes(config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise fail(f"unexpected weight {key!r} (only LoRA A/B of {sorted(TARGETS)} are supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in targets:
            raise fail(f"weight {key!r} is for {module}, which target_modules does not list")
        if layer >= config.num_layers:
            raise fail(f"weight {key!r}: the base model has {config.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise fail(f"layer {layer} {module}: lora_A and lora_B must both be present")
        in_f, out_f = shapes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise fail(f"layer {layer} {module}: shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit the base "
                       f"model (expected A({rank}, {in_f}) B({out_f}, {rank})): wrong base model?")
        weights[(layer, module)] = (a.float(), b.float())
    if not weights:
        raise fail("no LoRA weights found")
    return weights
