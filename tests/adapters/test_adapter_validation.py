"""Every tensor of an adapter file is checked once, whatever its key's spelling: the same tensor
under two spellings is refused naming both keys, and NaN / infinite weights are refused naming
the tensor and how many values are bad."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.peft_format import AdapterError, read_peft_adapter, tensor_name
from loraplex.platform.models.registry import read_model_config


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return read_model_config(tiny_model_dir)


def edited(src, dst, change):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def some_key(tensors, part: str) -> str:
    return next(k for k in sorted(tensors) if part in k)


def test_spellings_of_one_tensor_name_it_alike():
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert {tensor_name(k) for k in (key, key.removeprefix("base_model.model."), key.removesuffix(".weight"),
                                     key.replace("lora_A.weight", "lora_A.default.weight"))} == \
        {"model.layers.0.self_attn.q_proj.lora_A"}
    assert tensor_name("base_model.model.lm_head.modules_to_save.default.weight") == tensor_name("lm_head.weight")
    assert tensor_name("lm_head.base_layer.weight") != tensor_name("lm_head.weight")


@pytest.mark.parametrize("spelling", [
    lambda key: key.removeprefix("base_model.model."),
    lambda key: key.replace(".lora_A.weight", ".lora_A.default.weight"),
])
@pytest.mark.parametrize("zero_dim", [True, False])
def test_one_tensor_under_two_spellings_is_refused_naming_both(config, tiny_adapters, tmp_path, spelling, zero_dim):
    def duplicate(tensors):
        key = some_key(tensors, "k_proj.lora_A")
        tensors[spelling(key)] = torch.tensor(1.0) if zero_dim else tensors[key].clone()

    folder = edited(tiny_adapters[1], tmp_path / "dup", duplicate)
    with pytest.raises(AdapterError, match="two spellings") as err:
        read_peft_adapter("dup", folder, config, 16)
    named = re.findall(r"'([^']+)'", str(err.value))
    assert len({k for k in named if "k_proj.lora_A" in k}) == 2 and "'dup'" in str(err.value)


@pytest.mark.parametrize("bad,counts", [(float("nan"), "2 NaN and 0 infinite"),
                                        (float("-inf"), "0 NaN and 2 infinite")])
def test_non_finite_weights_are_refused_by_name_and_count(config, tiny_adapters, tmp_path, bad, counts):
    key = some_key(load_file(tiny_adapters[1] / "adapter_model.safetensors"), "o_proj.lora_B")

    def spoil(tensors):
        tensors[key][0, 0] = tensors[key][3, 1] = bad

    folder = edited(tiny_adapters[1], tmp_path / "bad", spoil)
    with pytest.raises(AdapterError, match=re.escape(f"weight {key!r} has {counts} values")):
        read_peft_adapter("bad", folder, config, 16)


def test_a_clean_adapter_still_loads_with_the_same_hash(config, tiny_adapters, tmp_path):
    folder = edited(tiny_adapters[1], tmp_path / "same", lambda tensors: None)
    assert read_peft_adapter("x", folder, config, 16).content_hash == \
        read_peft_adapter("y", tiny_adapters[1], config, 16).content_hash
