"""The layers hold (.importlinter, also run by `make test`): the API talks to the engine only
through `platform/engine_client.py` and value types, grammar and adapters never import the API,
kernels import none of the layers above them. A forbidden import is caught, not just absent."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint_imports(config: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_the_layer_contracts_hold():
    run = lint_imports(REPO / ".importlinter")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout


def test_a_forbidden_import_breaks_the_api_contract(tmp_path):
    """The same contracts over a copy of the API with one module reaching into the adapter
    registry: lint-imports fails naming it."""
    root = tmp_path / "checkout"
    for folder in ("platform", "adapters", "kernels", "grammar", "api"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("ui", "__pycache__"))
    (root / "api" / "sneaky.py").write_text("from loraplex.adapters.registry import AdapterRegistry\n")
    package = root / "loraplex"
    package.mkdir()
    # the copy's folders under the name `loraplex`, as the editable install maps the checkout's
    (package / "__init__.py").write_text("from pathlib import Path\n__path__.append(str(Path(__file__).parent.parent))\n")
    run = subprocess.run([str(LINT), "--config", str(REPO / ".importlinter"), "--no-cache"], cwd=root,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "loraplex.api.sneaky -> loraplex.adapters.registry" in run.stdout
    assert "1 broken" in run.stdout
