"""Who a request is from: the API keys the daemon takes, each naming its tenant.

A tenant is what the daemon keeps apart: fair share and the request budget are per
tenant of ``keys_file`` (a tenant may have its own limits), and each tenant's prefix
cache is its own (see ``partition``). Without keys there is one anonymous tenant and a
client is its address; so it is with the one key of ``api_key_env``, the tenant
"default", which every client shares (``Tenant.shared``)::

    keys = Keys.single("sk-1")                    # [server] api_key_env, one tenant
    keys = Keys.from_file("keys.toml")            # [server] keys_file, a tenant per key
    keys.tenant(b"Bearer sk-1")                   # DEFAULT, or None: 401

The keys file is TOML, one table per tenant::

    [tenants.alice]
    key = "sk-alice-..."
    client_max_running = 2       # optional: this tenant's own share and budget
    client_max_queued = 64
    max_request_tokens = 100000
    most_urgent_priority = 0     # optional: requests asking for more urgent are clamped

    [tenants.ops]
    key = "sk-ops-..."
    admin = true                 # an operator: loads and unloads models, /stats in full

Who is an operator (``Keys.operates``; the routes ask ``server.rights``): with a keys
file, the tenants marked ``admin = true``, and no one else (the ``api_key_env`` key beside
it is the ordinary tenant "default"); without one, whoever the daemon lets in (its one
key's holder, or anyone when it has none), as before there were operators.

``priority`` is vLLM's: lower runs first, so the most urgent priority a tenant may use
is the lowest number it may send; a request asking for a lower one runs at the bound
(and says so: ``X-Priority-Clamped``, see ``server.priority_bound``).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from modelpool.server.http import ApiError
from modelpool.server.ui import UI_PATHS
from modelpool.shared.validation import MAX_PRIORITY, is_int

# Paths that answer without a key (an orchestrator's probes).
# Without a key: the probes, and the status page's static files (its data is /stats).
OPEN_PATHS = frozenset({"/healthz", "/readyz"}) | UI_PATHS
_TENANT_LIMITS = ("client_max_running", "client_max_queued", "max_request_tokens")
_TENANT_SETTINGS = frozenset({"key", "admin", "most_urgent_priority", *_TENANT_LIMITS})


@dataclass(frozen=True)
class Tenant:
    """One key's owner; a limit left None is the ``[server]`` one."""

    name: str
    client_max_running: int | None = None
    client_max_queued: int | None = None
    max_request_tokens: int | None = None
    admin: bool = False  # an operator (``admin = true`` in the keys file)
    # The lowest (most urgent) priority its requests may run at; None: any.
    most_urgent_priority: int | None = None
    # The key of api_key_env, which every client of the daemon may hold: its clients are
    # told apart by address in the fair share, as without a key. Counted as one client,
    # one client's burst of n=64 took every other one's turn (issue 58).
    shared: bool = False


# The tenant of ``api_key_env``'s key.
DEFAULT = Tenant("default", shared=True)


