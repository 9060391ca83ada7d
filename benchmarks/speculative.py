"""Speculative decoding (n-gram prompt lookup + grammar-forced drafts) vs the same engine without it, in ONE run.

    python benchmarks/speculative.py [--num-speculative-tokens 4,6,8] [--repeats 3] [--threads 1] [--json out.json]
    python benchmarks/speculative.py --quick           # smoke run: 2 documents / questions, 64 tokens, 1 repeat

Two (or more) engines on the default model (or --model), in the engine's default dtype (--dtype auto: on an
AVX2 CPU float32 weights on plain rows), identical but for `speculative_config`: the baseline
without it, one engine per k in --num-speculative-tokens with {"method": "ngram", "num_speculative_tokens": k, ...}.
Prefix caching is off on every engine (each run pays its own prefill, so no side finds its prompts cached), each
engine is warmed with the same short requests (the schema compiled), and every request (batch) runs on every engine
in turn, the order alternating, so load from elsewhere on the machine falls on both sides alike.
Workloads, each through `llm.chat`:

- copy-heavy, batch 1: "repeat this document" and "extract the facts of this document", greedy;
- JSON extraction, batch 1: a JSON Schema whose fields are copied from the document, greedy;
- open chat, batch 1: open questions (little to copy), greedy and temperature 0.8 with a seed;
- mixed batch of 16: the prompts above mixed, submitted together in one call.

Per workload: output tokens/s off and on (median over --repeats), on/off, the acceptance rate (accepted / draft
tokens) and mean acceptance length (1 + accepted / drafts) from the drafter's counters over that workload, the
decode-only ratio at batch 1 (the first token and the first step, a lone request's prefill, left out: what drafting
can speed up), engine steps per side (the off side's jump-forward tokens, appended without a step, in brackets), and
whether the greedy outputs are token for token the same on both sides (where the dtype resolves to float32 a
difference is printed and the exit status is 1; in bfloat16 differences are counted, as near-ties may part).
Targets (the issue): copy-heavy and JSON at batch 1 >= 2x, open chat >= 0.95x, mixed batch of 16 >= 0.95x.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform as host
import statistics
import subprocess
import sys
import time

import torch

from loraplex.grammar.backend import StructuredOutputs
from loraplex.platform import LLM, SamplingParams

log = logging.getLogger("speculative-bench")

DOCUMENTS = [
    ("museum", "The Harbor Museum of Maritime History in Port Calloway reopened on 14 March 2023 after a renovation "
     "that lasted three years and cost 42 million dollars. The museum, founded in 1911 by the shipbuilder Agnes "
     "Whitcombe, holds more than 18,000 objects, including the restored steam tug Marigold, a collection of 600 "
     "ship models and the logbooks of the clipper Northern Star. The renovation was led by the architect Daniel "
     "Okafor, whose firm replaced the leaking glass roof, added a second floor for temporary exhibitions and built "
     "a new entrance facing the waterfront. Director Lucia Fernandes said the museum expects 250,000 visitors in its "
     "first year, almost twice the number it received before it closed. Admission is free for children under 12 and "
     "costs 15 dollars for adults. The first temporary exhibition, Lighthouses of the North Atlantic, runs until 30 "
     "September and includes the original lens of the Cape Morrow lighthouse, which weighs four tonnes. The museum "
     "is open every day except Monday from 10 am to 6 pm, and on Thursdays until 9 pm."),
    ("release", "Version 3.2 of the Quillstone data library was released on 2 February 2024 by its maintainers at the "
     "Tern Lake Software Foundation. The release adds a streaming reader for Parquet files that uses about 60 percent "
     "less memory than the previous reader, a new function called merge_sorted that joins two sorted tables without "
     "loading them fully, and support for Python 3.12. The default compression for written files changes from gzip "
     "to zstd, which the maintainers say makes files 20 percent smaller and writing three times faster. The old "
     "function read_all is deprecated and will be removed in version 4.0, planned for early 2025. Lead maintainer "
     "Priya Raman thanked 47 contributors, among them Tomas Lindqvist, who wrote most of the streaming reader. The "
     "library is distributed under the Apache 2.0 license and can be installed with pip install quillstone. Users "
     "of version 3.1 should read the migration guide before upgrading, because the timestamp type now stores time "
     "zones by default, and code that compares naive timestamps may raise an error."),
    ("bakery", "Rye and Ember is a bakery cooperative in Lowfield, a town of 30,000 people in the north of Scotland. "
     "It was started in 2016 by four bakers, Morag Lennox, Sam Achebe, Ines Duarte and Callum Reid, who each own an "
     "equal share. The cooperative now employs 23 people and runs two shops and a market stall, and it supplies bread "
     "to nine schools and the Lowfield hospital. Its best known product is a sourdough rye loaf made with flour from "
     "the Braeside mill, 12 miles away. In 2022 the bakery had a turnover of 1.4 million pounds and gave 5 percent of "
     "its profit to the town's food bank. Every member of staff who has worked there for a year may become a member "
     "of the cooperative and vote on its decisions. In 2023 the bakery installed a wood-fired oven built from local "
     "stone, which bakes 400 loaves a day, and it plans to open a baking school in the spring of 2025."),
    ("survey", "The Kestrel Moor bird survey was carried out between 1 May and 15 July 2023 by a team of eleven "
     "volunteers led by the ecologist Hannah Brightwater of the Upland Wildlife Trust. The team walked 14 fixed "
     "routes across the moor every week and recorded 61 species, four more than in the last survey in 2018. The "
     "most common breeding bird was the meadow pipit, with an estimated 320 pairs, followed by the skylark with 140 "
     "pairs. The survey found 9 pairs of golden plover, up from 5 pairs in 2018, and the first breeding curlews on "
     "the moor since 2009. The number of red grouse fell by about a third, which the report links to the wet spring "
     "and to a tick-borne disease. The report recommends keeping the ban on heather burning in the northern valley, "
     "restoring 200 hectares of drained peat bog, and repeating the survey every three years instead of every five. "
     "The full report, 86 pages long, is published on the trust's website."),
]

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "date", "organization", "people", "numbers", "first_sentence"],
          "properties": {"title": {"type": "string", "maxLength": 80},
                         "date": {"type": "string", "maxLength": 40},
                         "organization": {"type": "string", "maxLength": 80},
                         "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
                         "numbers": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 4},
                         "first_sentence": {"type": "string", "maxLength": 400}}}

QUESTIONS = ["What are some good ways for an adult to start learning to play the guitar?",
             "Why do cats purr? Give a few possible explanations.",
             "Write a short story about a robot that wants to become a gardener.",
             "What should someone think about when deciding whether to rent or buy a home?"]

TARGETS = {"copy": 2.0, "json": 2.0, "chat": 0.95, "chat-t0.8": 0.95, "mixed16": 0.95}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def copy_requests(docs, max_tokens: int) -> list[tuple[list[dict], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = []
    for _, doc in docs:
        out.append((user(f"Repeat the following document word for word.\n\n{doc}"), greedy))
        out.append((user(f"Extract the facts from this document as a list of short sentences, reusing its "
                         f"wording.\n\n{doc}"), greedy))
    return out


def json_requests(docs, max_tokens: int) -> list[tuple[list[dict], SamplingParams]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=StructuredOutputs(json=SCHEMA))
    return [(user(f"Extract from this document, as JSON, its title, date, organization, people, the numbers it "
                  f"gives and its first sentence, copied exactly.\n\n{doc}"), params) for _, doc in docs]


def chat_requests(questions, max_tokens: int, temperature: float) -> list[tuple[list[dict], SamplingParams]]:
    return [(user(q), SamplingParams(temperature=temperature, seed=1000 + i if temperature else None,
                                     max_tokens=max_tokens)) for i, q in enumerate(questions)]


def workloads(args) -> dict[str, dict]:
    """name -> {"batches": [[(messages, params), ...], ...], "greedy": bool}; a batch goes in one `llm.chat`."""
    docs = DOCUMENTS[:2] if args.quick else DOCUMENTS
    questions = QUESTIONS[:2] if args.quick else QUESTIONS
    n = args.max_tokens
    copy, extract = copy_requests(docs, n), json_requests(docs, n)
    chat, hot = chat_requests(questions, n, 0.0), chat_requests(questions, n, 0.8)
    pool = copy_requests(DOCUMENTS, n) + json_requests(DOCUMENTS, n) + chat_requests(QUESTIONS, n, 0.0)
    mixed = [pool[(5 * i) % len(pool)] for i in range(args.mixed_batch)]  # 5 is prime to the pool's 16: all kinds
    return {"copy": {"batches": [[r] for r in copy], "greedy": True, "label": "copy-heavy (repeat / extract), b=1"},
            "json": {"batches": [[r] for r in extract], "greedy": True, "label": "JSON extraction (schema), b=1"},
            "chat": {"batches": [[r] for r in chat], "greedy": True, "label": "open chat greedy, b=1"},
            "chat-t0.8": {"batches": [[r] for r in hot], "greedy": False, "label": "open chat T=0.8 seeded, b=1"},
            "mixed16": {"batches": [mixed], "greedy": all(p.temperature == 0 for _, p in mixed),
                        "label": f"mixed batch of {args.mixed_batch}"}}


def time_steps(llm: LLM) -> list[float]:
    """Wraps the engine's `step` to record each step's seconds (the list returned; `run` clears it)."""
    real, times = llm.engine.step, []

    def step():
        start = time.perf_counter()
        out = real()
        times.append(time.perf_counter() - start)
        return out

    llm.engine.step = step
    return times


def run(llm: LLM, batch, steps: list[float]) -> dict:
    """One `llm.chat` call: output tokens, seconds, the first step's seconds (a lone request's prefill), steps,
    every output's token ids, the drafter's [drafts, draft tokens, accepted] and the jump-forward tokens spent."""
    drafter = llm.engine.core.drafter
    before = drafter.counters.copy()
    jumped = drafter.num_jump_forward_tokens
    steps.clear()
    start = time.perf_counter()
    outs = llm.chat([m for m, _ in batch], [p for _, p in batch])
    seconds = time.perf_counter() - start
    outputs = [list(out.outputs[0].token_ids) for out in outs]
    spent = [0, 0, 0]
    if drafter.config is not None:
        after = drafter.counters
        spent = [after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                 after.num_accepted_tokens - before.num_accepted_tokens]
    return {"tokens": sum(map(len, outputs)), "seconds": seconds, "first_step": steps[0] if steps else 0.0,
            "steps": len(steps), "outputs": outputs, "spent": spent,
            "jumped": drafter.num_jump_forward_tokens - jumped}


def run_workload(engines: dict[str, LLM], steps: dict[str, list[float]], batches, flip: bool) -> dict[str, dict]:
    """Every batch on every engine in turn (the order reversed on every other batch and when `flip`), so a burst
    of load from elsewhere on the machine falls on both sides alike; `run`'s numbers added up per engine."""
    totals = {name: {"tokens": 0, "seconds": 0.0, "first_step": 0.0, "steps": 0, "outputs": [], "spent": [0, 0, 0],
                     "jumped": 0} for name in engines}
    order = list(engines)
    for i, batch in enumerate(batches):
        for name in (order[::-1] if (i % 2 == 1) != flip else order):
            got, t = run(engines[name], batch, steps[name]), totals[name]
            for key in ("tokens", "seconds", "first_step", "steps", "outputs", "jumped"):
                t[key] += got[key]
            t["spent"] = [a + b for a, b in zip(t["spent"], got["spent"])]
    return totals


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in text.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host.processor() or "unknown"


