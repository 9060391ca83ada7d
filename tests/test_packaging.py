"""The package layout: the five folders import as loraplex.<folder>, carry no
top-level __init__.py, and all land in the wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["platform", "adapters", "kernels", "grammar", "api"]


def test_no_top_level_init_in_package_folders():
    for folder in FOLDERS:
        assert (ROOT / folder).is_dir()
        assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/__init__.py shadows the stdlib"


def test_stdlib_platform_and_our_package_both_import_from_the_repo_root():
    code = ("import platform; platform.system(); import torch; "
            "from loraplex.platform import LLM, SamplingParams; import loraplex.platform.engine.llm_engine")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_wheel_contains_every_package_folder(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("loraplex-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for folder in FOLDERS:
        sources = sorted(str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*.py") if "ui" not in p.parts)
        for name in sources:
            assert f"loraplex/{folder}/{name}" in names
    assert "loraplex/platform/models/llama.py" in names
    csrc = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".c", ".h"))
    assert csrc and all(f"loraplex/kernels/csrc/{name}" in names for name in csrc)  # built on first use: they ship
    assert not any(n.startswith(("loraplex/platform/__init__", "platform/")) for n in names)


def test_installed_wheel_imports_without_the_checkout(tmp_path):
    """The wheel alone (no repo on sys.path) gives the same package-level names."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("loraplex-*.whl")
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    code = ("import sys; sys.path = [p for p in sys.path if 'work' not in p or 'site-packages' in p]; "
            f"sys.path.insert(0, {str(target)!r}); import loraplex; "
            f"assert loraplex.__file__.startswith({str(target)!r}), loraplex.__file__; "
            "from loraplex.platform import LLM; import loraplex.platform.engine.llm_engine as e; "
            f"assert e.__file__.startswith({str(target)!r}), e.__file__")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=120)
