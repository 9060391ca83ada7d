"""The `KernelConfig` a kernel test runs under, built by the test itself: no kernel asks a setting per call."""

import torch

from loraplex.kernels.dispatch import KernelConfig, kernel_config, resolve_backend


def configured(setting: str, device: torch.device | str, dtype: torch.dtype, **fields) -> KernelConfig:
    """What a model on `device` in `dtype` runs under `LORAPLEX_KERNELS=setting` ("auto": this machine's own
    choice), whatever the environment says; `fields`: kv_dtype, lora_dtype."""
    device = torch.device(device)
    return kernel_config(device, dtype, backend=resolve_backend(device, setting), **fields)
