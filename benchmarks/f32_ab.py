"""Two builds of our C library side by side: `f32_matmul` over one decode step's 120 projections, in one process.

    python benchmarks/f32_ab.py OLD.so NEW.so [--tokens 1 2 3 5 9 17] [--threads 2] [--rounds 9]

A change to the float32 kernel moves its time by less than the run-to-run spread of `projections.py` on a shared
machine, so the two builds are loaded into one process (ctypes) and take turns, the order alternating every round,
on the same weights (the default model's shapes, 30 layers' own: out of cache, as in the engine). Builds live in
the kernel cache (`~/.cache/loraplex/kernels/cpu_kernels-<key>.so`, one per source digest): import the kernels once
with the old sources (`git stash`), once with the new, and pass both files. Prints the median ms per step of each and
new / old.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LAYERS = 30


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.f32_matmul.restype = ctypes.c_int
    lib.f32_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
    return lib


def step(lib: ctypes.CDLL, weights: list[torch.Tensor], tokens: int) -> Callable[[], None]:
    """One decode step's projections at `tokens` tokens through `lib` (a callable)."""
    x = {k: torch.randn(tokens, k) for k in {k for _, k in SHAPES}}
    out = {n: torch.empty(tokens, n) for n in {n for n, _ in SHAPES}}

    def run() -> None:
        for w in weights:
            n, k = w.shape
            if lib.f32_matmul(x[k].data_ptr(), tokens, k, w.data_ptr(), n, out[n].data_ptr()):
                raise RuntimeError("f32_matmul refused its arguments")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (set OMP_NUM_THREADS to match)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    old, new = load(args.old), load(args.new)
    weights = [torch.randn(n, k) * k ** -0.5 for _ in range(LAYERS) for n, k in SHAPES]
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} torch threads={torch.get_num_threads()} "
          f"old={args.old} new={args.new}")
    print("| tokens | old ms | new ms | new / old |\n| --- | --- | --- | --- |")
    for tokens in args.tokens:
        runs = {"old": step(old, weights, tokens), "new": step(new, weights, tokens)}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.rounds):
            for name in ("old", "new") if i % 2 else ("new", "old"):
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        a, b = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {tokens} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