class Keys:
    """The bearer keys the daemon takes (none: every request is anonymous's).
    ``every_caller_operates``: no keys file, so whoever gets in is the operator."""

    def __init__(self, tenants: Mapping[str, Tenant], *, every_caller_operates: bool) -> None:
        # By the key's digest: a lookup's time depends on the digest of the guess, which
        # says nothing of how much of the guess is right (a byte-wise compare would).
        self._by_digest = {_digest(key.encode()): tenant for key, tenant in tenants.items()}
        self.every_caller_operates = every_caller_operates

    @classmethod
    def single(cls, key: str | None) -> Keys:
        return cls({key: DEFAULT} if key else {}, every_caller_operates=True)

    @classmethod
    def configured(cls, keys_file: str | None, api_key: str | None) -> Keys:
        """``keys_file``'s tenants, with ``api_key`` (if any) as the tenant "default"."""
        if keys_file is None:
            return cls.single(api_key)
        keys = cls.from_file(keys_file)
        if api_key:
            # A tenant's stored responses and cache partition are its name's: a file's
            # tenant named "default" would share them with every holder of this key.
            if any(tenant.name == DEFAULT.name for tenant in keys._by_digest.values()):
                raise ValueError(
                    f"{keys_file}: tenants.{DEFAULT.name} is the name of the api_key_env "
                    "key's tenant; rename that table"
                )
            keys._by_digest[_digest(api_key.encode())] = DEFAULT
        return keys

    @classmethod
    def from_file(cls, path: str | Path) -> Keys:
        """A tenant per table of ``path`` (ValueError naming what is wrong)."""
        with open(path, "rb") as file:
            data = tomllib.load(file)
        tables = data.get("tenants")
        if not isinstance(tables, Mapping) or not tables:
            raise ValueError(f"{path}: no [tenants.NAME] table")
        tenants: dict[str, Tenant] = {}
        for name, table in tables.items():
            where = f"{path}: tenants.{name}"
            if not isinstance(table, Mapping):
                raise ValueError(f"{where} must be a table")
            unknown = sorted(set(table) - _TENANT_SETTINGS)
            if unknown:
                raise ValueError(f"{where}.{unknown[0]} is not a tenant setting")
            key = table.get("key")
            if not isinstance(key, str) or len(key) < 16:
                raise ValueError(f"{where}.key must be a string of at least 16 characters")
            if key in tenants:
                raise ValueError(f"{where}.key is another tenant's key too")
            limits: dict[str, int | None] = {}
            for setting in _TENANT_LIMITS:
                value = table.get(setting)
                minimum = 0 if setting == "client_max_queued" else 1
                if value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < minimum
                ):
                    raise ValueError(f"{where}.{setting} must be an integer >= {minimum}")
                limits[setting] = value
            admin = table.get("admin", False)
            if not isinstance(admin, bool):
                raise ValueError(f"{where}.admin must be true or false")
            tenants[key] = Tenant(
                str(name),
                limits["client_max_running"],
                limits["client_max_queued"],
                limits["max_request_tokens"],
                admin=admin,
                most_urgent_priority=_priority_bound(table, where),
            )
        return cls(tenants, every_caller_operates=False)

    @property
    def required(self) -> bool:
        return bool(self._by_digest)

    def tenant(self, authorization: bytes | None, api_key: bytes | None = None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header or, without one, of an
        ``x-api-key: KEY`` header (Anthropic's clients send that); None if they name none."""
        if not authorization and api_key:
            return self._by_digest.get(_digest(api_key.strip()))
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return self._by_digest.get(_digest(token.strip()))

    def operates(self, tenant: Tenant | None) -> bool:
        """Whether ``tenant`` (a request's, None without a key) is an operator."""
        return self.every_caller_operates or (tenant is not None and tenant.admin)

    def refusal(self, headers: Mapping[bytes, bytes], path: str) -> ApiError | None:
        """401 for a request to a keyed path without a key of a tenant."""
        if not self.required or path in OPEN_PATHS:
            return None
        if self.tenant(headers.get(b"authorization"), headers.get(b"x-api-key")) is not None:
            return None
        return ApiError(
            401,
            "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)",
            type="authentication_error",
            code="invalid_api_key",
            # Closed: the body it sends next is not read, nor held against anyone.
            headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
        )


ANONYMOUS = Tenant("anonymous")


def partition(tenant: Tenant | None, salt: str | None) -> str | None:
    """The prefix-cache partition a request runs in (the pool's ``cache_salt``): its
    tenant's, and within it its own ``cache_salt``'s; None, the shared partition, only
    without keys and without a salt. A client's salt can never name another tenant's
    partition: the pair is encoded as JSON, so no salt spells another name and salt, and
    hashed, so the worker gets 64 characters whatever the salt and holds no tenant name."""
    if tenant is None and salt is None:
        return None
    pair = json.dumps([tenant.name if tenant is not None else "", salt or ""])
    return hashlib.sha256(pair.encode("utf-8", "surrogatepass")).hexdigest()


def _priority_bound(table: Mapping[str, object], where: str) -> int | None:
    value = table.get("most_urgent_priority")
    if value is not None and not is_int(value, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY):
        raise ValueError(
            f"{where}.most_urgent_priority must be an integer in [{-MAX_PRIORITY}, "
            f"{MAX_PRIORITY}] (lower runs first)"
        )
    return value if isinstance(value, int) else None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
