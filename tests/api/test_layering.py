"""The layers hold (.importlinter, also run by `make test`): the API talks to the engine only
through `platform/engine/engine_client.py` and value types, grammar and adapters never import the API,
kernels import none of the layers above them, models import nothing of adapters, adapters import no model file. A forbidden import is caught, not just absent."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint_imports(config: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_layer_contracts_hold():
    run = lint_imports(REPO / ".importlinter")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    contracts = (REPO / ".importlinter").read_text().count("[importlinter:contract:")
    assert f"{contracts} kept, 0 broken" in run.stdout


@pytest.mark.parametrize("module,line,named", [
    ("api/sneaky.py", "from loraplex.adapters.registry import AdapterRegistry", "loraplex.api.sneaky -> loraplex.adapters.registry"),
    # a model that knew its LoRA layers; adapters that read a model file instead of its family's declaration
    ("platform/models/sneaky.py", "from loraplex.adapters.lora_layers import LoRALinear",
     "loraplex.platform.models.sneaky -> loraplex.adapters.lora_layers"),
    ("adapters/sneaky.py", "from loraplex.platform.models.llama import MLP", "loraplex.adapters.sneaky -> loraplex.platform.models.llama"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, named):
    """The same contracts over a copy of the tree with one module reaching where its layer may not:
    lint-imports fails naming it."""
    root = tmp_path / "checkout"
    for folder in ("platform", "adapters", "kernels", "grammar", "api"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("ui", "__pycache__"))
    (root / module).write_text(line + "\n")
    package = root / "loraplex"
    package.mkdir()
    # the copy's folders under the name `loraplex`, as the editable install maps the checkout's
    (package / "__init__.py").write_text("from pathlib import Path\n__path__.append(str(Path(__file__).parent.parent))\n")
    run = subprocess.run([str(LINT), "--config", str(REPO / ".importlinter"), "--no-cache"], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert named in run.stdout
    assert "1 broken" in run.stdout