def code_version() -> str:
    """HEAD, and "+dirty" with the engine's files changed since (a run loads them once, at its start)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "platform", "kernels", "grammar"], capture_output=True,
                               text=True, check=False).stdout.split("\n")
    except OSError:
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    return head + (f"+dirty({', '.join(changed)})" if changed else "") if head else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: the engine's default (on an AVX2 CPU float32 on plain rows); greedy outputs "
                             "must be identical where it resolves to float32")
    parser.add_argument("--num-speculative-tokens", default="4",
                        help="k, or several comma-separated (one speculative engine each, same baseline): 4,6,8")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="the drafter's batch gate (default: the engine's)")
    parser.add_argument("--min-acceptance", type=float, default=None,
                        help="a request's acceptance below which its n-gram drafts pause (default: the engine's)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--mixed-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="copy,json,chat,chat-t0.8,mixed16")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 documents / questions, 64 tokens, 1 repeat")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a machine shared with other work")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.quick:
        args.max_tokens, args.repeats = min(args.max_tokens, 64), 1
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    chosen = args.workloads.split(",")
    loads = {name: w for name, w in workloads(args).items() if name in chosen}

    common = dict(dtype=args.dtype, max_model_len=2048, max_num_seqs=max(16, args.mixed_batch),
                  enable_prefix_caching=False)  # no side ever finds its prompts cached
    engines: dict[str, LLM] = {"off": LLM(args.model, **common)}
    for k in ks:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min}
        if args.disable_by_batch_size is not None:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
        if args.min_acceptance is not None:
            spec["min_acceptance"] = args.min_acceptance
        engines[f"k={k}"] = LLM(args.model, speculative_config=json.dumps(spec), **common)
    spec_config = engines[f"k={ks[0]}"].engine.core.drafter.config
    spec_gate = spec_config.disable_by_batch_size
    cpu, code = cpu_name(), code_version()
    resolved = engines["off"].engine.config
    exact = resolved.dtype == "float32"  # in bfloat16 a verify pass sums in another order: near-ties may part
    layout = ("packed" if resolved.pack_weights else "plain rows") if exact else "dense"  # float32's two layouts
    header = (f"model={resolved.model} dtype={args.dtype} -> {resolved.dtype} ({layout}) max_tokens={args.max_tokens} "
              f"repeats={args.repeats} threads={torch.get_num_threads()} prompt_lookup={args.prompt_lookup_min}.."
              f"{args.prompt_lookup_max} disable_by_batch_size={spec_gate} min_acceptance={spec_config.min_acceptance} "
              f"prefix_caching=off cpu={cpu} code={code}")
    log.info(header)

    warm = [(user("Repeat this: the quick brown fox jumps over the lazy dog, twice."),
             SamplingParams(temperature=0.0, max_tokens=24)),
            (user(f"As JSON: {DOCUMENTS[0][1][:200]}"),
             SamplingParams(temperature=0.0, max_tokens=24, structured=StructuredOutputs(json=SCHEMA)))]
    steps = {name: time_steps(llm) for name, llm in engines.items()}
    for name, llm in engines.items():  # the same warm-up on every side: kernels, the tokenizer scan, the schema
        for request in warm:
            run(llm, [request], steps[name])
        run(llm, warm, steps[name])

    results: dict[str, dict] = {w: {e: {"tps": [], "decode_tps": [], "tokens": [], "steps": [], "jumped": [],
                                        "spent": [0, 0, 0]} for e in engines} for w in loads}
    mismatches: list[str] = []
    sampled_diff: dict[str, dict[str, int]] = {w: {e: 0 for e in engines if e != "off"} for w in loads}
    tokenizer = engines["off"].get_tokenizer()
    for rep in range(args.repeats):
        for wname, load in loads.items():
            totals = run_workload(engines, steps, load["batches"], flip=rep % 2 == 1)
            alone = all(len(b) == 1 for b in load["batches"])  # a lone request's first step is its prefill
            for ename, t in totals.items():
                r = results[wname][ename]
                r["tps"].append(t["tokens"] / t["seconds"])
                if alone:  # the first token (the prefill's) and its step left out
                    r["decode_tps"].append((t["tokens"] - len(load["batches"])) / (t["seconds"] - t["first_step"]))
                for key in ("tokens", "steps", "jumped"):
                    r[key].append(t[key])
                r["spent"] = [a + b for a, b in zip(r["spent"], t["spent"])]
                log.info("repeat %d %-10s %-5s %5d tokens %6.2f s (prefill %5.2f s) %7.1f tok/s steps=%d jumped=%d "
                         "drafts=%d draft_tokens=%d accepted=%d", rep, wname, ename, t["tokens"], t["seconds"],
                         t["first_step"] if alone else float("nan"), t["tokens"] / t["seconds"], t["steps"],
                         t["jumped"], *t["spent"])
            base = totals["off"]["outputs"]
            for ename in engines:
                if ename == "off":
                    continue
                mine = totals[ename]["outputs"]
                differ = [i for i, (a, b) in enumerate(zip(base, mine)) if a != b]
                if not load["greedy"] or not exact:
                    sampled_diff[wname][ename] += len(differ)
                    continue
                for i in differ:
                    a, b = base[i], mine[i]
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    msg = (f"GREEDY MISMATCH: workload {wname} repeat {rep} request {i} {ename}: first "
                           f"difference at output token {at} (off {len(a)} tokens, on {len(b)})")
                    mismatches.append(msg)
                    log.error("!!! %s\n    off: %r\n    on:  %r", msg, tokenizer.decode(a[max(0, at - 8):at + 8]),
                              tokenizer.decode(b[max(0, at - 8):at + 8]))

    rows = []
    for wname, load in loads.items():
        base = results[wname]["off"]
        off = statistics.median(base["tps"])
        off_decode = statistics.median(base["decode_tps"]) if base["decode_tps"] else None
        for ename in engines:
            if ename == "off":
                continue
            r = results[wname][ename]
            on = statistics.median(r["tps"])
            on_decode = statistics.median(r["decode_tps"]) if r["decode_tps"] else None
            drafts, draft_tokens, accepted = r["spent"]
            if load["greedy"] and exact:
                same = "DIFFER" if any(f"workload {wname} " in m and f" {ename}:" in m for m in mismatches) \
                    else "identical"
            else:
                why = "sampled" if not load["greedy"] else resolved.dtype
                same = f"{sampled_diff[wname][ename]} differ ({why})" if sampled_diff[wname][ename] \
                    else f"identical ({why})"
            rows.append({"workload": wname, "label": load["label"], "engine": ename,
                         "requests": sum(len(b) for b in load["batches"]),
                         "tokens": statistics.median(r["tokens"]), "off_tps": off, "on_tps": on, "ratio": on / off,
                         "off_tps_runs": base["tps"], "on_tps_runs": r["tps"],
                         "off_decode_tps": off_decode, "on_decode_tps": on_decode,
                         "decode_ratio": on_decode / off_decode if on_decode else None,
                         "off_steps": statistics.median(base["steps"]), "on_steps": statistics.median(r["steps"]),
                         "off_jump_forward_tokens": statistics.median(base["jumped"]),
                         "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                         "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                         "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                         "outputs": same, "target": TARGETS.get(wname),
                         "met": on / off >= TARGETS[wname] if wname in TARGETS else None})

    print()
    print(header)
    print()
    print("| workload | spec | requests | tokens | off tok/s | on tok/s | on/off (runs) | decode only on/off "
          "| steps off / on | acceptance | mean acc. len | outputs | target |")
    print("|---|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---|")
    for row in rows:
        runs = " ".join(f"{a / b:.2f}" for a, b in zip(row["on_tps_runs"], row["off_tps_runs"]))
        acc = f"{row['acceptance_rate']:.2f}" if row["acceptance_rate"] is not None else "-"
        length = f"{row['mean_acceptance_length']:.2f}" if row["mean_acceptance_length"] is not None else "-"
        target = f">= {row['target']}x {'met' if row['met'] else 'MISSED'}" if row["target"] else ""
        decode = (f"{row['off_decode_tps']:.1f} / {row['on_decode_tps']:.1f} = {row['decode_ratio']:.2f}x"
                  if row["decode_ratio"] else "-")
        jumped = f" ({row['off_jump_forward_tokens']} jumped)" if row["off_jump_forward_tokens"] else ""
        print(f"| {row['label']} | {row['engine']} | {row['requests']} | {row['tokens']} | {row['off_tps']:.1f} "
              f"| {row['on_tps']:.1f} | **{row['ratio']:.2f}x** ({runs}) | {decode} "
              f"| {row['off_steps']}{jumped} / {row['on_steps']} | {acc} | {length} | {row['outputs']} | {target} |")
    if len(ks) > 1:
        print()
        for ename in (e for e in engines if e != "off"):
            mine = [r for r in rows if r["engine"] == ename and r["target"]]
            print(f"{ename}: {sum(r['met'] for r in mine)}/{len(mine)} targets met; "
                  + ", ".join(f"{r['workload']} {r['ratio']:.2f}x" for r in mine))
    if mismatches:
        print()
        print(f"!!! {len(mismatches)} GREEDY OUTPUT(S) DIFFER between speculation on and off:")
        for m in mismatches:
            print(f"!!!   {m}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"model": resolved.model, "dtype": args.dtype, "resolved_dtype": resolved.dtype,
                                  "weights": layout, "cpu": cpu,
                                  "python": sys.version.split()[0], "torch": torch.__version__,
                                  "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                                  "repeats": args.repeats, "num_speculative_tokens": ks,
                                  "prompt_lookup_max": args.prompt_lookup_max,
                                  "prompt_lookup_min": args.prompt_lookup_min, "disable_by_batch_size": spec_gate,
                                  "min_acceptance": spec_config.min_acceptance, "code": code,
                                  "quick": args.quick},
                       "rows": rows, "greedy_mismatches": mismatches}, f, indent=2)
        log.info("wrote %s", args.json)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
