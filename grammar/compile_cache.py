"""Compiled grammars kept on disk, so a restarted server does not compile its working set again.

One file per spec, named by a hash of its full key: the spec's own key (grammar/backend.py
`StructuredOutputs.key`: the spec, its strictness and whitespace, its reasoning and its tenant's
namespace), the configured backend, the tokenizer (a hash of its whole definition: vocabulary,
added tokens, normalizer, pre-tokenizer, decoder), the vocab size and stop ids, the versions of
llguidance, xgrammar, outlines-core and jsonschema, and a hash of this package's sources (our
rewrites change what a spec compiles to). Anything that changes the compile changes the name.
The namespace in the key keeps tenants apart on disk as in memory: one tenant's entry is never
found, nor its presence timed, under another's key.

What is kept is what a compile worker already sends back (the backends' `export`): xgrammar's
serialized `CompiledGrammar` (restored without compiling: 5-50 ms instead of 0.1-0.5 s), outlines'
token index as bytes, and for llguidance nothing but the exact spec (its matcher does not
serialize; building it from the rewritten spec takes about a millisecond, while the chain it
skips takes a few). With it the chain's result: the backend that took the spec, the spec after
rewrites and what `strict: false` dropped, and the request's own schema for the output check.

An entry: MAGIC, the SHA-256 of the rest, the header's length, the header (JSON: the full key
and the chain's result), the export (zlib). Written to a temp file, fsynced, renamed over the
name: a reader sees a whole entry or none, whoever writes. Read back, the checksum and the full
key must match, and anything that fails to decode or restore removes the file: a miss, never a
crash or another spec's grammar. The folder is bounded in bytes; a hit touches its file's mtime,
and the least recently used files go first (across restarts too).

Nothing here runs on the engine's thread: the manager reads and writes on its own I/O threads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"LPXGRAM1"
SUFFIX = ".grammar"
DEFAULT_SIZE = 256 << 20
STALE_TEMP_S = 600.0  # a temp file this old is a crashed writer's
LIBRARIES = ("llguidance", "xgrammar", "outlines-core", "jsonschema")
_HEAD = struct.Struct("<32sI")  # checksum of what follows it, header length


def default_dir() -> Path | None:
    """Where the cache lives when the flag is left at `auto`: $LORAPLEX_GRAMMAR_CACHE (a folder, or
    `off`), else `grammars` in the cache dir."""
    env = os.environ.get("LORAPLEX_GRAMMAR_CACHE")
    if env:
        return None if env == "off" else Path(env)
    from loraplex.platform.model_store import cache_dir

    return cache_dir() / "grammars"


def resolve_dir(setting: str | os.PathLike | None) -> Path | None:
    """The `grammar_cache_dir` setting as a folder, or None for no disk cache (`off`)."""
    if setting is None or str(setting) == "off":
        return None
    return default_dir() if str(setting) == "auto" else Path(setting)


def library_versions() -> dict[str, str | None]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


_SOURCE_HASH: str | None = None


def source_hash() -> str:
    """A hash of this package's Python sources (the chain, the rewrites, the backends)."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        digest = hashlib.sha256()
        root = Path(__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH


def tokenizer_hash(tokenizer) -> str:
    """A content hash of everything of the tokenizer the backends read: a fast tokenizer's whole
    definition (vocabulary, merges, added tokens, normalizer, pre-tokenizer, decoder), else its
    vocabulary; and its special tokens."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode() + b"\0")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {"map": getattr(tokenizer, "special_tokens_map", {}), "ids": list(getattr(tokenizer, "all_special_ids", []))}
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    digest.update(str(len(tokenizer)).encode())
    return digest.hexdigest()


# ---- the chain's result as JSON ------------------------------------------------------------------

def encode_spec(spec) -> dict:
    out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("tools", "reasoning")}
    out["tools"] = _encode_tools(spec.tools) if spec.tools is not None else None
    out["reasoning"] = dataclasses.asdict(spec.reasoning) if spec.reasoning is not None else None
    return out


def decode_spec(data: dict):
    from loraplex.grammar.backend import StructuredOutputs
    from loraplex.grammar.tooling.reasoning import Reasoning

    fields = dict(data)
    if fields.get("tools") is not None:
        fields["tools"] = _decode_tools(fields["tools"])
    if fields.get("reasoning") is not None:
        fields["reasoning"] = Reasoning(**fields["reasoning"])
    return StructuredOutputs(**fields)


def _encode_tools(calls) -> dict:
    return {"functions": [dataclasses.asdict(f) for f in calls.functions], "required": calls.required,
            "parallel": calls.parallel, "format": calls.format}


def _decode_tools(data: dict):
    from loraplex.grammar.tooling.tools import Function, ToolCalls

    return ToolCalls(functions=tuple(Function(**f) for f in data["functions"]), required=data["required"],
                     parallel=data["parallel"], format=data["format"])


def encode_original(original) -> dict:
    """`Compiled.original`: None, the request's schema, or its tool calls."""
    from loraplex.grammar.tooling.tools import ToolCalls

    if original is None:
        return {"kind": "none"}
    if isinstance(original, ToolCalls):
        return {"kind": "tools", "value": _encode_tools(original)}
    return {"kind": "schema", "value": original}


def decode_original(data: dict):
    if data["kind"] == "none":
        return None
    return _decode_tools(data["value"]) if data["kind"] == "tools" else data["value"]


def encode_export(exported) -> tuple[str, bytes]:
    """A backend's export as bytes: none (llguidance), text (xgrammar), an outlines index."""
    if exported is None:
        return "none", b""
    if isinstance(exported, str):
        return "str", exported.encode()
    if type(exported).__module__.split(".")[0] == "outlines_core":
        rebuild, args = exported.__reduce__()  # (Index.from_binary, (bytes,))
        if getattr(rebuild, "__name__", "") == "from_binary" and len(args) == 1 and isinstance(args[0], bytes):
            return "outlines-index", args[0]
    raise TypeError(f"cannot store a {type(exported).__name__}")


def decode_export(kind: str, raw: bytes):
    if kind == "none":
        return None
    if kind == "str":
        return raw.decode()
    if kind == "outlines-index":
        import outlines_core

        return outlines_core.Index.from_binary(raw)
    raise ValueError(f"unknown export {kind!r}")


# ---- the folder ------------------------------------------------------------------------------------

class CorruptEntry(ValueError):
    pass


def pack(key: dict, header: dict, payload: bytes) -> bytes:
    head = json.dumps({"format": FORMAT, "key": key, **header}).encode()  # ASCII: a lone surrogate round-trips
    body = struct.pack("<I", len(head)) + head + zlib.compress(payload, 1)
    return MAGIC + hashlib.sha256(body).digest() + body


def unpack(data: bytes, key: dict) -> tuple[dict, bytes]:
    """The header and the export of an entry written for `key`; CorruptEntry otherwise."""
    if len(data) < len(MAGIC) + 36 or not data.startswith(MAGIC):
        raise CorruptEntry("not an entry (or truncated)")
    checksum, body = data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if hashlib.sha256(body).digest() != checksum:
        raise CorruptEntry("checksum mismatch (truncated or altered)")
    (size,) = struct.unpack_from("<I", body)
    try:
        header = json.loads(body[4:4 + size].decode())
        payload = zlib.decompress(body[4 + size:])
    except (ValueError, zlib.error) as exc:
        raise CorruptEntry(f"undecodable: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
        raise CorruptEntry("written for another key")
    return header, payload


class DiskCache:
    """Entries by full key (a JSON-able dict) in `folder`, at most `limit` bytes in all."""

    def __init__(self, folder: str | os.PathLike, limit: int = DEFAULT_SIZE) -> None:
        self.folder = Path(folder)
        self.limit = limit
        self._lock = threading.Lock()
        self._sizes: dict[str, int] | None = None  # what this process believes is there, by file name
        self.hits = self.misses = self.writes = self.evictions = self.dropped = 0

    @staticmethod
    def name(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + SUFFIX

    def _ready(self) -> None:
        if self._sizes is None:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)  # tenants' schemas: this user's only
            self._sizes = self._scan()

    def _scan(self) -> dict[str, int]:
        sizes, now = {}, time.time()
        for entry in os.scandir(self.folder):
            try:
                stat = entry.stat()
                if entry.name.endswith(SUFFIX):
                    sizes[entry.name] = stat.st_size
                elif entry.name.startswith(".tmp-") and now - stat.st_mtime > STALE_TEMP_S:
                    os.unlink(entry.path)
            except OSError:
                continue
        return sizes

    def get(self, key: dict) -> tuple[dict, bytes] | None:
        """The entry's header and export, or None (missing, or corrupt: then removed)."""
        with self._lock:
            self._ready()
        path = self.folder / self.name(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            found = unpack(data, key)
        except CorruptEntry as exc:
            log.warning("grammar cache: dropping %s: %s", path.name, exc)
            self.drop(key)
            self.misses += 1
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        self.hits += 1
        return found

    def drop(self, key: dict) -> None:
        """Remove `key`'s entry (one that failed to decode or restore)."""
        name = self.name(key)
        self.dropped += 1
        try:
            os.unlink(self.folder / name)
        except OSError:
            pass
        with self._lock:
            if self._sizes is not None:
                self._sizes.pop(name, None)

    def put(self, key: dict, header: dict, payload: bytes) -> bool:
        """Write the entry atomically, then evict the least recently used past the limit; whether written."""
        data = pack(key, header, payload)
        if len(data) > self.limit:
            return False
        with self._lock:
            self._ready()
        name = self.name(key)
        fd, temp = tempfile.mkstemp(prefix=".tmp-", dir=self.folder)  # 0600
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.folder / name)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        self.writes += 1
        with self._lock:
            self._sizes[name] = len(data)
            if sum(self._sizes.values()) > self.limit:
                self._evict(keep=name)
        return True

    def _evict(self, keep: str) -> None:
        """Oldest mtime first until the folder fits (a fresh scan: other processes write here too)."""
        entries = []
        for name in self._scan():
            try:
                entries.append((os.stat(self.folder / name).st_mtime, name))
            except OSError:
                continue
        self._sizes = {}
        total = 0
        for _, name in entries:
            try:
                self._sizes[name] = os.stat(self.folder / name).st_size
            except OSError:
                continue
            total += self._sizes[name]
        for _, name in sorted(entries):
            if total <= self.limit:
                break
            if name == keep or name not in self._sizes:
                continue
            try:
                os.unlink(self.folder / name)
            except OSError:
                pass
            total -= self._sizes.pop(name)
            self.evictions += 1

    @property
    def size(self) -> int:
        with self._lock:
            self._ready()
            return sum(self._sizes.values())


class GrammarStore:
    """`Compiled` results on disk for one manager: its fingerprint (tokenizer, backend, versions,
    sources) plus each spec's key, and the restore through the manager's backends."""

    def __init__(self, folder, limit: int, tokenizer, vocab_size: int, stop_token_ids, backend: str) -> None:
        self.disk = DiskCache(folder, limit)
        self._setup = (tokenizer, vocab_size, sorted(stop_token_ids), backend)
        self._fingerprint: dict | None = None
        self._lock = threading.Lock()

    def fingerprint(self) -> dict:
        with self._lock:  # the tokenizer's hash takes a moment: once, on an I/O thread
            if self._fingerprint is None:
                tokenizer, vocab_size, stops, backend = self._setup
                self._fingerprint = {"tokenizer": tokenizer_hash(tokenizer), "vocab_size": vocab_size,
                                     "stop_token_ids": stops, "backend": backend, "versions": library_versions(),
                                     "sources": source_hash()}
            return self._fingerprint

    def key(self, spec) -> dict:
        return {**self.fingerprint(), "spec": spec.key}

    def load(self, spec, compiler):
        """The `Compiled` of `spec` from disk, its grammar restored by `compiler`'s backend; None on a miss."""
        from loraplex.grammar.compiler import Compiled

        key = self.key(spec)
        found = self.disk.get(key)
        if found is None:
            return None
        header, payload = found
        try:
            exact = decode_spec(header["spec"])
            grammar = compiler.get(header["backend"]).restore(exact, decode_export(header["export"], payload))
            plan = header.get("budget_plan")  # the start state's plan (grammar/budget.py): not searched again
            return Compiled(exact, header["backend"], grammar, tuple(header["unenforced"]),
                            decode_original(header["original"]),
                            budget_plan=(tuple(plan[0]), tuple(map(tuple, plan[1]))) if plan else plan)
        except Exception as exc:  # readable but not restorable: never served, never kept
            log.warning("grammar cache: dropping an entry that does not restore: %s: %s", type(exc).__name__, exc)
            self.disk.drop(key)
            self.disk.hits -= 1
            self.disk.misses += 1
            return None

    def save(self, spec, compiled, exported) -> bool:
        """Store `compiled` (its grammar as the backend exported it) under `spec`'s key."""
        kind, payload = encode_export(exported)
        header = {"backend": compiled.backend, "spec": encode_spec(compiled.spec), "unenforced": list(compiled.unenforced),
                  "original": encode_original(compiled.original), "export": kind,
                  # False: planned, none found (not searched again); None: not planned (the guarantee off)
                  "budget_plan": [list(compiled.budget_plan[0]), [list(h) for h in compiled.budget_plan[1]]]
                  if compiled.budget_plan else compiled.budget_plan}
        return self.disk.put(self.key(spec), header, payload)
