"""Compiling a Triton kernel for an H100 / H200 (sm_90) on this machine, no GPU needed: Triton's own ptxas.
The interpreter runs shapes a GPU compile refuses (a tl.dot dimension below 16): this is what catches them.
The compile runs in a child process, since the tests' process has Triton in interpreter mode."""

import json
import os
import subprocess
import sys


class RecordGrid:
    """A Triton kernel whose launches note their grid (None: noted, not run)."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid] if self.kernel is not None else lambda *args, **kwargs: None


def compile_for_sm90(module: str, kernel: str, constants: dict, pointer_types: dict, floats: tuple = ()) -> list:
    """`module.kernel` compiled with every `*_ptr` argument `pointer_types[name]` (default *fp16), those in
    `floats` fp32, other arguments i32; returns the stages it built (the last one "cubin")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = json.dumps([module, kernel, constants, pointer_types, list(floats)])
    done = subprocess.run([sys.executable, __file__, spec], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile(module: str, kernel: str, constants: dict, pointer_types: dict, floats: list) -> list:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel)
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp16")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return list(triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32)).asm)


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compile(*json.loads(sys.argv[1]))) + "\n")
