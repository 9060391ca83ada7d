"""A small random LoRA adapter for the default model, made with peft, for the examples to load
when no trained adapter is around (`make demo-adapters` trains real ones)."""

from __future__ import annotations

from pathlib import Path

from loraplex.platform.model_store import adapters_dir, default_model_dir

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ensure_example_adapter(name: str = "example-random", seed: int = 0, rank: int = 8) -> Path:
    """The adapter's folder under the adapter root, created on first use."""
    folder = adapters_dir() / name
    if (folder / "adapter_config.json").is_file():
        return folder
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS,
                                            init_lora_weights=False))
    with torch.no_grad():  # small enough to keep the model fluent, large enough to change its words
        for pname, param in model.named_parameters():
            if "lora_B" in pname:
                param.mul_(0.3)
    model.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(ensure_example_adapter())
