"""Tenants (`loraplex serve --tenants FILE`): API keys scoped to adapters, with limits and a weight.

The file (JSON, or TOML by its suffix) maps tenant names to their entries:

    {"tenants": {"acme": {"api_keys": ["sk-acme-1"], "adapters": ["acme-*"], "base_model": true,
                          "requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrent": 32,
                          "weight": 2},
                 "globex": {"api_keys": ["sha256:<hex>"], "adapters": ["globex-*"], "base_model": false,
                            "can_load_adapters": true, "adapter_root": "/srv/adapters/globex",
                            "prefix_cache": "shared:partners"},
                 "initech": {"api_keys": ["sk-initech-1"], "adapters": ["*"],
                             "adapter_source": "s3://initech-adapters/prod"}}}

A key is given plain or as the hex SHA-256 of the key (`sha256:`); only digests are kept, and a
presented key is compared with every digest in constant time. A key belongs to one tenant. A bad
file is a `TenantsError` naming the entry, before anything is served (or, on reload, while the old
tenants stay).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from loraplex.api.sources.s3_source import parse_url

FIELDS = {"api_keys", "adapters", "base_model", "requests_per_minute", "tokens_per_minute", "max_concurrent",
          "weight", "can_load_adapters", "adapter_root", "prefix_cache", "adapter_source"}


class TenantsError(ValueError):
    """The tenants file cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digests: tuple[bytes, ...]
    adapters: tuple[str, ...] = ()  # glob patterns of the adapter names it may use (and load)
    base_model: bool = True
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt and completion tokens, reserved at admission
    max_concurrent: int | None = None  # sequences at once
    weight: float = 1.0  # its share of the batch beside other tenants
    can_load_adapters: bool = False
    adapter_root: str | None = None  # where its own adapters are loaded from
    prefix_cache: str = "own"  # "own", or "shared:<group>": whose cached prompts its requests may reuse
    adapter_source: str | None = None  # s3://bucket/prefix: the only object storage its adapter names resolve in

    @property
    def cache_namespace(self) -> str:
        """The engine's prefix-cache namespace: the tenant's own, or its group's (never a tenant's name
        colliding with a group: the prefixes differ)."""
        if self.prefix_cache == "own":
            return f"tenant:{self.name}"
        return f"group:{self.prefix_cache[len('shared:'):]}"

    def may_use(self, adapter: str | None) -> bool:
        """The base model (None) if `base_model`; an adapter whose name matches one of its patterns."""
        if adapter is None:
            return self.base_model
        return any(fnmatchcase(adapter, pattern) for pattern in self.adapters)


