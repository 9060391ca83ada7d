"""Every refusal names the adapter and the reason; a good folder loads with a content hash."""

import json
import shutil

import pytest
import torch

from conftest import make_peft_adapter, make_tiny_model
from loraplex.adapters.peft_format import AdapterError, adapter_bytes, read_peft_adapter
from loraplex.platform.models.family import FUSED_PROJECTIONS
from loraplex.platform.models.registry import read_model_config


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return read_model_config(tiny_model_dir)


@pytest.fixture
def adapter(tiny_adapters, tmp_path):
    folder = tmp_path / "ad"
    shutil.copytree(tiny_adapters[1], folder)  # rank 8
    return folder


def edit_config(folder, **changes):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def test_an_adapters_weights_lie_in_one_buffer_in_the_order_a_step_reads_them(config, tiny_adapters):
    """Each token streams its own adapter: layer by layer, projection by projection, A then Bt."""
    w = read_peft_adapter("a1", tiny_adapters[1], config, max_lora_rank=16, dtype=torch.bfloat16)
    order = sorted(w.projections, key=lambda key: (key[0], list(FUSED_PROJECTIONS).index(key[1])))
    pairs = [w.projections[key] for key in order]
    storage = {t.untyped_storage().data_ptr() for pair in pairs for t in pair}
    assert len(storage) == 1 and all(t.dtype == torch.bfloat16 and t.is_contiguous() for pair in pairs for t in pair)
    starts = [t.data_ptr() for pair in pairs for t in pair]
    ends = [t.data_ptr() + t.nbytes for pair in pairs for t in pair]
    assert starts[1:] == ends[:-1]  # back to back, no gaps


def test_reads_weights_rank_scaling_and_hash(config, tiny_adapters):
    from safetensors.torch import load_file

    w = read_peft_adapter("a1", tiny_adapters[1], config, max_lora_rank=16)
    assert w.rank == 8 and w.scaling == 2.0 and len(w.projections) == 2 * 4  # 2 layers x 4 fused projections
    a, b = w.projections[(0, "qkv_proj")]  # q, k, v stacked in the adapter's own rank
    assert a.shape == (3 * 8, 64) and b.shape == (8, 64 + 32 + 32) and a.is_contiguous()  # b: B transposed
    raw = load_file(str(tiny_adapters[1] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_{}.weight"
    assert torch.equal(a[8:16], raw[key.format("A")]) and torch.equal(b[:, 64:96], raw[key.format("B")].T)
    assert w.nbytes == sum(t.nbytes for t in raw.values())  # every module targeted: no padding at all
    again = read_peft_adapter("other-name", tiny_adapters[1], config, 16)
    assert again.content_hash == w.content_hash
    assert read_peft_adapter("a3", tiny_adapters[3], config, 16).content_hash != w.content_hash


def test_untargeted_modules_are_zero_slices_in_the_engine_dtype(config, tiny_model_dir, tmp_path):
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "qv", rank=4, targets=["q_proj", "v_proj"])
    w = read_peft_adapter("qv", folder, config, 16, dtype=torch.bfloat16)
    assert set(w.projections) == {(0, "qkv_proj"), (1, "qkv_proj")}
    a, b = w.projections[(1, "qkv_proj")]
    assert a.dtype == b.dtype == torch.bfloat16
    assert a[4:8].abs().sum() == 0 and b[:, 64:96].abs().sum() == 0  # k untouched
    assert a[8:12].abs().sum() > 0 and b[:, 96:128].abs().sum() > 0  # v
    assert adapter_bytes(config, 4, torch.bfloat16, ["q_proj", "v_proj"]) == w.nbytes


def test_rslora_scaling(config, adapter):
    edit_config(adapter, use_rslora=True)
    assert read_peft_adapter("x", adapter, config, 16).scaling == pytest.approx(16 / 8 ** 0.5)


@pytest.mark.parametrize("changes,reason", [
    ({"use_dora": True}, "no lora_magnitude_vector, but use_dora is true"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save lists \\['lm_head'\\], but the folder holds no weight"),
    ({"modules_to_save": ["score"]}, "modules_to_save \\['score'\\] is not supported"),
    ({"target_modules": ["q_proj", "norm"]}, "unsupported target modules \\['norm'\\]"),
    ({"target_modules": ["q_proj", "fc1"]}, "unsupported target modules \\['fc1'\\]"),
    ({"bias": "yes"}, "bias='yes' is not supported"),
    ({"r": 64}, "rank 64 exceeds max_lora_rank=16"),
    ({"rank_pattern": {"q_proj": 4}}, "do not fit the base model .* or rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
])
def test_refusals_name_adapter_and_reason(config, adapter, changes, reason):
    edit_config(adapter, **changes)
    with pytest.raises(AdapterError, match=f"adapter 'bad' .*{reason}"):
        read_peft_adapter("bad", adapter, config, 16)


def test_target_listed_but_weights_for_another_module(config, adapter):
    edit_config(adapter, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="which target_modules does not list"):
        read_peft_adapter("bad", adapter, config, 16)


def test_missing_and_corrupt_files(config, adapter, tmp_path):
    with pytest.raises(AdapterError, match="not a folder"):
        read_peft_adapter("bad", tmp_path / "nope", config, 16)
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AdapterError, match="cannot read weights"):
        read_peft_adapter("bad", adapter, config, 16)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors .* is missing"):
        read_peft_adapter("bad", adapter, config, 16)
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_peft_adapter("bad", adapter, config, 16)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_peft_adapter("bad", adapter, config, 16)


def test_bin_weights_are_read(config, adapter):
    from safetensors.torch import load_file

    tensors = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(tensors, adapter / "adapter_model.bin")
    assert read_peft_adapter("bin", adapter, config, 16).rank == 8


def test_wrong_base_model_is_refused(tmp_path, tiny_model_dir):
    other = make_tiny_model(tmp_path / "wide", hidden_size=96, intermediate_size=128)
    adapter = make_peft_adapter(other, tmp_path / "wide-ad", rank=4)
    with pytest.raises(AdapterError, match="do not fit the base model"):
        read_peft_adapter("wide", adapter, read_model_config(tiny_model_dir), 16)


def test_layers_to_transform_must_cover_the_weights(config, adapter):
    edit_config(adapter, layers_to_transform=[0])  # the weights cover layers 0 and 1
    with pytest.raises(AdapterError, match="layers \\[1\\], which layers_to_transform does not list"):
        read_peft_adapter("bad", adapter, config, 16)
    edit_config(adapter, layers_to_transform=[0, 7])
    with pytest.raises(AdapterError, match="layers_to_transform must list layers in \\[0, 2\\)"):
        read_peft_adapter("bad", adapter, config, 16)
    edit_config(adapter, layers_to_transform=[0, 1], layers_pattern="blocks")
    with pytest.raises(AdapterError, match="layers_pattern 'blocks'"):
        read_peft_adapter("bad", adapter, config, 16)
    edit_config(adapter, layers_to_transform=[1, 0], layers_pattern="layers")
    assert read_peft_adapter("ok", adapter, config, 16).rank == 8
