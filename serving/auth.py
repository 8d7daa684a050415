"""API keys -> tenants (docs/architecture.md, "Tenancy and security").

The key file (``inferscale serve --api-keys FILE``) is JSON or TOML, one entry per key::

    {"sk-acme-1": "acme", "sk-ops": {"tenant": "ops", "admin": true}}

    "sk-acme-1" = "acme"
    "sk-ops" = { tenant = "ops", admin = true }

A value is a tenant name, or a table with ``tenant`` and optional ``admin`` (admins may register
``public`` segments, readable by every tenant, and read ``/v1/stats``).  The reserved
``__public__`` namespace can never be a tenant.  Validation errors name the entry by position,
never by the key text, and keys are never logged.

Lookup is constant-time with respect to the keys: the presented key and every configured key
are hashed (SHA-256, so lengths do not matter) and compared with ``hmac.compare_digest``
against *all* entries, without stopping at the first match.  The tenant always comes from
the key, never from the request body.  Without a key file, every request is the tenant
``default`` with admin rights and no auth (local use; the CLI binds 127.0.0.1 by default).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import tomllib

from inferscale_jax.prefix_cache import PUBLIC_TENANT
from serving.errors import APIError

DEFAULT_TENANT = "default"
MAX_TENANT_LEN = 128


@dataclasses.dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False


LOCAL = Principal(DEFAULT_TENANT, admin=True)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    """Configured keys, stored only as SHA-256 digests."""

    def __init__(self, mapping: dict):
        if not isinstance(mapping, dict) or not mapping:
            raise ValueError("the API key mapping is empty: give at least one key, or run without "
                             "--api-keys for a single local tenant")
        self._entries: list[tuple[bytes, Principal]] = []
        for i, (key, value) in enumerate(mapping.items(), 1):
            where = f"API key entry #{i}"
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ValueError(f"{where}: the key must be a non-empty string without surrounding spaces")
            if isinstance(value, str):
                tenant, admin = value, False
            elif isinstance(value, dict) and set(value) <= {"tenant", "admin"} and "tenant" in value:
                tenant, admin = value["tenant"], value.get("admin", False)
            else:
                raise ValueError(f"{where}: the value must be a tenant name or "
                                 '{"tenant": NAME, "admin": true|false} (no other fields)')
            if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LEN:
                raise ValueError(f"{where}: tenant must be a non-empty string of at most {MAX_TENANT_LEN} chars")
            if tenant == PUBLIC_TENANT:
                raise ValueError(f"{where}: {PUBLIC_TENANT!r} is the reserved namespace of public "
                                 "segments, not a tenant; choose another tenant name")
            if not isinstance(admin, bool):
                raise ValueError(f"{where}: admin must be true or false")
            self._entries.append((_digest(key), Principal(tenant, admin)))

    @classmethod
    def from_file(cls, path: str) -> "ApiKeys":
        """Load a JSON or TOML key file (TOML when the name ends in .toml, else JSON then TOML)."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
        text = raw.decode("utf-8", "replace")
        loaders = [tomllib.loads] if path.endswith(".toml") else [json.loads, tomllib.loads]
        for load in loaders:
            try:
                return cls(load(text))
            except (json.JSONDecodeError, tomllib.TOMLDecodeError):
                continue
        raise ValueError(f"the API key file {path} is neither valid JSON nor valid TOML "
                         f"(expected a mapping key -> tenant); see {os.path.basename(__file__)}")

    def __len__(self) -> int:
        return len(self._entries)

    def tenants(self) -> list[str]:
        """The tenants the keys map to (each once, in file order)."""
        return list(dict.fromkeys(p.tenant for _, p in self._entries))

    def serving_tenants(self) -> list[str]:
        """The tenants with a non-admin key (each once, in file order): the ones whose traffic the
        defaults share the engine between (``--tenant-reserve``, ``--max-waiting-per-tenant``).  A
        tenant reached only by admin keys is an operator's (``/v1/stats``, public segments); it may
        still send requests, but no rows or queue are kept from the others for it by default."""
        return list(dict.fromkeys(p.tenant for _, p in self._entries if not p.admin))

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller's principal from an ``Authorization`` header value, else 401."""
        if not authorization:
            raise unauthorized("missing API key: send 'Authorization: Bearer <key>'", "missing_api_key")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized("malformed Authorization header: send 'Authorization: Bearer <key>'",
                               "invalid_api_key")
        presented = _digest(key)
        found = None
        for digest, principal in self._entries:  # compare against every entry: no early exit
            if hmac.compare_digest(presented, digest) and found is None:
                found = principal
        if found is None:
            raise unauthorized("invalid API key", "invalid_api_key")
        return found


def unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code, headers={"WWW-Authenticate": "Bearer"})


def load_api_keys(source) -> ApiKeys | None:
    """``None`` (no auth), an ``ApiKeys``, a mapping, or a path to a JSON/TOML key file."""
    if source is None or isinstance(source, ApiKeys):
        return source
    if isinstance(source, dict):
        return ApiKeys(source)
    return ApiKeys.from_file(os.fspath(source))