@dataclass(frozen=True)
class Tenants:
    by_name: dict[str, Tenant]
    source: str = ""

    def identify(self, key: str) -> Tenant | None:
        """The tenant holding `key`: its digest compared with every digest, in constant time each and
        without stopping at a match."""
        digest = _digest(key)
        found = None
        for tenant in self.by_name.values():
            for known in tenant.key_digests:
                if hmac.compare_digest(known, digest):
                    found = tenant
        return found

    def holds_key(self, key: str) -> bool:
        return self.identify(key) is not None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def load_tenants(path: str | os.PathLike) -> Tenants:
    """The tenants of the file at `path`; TenantsError naming what is wrong."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise TenantsError(f"tenants file {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text.decode("utf-8"))
        else:
            data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TenantsError(f"tenants file {path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: "
                           f"{exc}") from None
    return parse_tenants(data, str(path))


def parse_tenants(data, source: str = "tenants") -> Tenants:
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise TenantsError(f"{source}: the file is an object with one key, \"tenants\": name -> entry")
    tenants, owners = {}, {}
    for name, entry in data["tenants"].items():
        tenant = _tenant(name, entry, f"{source}: tenants.{name}")
        for digest in tenant.key_digests:
            if digest in owners:
                raise TenantsError(f"{source}: tenants.{name}.api_keys: a key of tenant {owners[digest]!r} "
                                   f"too (a key belongs to one tenant)")
            owners[digest] = name
        tenants[name] = tenant
    return Tenants(tenants, source)


def _tenant(name, entry, where: str) -> Tenant:
    if not isinstance(name, str) or not name.strip():
        raise TenantsError(f"{where}: a tenant's name is a non-empty string")
    if not isinstance(entry, dict):
        raise TenantsError(f"{where}: an entry is an object")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise TenantsError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    keys = entry.get("api_keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise TenantsError(f"{where}.api_keys: a non-empty list of keys (plain, or sha256:<64 hex digits>)")
    patterns = entry.get("adapters", [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise TenantsError(f"{where}.adapters: a list of adapter name patterns (globs such as \"acme-*\")")
    root = entry.get("adapter_root")
    if root is not None and (not isinstance(root, str) or not os.path.isabs(root)):
        raise TenantsError(f"{where}.adapter_root: an absolute folder path")
    if entry.get("can_load_adapters") and root is None:
        raise TenantsError(f"{where}: can_load_adapters needs adapter_root (the folder its adapters load from)")
    return Tenant(name, tuple(_key_digest(k, f"{where}.api_keys[{i}]") for i, k in enumerate(keys)), tuple(patterns),
                  _flag(entry, "base_model", True, where), _count(entry, "requests_per_minute", where),
                  _count(entry, "tokens_per_minute", where), _count(entry, "max_concurrent", where),
                  _weight(entry.get("weight", 1.0), f"{where}.weight"), _flag(entry, "can_load_adapters", False, where),
                  root, _prefix_cache(entry.get("prefix_cache", "own"), f"{where}.prefix_cache"),
                  _source(entry.get("adapter_source"), f"{where}.adapter_source"))


def _source(value, where: str) -> str | None:
    if value is None:
        return None
    try:
        parse_url(value if isinstance(value, str) else "")
    except ValueError:
        raise TenantsError(f"{where}: an object-storage location, s3://bucket/prefix") from None
    return value.rstrip("/")


def _prefix_cache(value, where: str) -> str:
    if value == "own" or (isinstance(value, str) and value.startswith("shared:") and value[len("shared:"):].strip()
                          and value == value.strip()):
        return value
    raise TenantsError(f"{where}: \"own\" (the default: its prompts are cached for itself alone) or "
                       f"\"shared:<group>\" (cached prompts shared with the group's other tenants)")


def _key_digest(key: str, where: str) -> bytes:
    if key.startswith("sha256:"):
        try:
            digest = bytes.fromhex(key[len("sha256:"):])
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise TenantsError(f"{where}: sha256: is followed by the key's 64 hex digits")
        return digest
    return _digest(key)


def _flag(entry: dict, field: str, default: bool, where: str) -> bool:
    value = entry.get(field, default)
    if not isinstance(value, bool):
        raise TenantsError(f"{where}.{field}: true or false")
    return value


def _count(entry: dict, field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise TenantsError(f"{where}.{field}: a positive integer (or left out: no limit)")
    return value


def _weight(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TenantsError(f"{where}: a positive number")
    return float(value)


class TenantRegistry:
    """The tenants in force: read at start-up, replaced whole by a reload. A broken file keeps the old
    tenants (the error says why); requests already admitted finish under the rules they started with."""

    def __init__(self, path: str | None, operator_keys: tuple[str, ...] = ()) -> None:
        self.path = path
        self.operator_keys = tuple(k for k in operator_keys if k)
        self.current: Tenants | None = self._read() if path else None

    @property
    def enabled(self) -> bool:
        return self.current is not None

    def reload(self) -> Tenants:
        if not self.path:
            raise TenantsError("this server was started without --tenants: there is no file to reload")
        self.current = self._read()
        return self.current

    def _read(self) -> Tenants:
        tenants = load_tenants(self.path)
        for key in self.operator_keys:  # the admin's (and the metrics scraper's) keys stay theirs
            owner = tenants.identify(key)
            if owner is not None:
                raise TenantsError(f"tenants file {self.path}: tenants.{owner.name}.api_keys holds an operator "
                                   f"key (--admin-api-key / --metrics-api-key / --api-key)")
        return tenants
