"""Every file the project's docs and code name in backticks (a path such as folder/file.py) exists: a renamed or removed file
leaves no reference behind that sends a reader nowhere."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|txt|toml|json|js|css|html|c|h|sh|cfg|ini|jinja))`")
# named on purpose though absent: a file that must not exist, and an example of a tenant's own folder
ABSENT_ON_PURPOSE = {"platform/__init__.py", "extra/adapter_config.json"}


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in out.stdout.split()]


def test_every_named_file_exists():
    missing = []
    for path in tracked("*.md", "*.py", "*.js", "*.html"):
        for match in NAMED.finditer(path.read_text(errors="ignore")):
            ref = match.group(1)
            if ref.startswith(("~", "/")) or ref in ABSENT_ON_PURPOSE:
                continue
            if not (ROOT / ref).exists() and not (path.parent / ref).exists():
                missing.append(f"{path.relative_to(ROOT)}: `{ref}`")
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)
