"""Hostile adapter folders: every malformed file is an AdapterError (a 400) naming the problem,
nothing outside an adapter root is ever read (links swapped in mid-load, hard links), and a
target_modules regex cannot freeze the server."""

import json
import os
import shutil

import pytest
import torch

from conftest import assert_refused_at_its_first_deadline, spy_on_matches, swapping_in_a_link
from loraplex.adapters.peft_format import AdapterError, read_peft_adapter
from loraplex.adapters.registry import AdapterRegistry
from loraplex.platform.models.registry import read_model_config


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return read_model_config(tiny_model_dir)


@pytest.fixture
def folder(tiny_adapters, tmp_path):
    dst = tmp_path / "root" / "ad"
    shutil.copytree(tiny_adapters[1], dst)
    return dst


def edit(folder, **changes):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,reason", [
    ({"lora_alpha": [1, 2]}, "lora_alpha must be a finite number"),
    ({"lora_alpha": "16"}, "lora_alpha"),
    ({"target_modules": 7}, "target_modules must be a list"),
    ({"target_modules": ["q_proj", 3]}, "target_modules must be a list"),
    ({"r": True}, "rank r must be a positive integer"),
    ({"target_modules": "(q_proj"}, "regex is invalid"),
])
def test_malformed_config_fields(config, folder, changes, reason):
    edit(folder, **changes)
    with pytest.raises(AdapterError, match=reason):
        read_peft_adapter("x", folder, config, 16)


def test_malformed_files(config, folder):
    good = (folder / "adapter_config.json").read_text()
    (folder / "adapter_config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(AdapterError, match="nests too deeply|not valid JSON"):
        read_peft_adapter("x", folder, config, 16)
    (folder / "adapter_config.json").write_text(good)
    (folder / "adapter_model.safetensors").unlink()
    torch.save([1, 2, 3], folder / "adapter_model.bin")  # a list, not a state dict
    with pytest.raises(AdapterError, match="must map weight names to tensors"):
        read_peft_adapter("x", folder, config, 16)


def test_link_loops_long_names_and_fifos(config, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(AdapterError, match="cannot be read|not a folder"):
        read_peft_adapter("x", loop, config, 16)
    with pytest.raises(AdapterError):
        read_peft_adapter("x", tmp_path / ("n" * 300), config, 16)
    odd = tmp_path / "odd"
    odd.mkdir()
    os.mkfifo(odd / "adapter_config.json")  # reading it would block forever
    with pytest.raises(AdapterError, match="not a regular file"):
        read_peft_adapter("x", odd, config, 16, confined=True)


def test_confined_reads_refuse_links_and_hard_links(config, folder, tiny_adapters, tmp_path):
    assert read_peft_adapter("x", folder, config, 16, confined=True).rank == 8
    outside = tiny_adapters[3] / "adapter_model.safetensors"
    (folder / "adapter_model.safetensors").unlink()
    os.link(outside, folder / "adapter_model.safetensors")  # a hard link to a file elsewhere
    with pytest.raises(AdapterError, match="hard-linked"):
        read_peft_adapter("x", folder, config, 16, confined=True)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").symlink_to(outside)
    with pytest.raises(AdapterError, match="cannot be read"):
        read_peft_adapter("x", folder, config, 16, confined=True)
    linked_parent = tmp_path / "via"
    linked_parent.symlink_to(folder.parent)  # a link among the folder's parents
    with pytest.raises(AdapterError, match="cannot be read|not a folder"):
        read_peft_adapter("x", linked_parent / "ad", config, 16, confined=True)
    assert read_peft_adapter("x", linked_parent / "ad", config, 16).rank == 8  # offline loads may use links


CATASTROPHIC = r"(.|\.|[a-z])*\d\d\d$"  # exponential backtracking on module names


def test_a_catastrophic_target_modules_regex_is_refused_quickly(config, folder, monkeypatch):
    edit(folder, target_modules=CATASTROPHIC)
    calls = spy_on_matches(monkeypatch, CATASTROPHIC)
    with pytest.raises(AdapterError, match="too long to match"):
        read_peft_adapter("x", folder, config, 16)
    assert_refused_at_its_first_deadline(calls)


def test_a_link_swapped_in_while_loads_run_never_reads_outside(config, tiny_adapters, tmp_path):
    """The server checks the folder, then the registry reads it; a thread keeps swapping the
    weights file between the real one and a link to another adapter's file meanwhile."""
    inside = tmp_path / "root" / "inner"
    shutil.copytree(tiny_adapters[0], inside)  # rank 16, like tiny_adapters[2] outside
    outside_hash = read_peft_adapter("o", tiny_adapters[2], config, 16).content_hash
    inside_hash = read_peft_adapter("i", inside, config, 16).content_hash
    registry = AdapterRegistry(config, 2, 16, None, torch.float32)
    hashes, refused = [], 0
    with swapping_in_a_link(inside / "adapter_model.safetensors", tiny_adapters[2] / "adapter_model.safetensors"):
        for i in range(2000):  # at least 150 loads, then until both outcomes were seen (bounded)
            try:
                hashes.append(registry.load(f"t{i}", str(inside.resolve()), confined=True).content_hash)
            except AdapterError:
                refused += 1
            if i >= 150 and hashes and refused:
                break
    assert outside_hash not in hashes
    assert set(hashes) <= {inside_hash} and hashes and refused  # both outcomes happened; never the outside file
