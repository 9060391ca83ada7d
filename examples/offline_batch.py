"""An offline batch through `LLM`: one prompt per row, each with its own adapter (None = base),
all in the same batches, and one JSON-schema-constrained row. No server involved.

    .venv/bin/python examples/offline_batch.py
"""

from __future__ import annotations

from example_adapter import ensure_example_adapter

from loraplex.platform import LLM, SamplingParams, StructuredOutputs

llm = LLM(lora_modules={"example": str(ensure_example_adapter())}, max_loras=2)
tok = llm.get_tokenizer()
questions = ["What is the capital of France?", "Name a primary color.", "What is 3 + 4?"]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
           for q in questions]
rows = [(p, a) for p in prompts for a in (None, "example")]
params = SamplingParams(temperature=0, max_tokens=32)
outs = llm.generate([p for p, _ in rows], params, adapter=[a for _, a in rows])
for (prompt, adapter), out in zip(rows, outs):
    print(f"[{adapter or 'base'}] {out.outputs[0].text.strip()!r}")

schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
json_params = SamplingParams(temperature=0, max_tokens=32, structured=StructuredOutputs(json=schema))
print(llm.generate(prompts[2], json_params)[0].outputs[0].text)
