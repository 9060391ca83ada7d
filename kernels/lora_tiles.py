"""How one fused projection's SGMV launches are tiled (`LoRATiles`), decided once when its stacked slots are made
(`sgmv.StackedLoRA.empty`) from the projection's shapes and the card's `LoRATune`; a step only fills in the grid's
batch-dependent sizes. Plain integers, no Triton: the CPU path imports this module too.

Split-K depends on the input width alone, never on the batch: a token's low-rank product is summed in the same
order whatever it is batched with, so --deterministic keeps split-K, and no split is ever empty.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_M = 16  # tokens per dot (tl.dot needs >= 16)


@dataclass(frozen=True)
class LoRATune:
    """A card's block sizes. Defaults reasoned from an H100 / H200 (132 SMs, 50 MB L2) for rank-16 adapters on
    4,096-14,336-wide projections; `benchmarks/gpu_kernels.py --tune-lora` times the candidates on a card and
    prints the entry to put in `TUNED`."""

    k_share: int = 512  # input features per split-K share, at least (a multiple of block_k)
    max_splits: int = 8  # at most this many shares: the expand sums them, so each costs it a read
    block_k: int = 128
    block_n: int = 128  # expand outputs per program
    tokens_per_program: int = 64  # a program loops over this many of its segment's tokens (decode: all of them)
    segment_programs: int = 32  # programs along the segment axis at most; past it a program loops over segments

    def __post_init__(self) -> None:
        """Tiles are powers of two (`tl.arange`) and shares whole K tiles: refused here, not at a GPU compile."""
        for name in ("block_k", "block_n", "tokens_per_program"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LoRATune.{name} must be a power of two >= 16, got {value}")
        if self.k_share < self.block_k or self.k_share % self.block_k:
            raise ValueError(f"LoRATune.k_share must be a multiple of block_k: {self}")
        if self.max_splits < 1 or self.segment_programs < 1:
            raise ValueError(f"LoRATune.max_splits and segment_programs must be >= 1: {self}")


DEFAULT_TUNE = LoRATune()
TUNED: dict[str, LoRATune] = {}  # a card's name (torch.cuda.get_device_name) -> its measured entry


def tune_for(device_name: str) -> LoRATune:
    """The entry measured on this card, else the defaults."""
    return TUNED.get(device_name, DEFAULT_TUNE)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, next_power_of_2(n)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LoRATiles:
    """One projection's launch shape: rank blocks (shrink), K shares (shrink: `split_k` shares of `k_share`
    features, whole `block_k` tiles, none empty), output blocks per slice (expand)."""

    num_slices: int
    block_r: int
    rank_blocks: int
    block_k: int
    k_share: int
    split_k: int
    block_n: int
    n_blocks: int
    expand_block_r: int
    tokens_per_program: int
    segment_programs: int

    @staticmethod
    def plan(in_features: int, offsets: list[int], max_rank: int, tune: LoRATune = DEFAULT_TUNE,
             split: bool = True) -> "LoRATiles":
        """`split` False: the whole K in one share (the raw entry points' two-dimensional output)."""
        widths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        block_r = block(max_rank)
        block_k = block(in_features, 16, tune.block_k)
        shares = min(tune.max_splits, max(1, in_features // tune.k_share)) if split else 1
        k_share = cdiv(cdiv(in_features, shares), block_k) * block_k
        block_n = block(max(widths), 16, tune.block_n)
        return LoRATiles(len(widths), block_r, cdiv(max_rank, block_r), block_k, k_share, cdiv(in_features, k_share),
                         block_n, cdiv(max(widths), block_n), block(max_rank, 16, 64), tune.tokens_per_program,
                         tune.segment_programs)

    def segment_columns(self, num_segments: int) -> int:
        """Programs along the segment axis: one per segment up to `segment_programs`."""
        return max(1, min(num_segments, self.segment_programs))

    def token_blocks(self, max_seg_len: int) -> tuple[int, int]:
        """(tokens per program, programs per segment) for a batch whose longest segment has `max_seg_len`
        tokens: a short segment (decode) is one program walking all its tokens, so each adapter's weights
        are read once per output block; a long one (prefill) is cut into blocks of `tokens_per_program`."""
        per = max(BLOCK_M, min(self.tokens_per_program, cdiv(max_seg_len, BLOCK_M) * BLOCK_M))
        return per, max(1, cdiv(max_seg_len, per))
