"""Adapter-root confinement: the folders an admin load or the resolver may read adapters from,
checked after symlinks. The registry then reads the resolved path without following any link
(a link swapped in after this check makes the read fail, never go outside). Also how a tenant reads
paths in its own root: relative to it (`relative_to`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from loraplex.api.errors import APIError


class AdapterRoots:
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def _resolved(self) -> list[Path]:
        return [Path(r).resolve() for r in self.roots]

    def path(self, lora_path: str) -> Path:
        """The folder `lora_path` names, inside one of the roots; an APIError saying why not."""
        try:
            return self._path(lora_path)
        except (OSError, RuntimeError) as exc:  # a link loop, a name too long
            raise APIError(400, f"lora_path cannot be used: {type(exc).__name__}", "lora_path") from None

    def _path(self, lora_path: str) -> Path:
        roots = self._resolved()
        if not roots:
            raise APIError(400, "runtime adapter loading is off: start the server with --adapter-root DIR",
                           "lora_path")
        for root in roots:
            path = (root / lora_path).resolve()  # an absolute lora_path replaces root here
            if path.is_relative_to(root):
                break
        else:
            raise APIError(400, "lora_path must lie inside one of the server's adapter roots", "lora_path")
        if not path.is_dir():
            raise APIError(404, f"no adapter folder at {lora_path!r}", "lora_path")
        if any(not f.resolve().is_relative_to(root) for f in path.iterdir()):
            raise APIError(400, "the adapter folder links to files outside the adapter roots", "lora_path")
        return path

    def find(self, name: str) -> Path | None:
        """<root>/<name> when it is a PEFT folder inside its root (after symlinks), else None."""
        if name in (".", "..") or any(sep in name for sep in "/\\:\0"):
            return None
        for root in self._resolved():
            try:
                path = (root / name).resolve()
                if path.is_relative_to(root) and (path / "adapter_config.json").is_file() \
                        and all(f.resolve().is_relative_to(root) for f in path.iterdir()):
                    return path
            except (OSError, RuntimeError):  # a link loop, a name too long: not an adapter
                continue
        return None


def relative_to(text: str, root: str) -> str:
    """`text` with `root` (as given and as resolved) left out of the paths inside it, and the root
    itself as `.`, longest spelling first."""
    sep = re.escape(os.sep)
    for path in sorted(spellings(root), key=len, reverse=True):
        # whole names only: not inside a longer folder's name, nor the start of one (`root-2`, `root.bak`)
        found = re.compile(rf"(?<![\w.-]){re.escape(path)}(?:{sep}|(?![\w-]|\.[\w.-]))")
        text = found.sub(lambda m: "" if m.group().endswith(os.sep) else ".", text)
    return text


def spellings(folder: str | None) -> set[str]:
    """An absolute folder as given and as resolved, without a trailing separator; none for a relative
    name (it could match ordinary words) or the file system's root."""
    found = set()
    for path in {folder, os.path.realpath(folder)} if folder else ():
        path = path.rstrip(os.sep)
        if os.path.isabs(path) and path:
            found.add(path)
    return found
