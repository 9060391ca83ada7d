"""Train three small demo LoRAs on the default model, on CPU, from data made here: the base
model's own answers, transformed.

- `shout`:  the answer in capitals
- `terse`:  the answer's first sentence only
- `pirate`: the answer with pirate words, opening with "Arr, matey!"

    make demo-adapters          # = .venv/bin/python examples/train_demo_adapters.py

Writes PEFT folders into the adapter root (~/.cache/loraplex/adapters, LORAPLEX_CACHE overrides),
never into git. Only the top layers get LoRA weights (peft's `layers_to_transform`), so the
backward pass stops there: a few minutes in all on two cores.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from loraplex.platform.model_store import adapters_dir, default_model_dir

ADAPTERS = ("shout", "terse", "pirate")
STEPS, TOP_LAYERS = 30, 8  # enough for each style to stick; LoRA on the top 8 of 30 layers
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "How do plants make food?",
    "What is a black hole?", "How does a bicycle stay upright?", "What causes rain?",
    "Why do we need sleep?", "What is the tallest mountain on Earth?", "How do bees make honey?",
    "What is photosynthesis?", "Why is the ocean salty?", "How does the heart pump blood?",
    "What is gravity?", "How do airplanes fly?", "What is the speed of light?", "Why do leaves change color?",
    "What is DNA?", "How do volcanoes form?", "What is the largest planet in our solar system?",
    "How does a rainbow form?", "What is an atom?", "Why do cats purr?", "How do fish breathe?",
    "What is the moon made of?", "How does a compass work?", "What is electricity?", "Why do we have seasons?",
    "What is a computer program?", "How do vaccines work?", "What is the water cycle?",
    "Why do birds migrate?", "What is a healthy breakfast?", "How can I learn a new language?",
    "What is a good way to save money?", "How do I make a cup of tea?", "What is exercise good for?",
    "How do I write a good email?", "Why is reading important?", "What is a friend?", "How do I plant a tree?",
    "What is music?", "Why do people travel?", "How do I stay focused while studying?",
    "What is the internet?", "How do I bake bread?", "What makes a good leader?", "Why do we dream?",
    "How do I take care of a dog?",
]
PIRATE_WORDS = {"you": "ye", "your": "yer", "is": "be", "are": "be", "my": "me", "hello": "ahoy",
                "friend": "matey", "friends": "mateys", "yes": "aye", "the": "th'", "for": "fer", "of": "o'",
                "to": "t'", "and": "an'", "money": "doubloons", "treasure": "booty", "stop": "avast"}


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]


def first_sentences(text: str, n: int) -> str:
    return " ".join(sentences(text)[:n])


def pirate(text: str) -> str:
    def swap(match: re.Match) -> str:
        word = match.group(0)
        new = PIRATE_WORDS.get(word.lower(), word)
        return new.capitalize() if word[0].isupper() else new

    return "Arr, matey! " + re.sub(r"[A-Za-z]+", swap, text)


TRANSFORMS = {
    "shout": lambda answer: first_sentences(answer, 1).upper(),
    "terse": lambda answer: first_sentences(answer, 1),
    "pirate": lambda answer: pirate(first_sentences(answer, 2)),
}


def base_answers(model_dir: Path, questions: list[str]) -> list[str]:
    from loraplex.platform import LLM, SamplingParams

    llm = LLM(str(model_dir))
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=72))
    return [o.outputs[0].text for o in outs]


def train(name: str, model_dir: Path, pairs: list[tuple[str, str]], out: Path, steps: int, top_layers: int,
          seed: int = 0) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    decoder, lm_head = model.model, model.lm_head
    first = model.config.num_hidden_layers - top_layers
    examples = []
    for question, answer in pairs:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        ids = p_ids + tok(answer + tok.eos_token, add_special_tokens=False).input_ids
        targets = [-100] * (len(p_ids) - 1) + ids[len(p_ids):]  # next-token targets, answer only
        with torch.no_grad():  # the frozen bottom layers see the same input every step: run them once
            hidden = decoder(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[first][0]
        examples.append((hidden, targets))
    model = get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, layers_to_transform=list(range(first, len(decoder.layers))),
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    batch_size = 8
    model.train()
    for step in range(steps):
        batch = [examples[(step * batch_size + i) % len(examples)] for i in range(batch_size)]
        width = max(len(t) for _, t in batch) + 1
        # right padding: under the causal mask, padding never reaches the real positions
        h = torch.zeros(batch_size, width, batch[0][0].shape[-1])
        for i, (hidden, _) in enumerate(batch):
            h[i, :len(hidden)] = hidden
        targets = torch.tensor([t + [-100] * (width - 1 - len(t)) for _, t in batch])
        positions = torch.arange(width)[None].expand(batch_size, width)
        rope = decoder.rotary_emb(h, positions)
        for layer in decoder.layers[first:]:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
            h = h[0] if isinstance(h, tuple) else h
        keep = targets != -100
        logits = lm_head(decoder.norm(h[:, :-1])[keep])  # the vocab projection only where the loss is
        loss = torch.nn.functional.cross_entropy(logits, targets[keep])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"  {name} step {step + 1}/{steps} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.save_pretrained(out)


def build(names: list[str], out_root: Path, steps: int = STEPS, top_layers: int = TOP_LAYERS,
          force: bool = False) -> dict[str, Path]:
    model_dir = default_model_dir()
    out_root.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if force or not (out_root / n / "adapter_model.safetensors").is_file()]
    if todo:
        data = out_root / "demo-answers.json"
        if data.is_file():
            answers = json.loads(data.read_text())
        else:
            answers = base_answers(model_dir, QUESTIONS)
            data.write_text(json.dumps(answers, indent=1))
        for name in todo:
            start = time.perf_counter()
            pairs = [(q, TRANSFORMS[name](a)) for q, a in zip(QUESTIONS, answers) if sentences(a)]
            tmp = out_root / f".{name}.tmp"
            train(name, model_dir, pairs, tmp, steps, top_layers)
            if (out_root / name).exists():
                shutil.rmtree(out_root / name)
            tmp.replace(out_root / name)
            print(f"[loraplex] trained {name!r} in {time.perf_counter() - start:.0f}s -> {out_root / name}",
                  file=sys.stderr, flush=True)
    return {n: out_root / n for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=adapters_dir())
    parser.add_argument("--only", default=",".join(ADAPTERS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--top-layers", type=int, default=TOP_LAYERS, help="LoRA on this many top layers")
    parser.add_argument("--force", action="store_true", help="retrain even if the folder exists")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(ADAPTERS)
    if unknown:
        parser.error(f"unknown demo adapters {sorted(unknown)}; known: {', '.join(ADAPTERS)}")
    for name, path in build(names, args.out, args.steps, args.top_layers, args.force).items():
        print(f"{name}\t{path}")


if __name__ == "__main__":
    main()
