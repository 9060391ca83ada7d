"""What tensor parallelism at TP=2 communicates per step, timed over torch.distributed gloo on this CPU (or, with
`--all-reduce shm`, the all-reduces through the engine's shared-memory kernel, as its CPU workers run them).

A TP step of a Llama-like model all-reduces [T, hidden] twice per layer (after the attention output projection and
after the MLP down projection) and once after the vocabulary-parallel embedding, then all-gathers the logits
[R, vocab / 2] of every rank (R = rows sampled: one per sequence in decode). Two spawned processes, one torch thread
each, time for every T: (a) one all-reduce of [T, hidden] (median and mean of `--repeats` after a warm-up), the
all-gather alone, and (b) a whole step's communication, 2 * layers + 1 all-reduces plus that all-gather with
R = min(T, 64) (median of `--repeats / 10` steps). Bytes are each rank's payload; a 2-rank ring all-reduce sends
and receives that many bytes per rank.

    .venv/bin/python benchmarks/tp_allreduce.py --json /tmp/tp_allreduce.json [--all-reduce shm]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
MAX_DECODE_ROWS = 64
WARMUP = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    """/proc/cpuinfo's model name, logical CPUs, and the widest vector ISA (the BENCHMARKS.md machine names)."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{names[0] if names else 'unknown CPU'}, {len(names)} logical CPUs, {isa}"


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after a warm-up; the collectives keep both ranks in step."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def step_comm(x: torch.Tensor, logits: torch.Tensor, gathered: list[torch.Tensor], all_reduces: int,
              all_reduce) -> None:
    """One TP step's collectives: the layers' and the embedding's all-reduces, then the logits' all-gather."""
    for _ in range(all_reduces):
        all_reduce(x)
    dist.all_gather(gathered, logits)


def measure(tokens: int, args: argparse.Namespace) -> dict:
    rows, all_reduces = min(tokens, MAX_DECODE_ROWS), 2 * args.layers + 1
    x = torch.zeros(tokens, args.hidden)
    logits = torch.zeros(rows, args.vocab // WORLD)
    gathered = [torch.empty_like(logits) for _ in range(WORLD)]
    reduce = all_reduce_fn(args.all_reduce)
    one = timed(lambda: reduce(x), args.repeats)
    gather = timed(lambda: dist.all_gather(gathered, logits), max(3, args.repeats // 10))
    step = timed(lambda: step_comm(x, logits, gathered, all_reduces, reduce), max(3, args.repeats // 10))
    all_reduce_bytes = x.numel() * x.element_size()
    gather_bytes = logits.numel() * logits.element_size()
    return {
        "T": tokens, "R": rows, "all_reduces_per_step": all_reduces,
        "all_reduce_bytes": all_reduce_bytes, "all_reduce_us": statistics.median(one) * 1e6,
        "all_reduce_mean_us": statistics.mean(one) * 1e6,
        "all_reduce_GBps": all_reduce_bytes / statistics.median(one) / 1e9,
        "all_gather_bytes_per_rank": gather_bytes, "all_gather_ms": statistics.median(gather) * 1e3,
        "step_bytes": all_reduces * all_reduce_bytes + gather_bytes, "step_ms": statistics.median(step) * 1e3,
    }


def all_reduce_fn(kind: str):
    """gloo's all-reduce, or the engine's (`platform/distributed.py`: shared memory once `use_shared_memory` ran)."""
    if kind == "gloo":
        return dist.all_reduce
    from loraplex.platform.distributed import all_reduce

    return all_reduce


def worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    if args.all_reduce == "shm":
        from loraplex.platform.distributed import use_shared_memory

        use_shared_memory(f"loraplex-bench-{port}", rank, WORLD)
    try:
        rows = [measure(t, args) for t in args.sizes]
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(worker, args=(free_port(), args, results), nprocs=WORLD, join=True)  # raises if a rank failed
    return results.get()  # a few rows: they fit the pipe, so rank 0 exits before this read


def table(rows: list[dict]) -> str:
    lines = ["| T | R | all-reduce [T, h] | us median / mean | GB/s (median) | all-gather [R, v/2] | ms median | "
             "step = all-reduces + all-gather | step MiB per rank | step ms (median) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['R']} | {r['all_reduce_bytes'] / 1024:.1f} KiB | "
                     f"{r['all_reduce_us']:.0f} / {r['all_reduce_mean_us']:.0f} | {r['all_reduce_GBps']:.2f} | "
                     f"{r['all_gather_bytes_per_rank'] / 1024:.0f} KiB | {r['all_gather_ms']:.2f} | "
                     f"{r['all_reduces_per_step']} x [{r['T']}, h] + [{r['R']}, v/2] | "
                     f"{r['step_bytes'] / 2**20:.2f} | {r['step_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 256, 2048],
                        help="token counts T, comma-separated")
    parser.add_argument("--repeats", type=int, default=200,
                        help="timed all-reduces per T (all-gathers and steps: repeats / 10)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--json", metavar="OUT", help="write the results here")
    parser.add_argument("--all-reduce", choices=["gloo", "shm"], default="gloo",
                        help="the all-reduces over gloo, or through the engine's shared-memory kernel")
    args = parser.parse_args()
    rows = run(args)
    meta = {"cpu": cpu_model(), "torch": torch.__version__, "backend": args.all_reduce, "world_size": WORLD,
            "threads_per_rank": 1, "dtype": "float32", "hidden": args.hidden, "layers": args.layers,
            "vocab": args.vocab, "repeats": args.repeats}
    print(f"TP={WORLD}, all-reduce over {args.all_reduce} (all-gather over gloo), {meta['cpu']}, torch {meta['torch']}, float32, "
          f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; R = min(T, {MAX_DECODE_ROWS})")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
