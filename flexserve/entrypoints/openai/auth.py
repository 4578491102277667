"""API keys: who may call `/v1/*`, and which tenant each key's requests are charged to.

Keys come from `--api-key` (repeatable; `$FLEXSERVE_API_KEY`) and from `--api-key-file`, one a
line: `key` or `tenant:key` (blank lines and `#` comments are skipped). A request must send
`Authorization: Bearer <key>`; its key's tenant name goes on `request.state.tenant`, where the
fair scheduler, the per-tenant limits and the files and fine-tuning jobs API read it (a tenant
sees only its own files and jobs: `owner_tenant`).

Admin keys (`--admin-api-key`, repeatable; `$FLEXSERVE_ADMIN_API_KEY`) are the operator's: a
request with one may load, unload, list and use every tenant's adapters and fine-tuned models,
and the adapters it loads are shared by every tenant (`request.state.admin`; `is_admin`).

The presented key is hashed once and its digest compared with every configured key's digest with
`hmac.compare_digest`, with no early exit, so the time taken says nothing about which key (or
which prefix of one) almost matched, nor about the keys' lengths.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from flexserve.engine.fairness import DEFAULT_TENANT
from flexserve.entrypoints.openai.errors import error_response

logger = logging.getLogger(__name__)

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_BEARER = b"bearer "


@dataclass(frozen=True, slots=True)
class APIKey:
    """One configured key, kept only as its digest."""

    digest: bytes  # sha256 of the key's UTF-8 bytes
    tenant: str | None  # the tenant its requests are charged to; None: the default tenant
    admin: bool = False  # an operator's key: every tenant's models (module docstring)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeyTable:
    """The configured API keys; `match` finds the key a request presents in constant time."""

    def __init__(self, keys: Iterable[tuple[str, str | None]],
                 admin_keys: Iterable[str] = ()) -> None:
        """`keys`: (key, tenant or None) pairs; `admin_keys`: the operator's keys. ValueError on
        an empty key, a bad tenant name or one key given twice with different roles."""
        tenants: dict[str, str | None] = {}
        admins = set()
        for key in admin_keys:
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be a non-empty string without whitespace")
            admins.add(key)
        for key, tenant in keys:
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be a non-empty string without whitespace")
            if tenant is not None and not _TENANT.match(tenant):
                raise ValueError(f"tenant name {tenant!r}: use 1-64 letters, digits, '.', '_', "
                                 "'@' or '-', starting with a letter or digit")
            if key in tenants and tenants[key] != tenant:
                raise ValueError(f"an API key is given twice, for tenants {tenants[key]!r} and "
                                 f"{tenant!r}")
            if key in admins:
                raise ValueError("an API key is given both as an admin key and as a tenant's")
            tenants[key] = tenant
        if not tenants and not admins:
            raise ValueError("no API keys given")
        self._keys = (tuple(APIKey(_digest(k.encode()), t) for k, t in tenants.items())
                      + tuple(APIKey(_digest(k.encode()), None, admin=True) for k in admins))

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def tenants(self) -> set[str]:
        """The tenant names the keys carry."""
        return {key.tenant for key in self._keys if key.tenant is not None}

    def match(self, presented: bytes) -> APIKey | None:
        """The configured key equal to `presented`, or None. Every key is compared, whatever
        matched before, and on digests of one length."""
        digest = _digest(presented)
        found = None
        for key in self._keys:
            equal = hmac.compare_digest(digest, key.digest)
            found = key if equal else found
        return found

    @classmethod
    def from_sources(cls, keys: Sequence[str] | None = None, key_file: str | None = None,
                     admin_keys: Sequence[str] | None = None) -> APIKeyTable | None:
        """The keys of `--api-key` values (plain keys, no tenant), of `--api-key-file` and of
        `--admin-api-key`; None when none gives any (the API is then open). ValueError names a
        bad line."""
        pairs: list[tuple[str, str | None]] = [(key, None) for key in keys or () if key]
        if key_file is not None:
            pairs.extend(read_api_key_file(key_file))
        admins = [key for key in admin_keys or () if key]
        return cls(pairs, admins) if pairs or admins else None


def read_api_key_file(path: str) -> list[tuple[str, str | None]]:
    """(key, tenant) pairs of an `--api-key-file`: `key` or `tenant:key` a line; blank lines and
    lines starting with `#` are skipped. ValueError names the line (never echoing a key)."""
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it: "
                         f"{getattr(e, 'strerror', None) or e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("--api-key-file %s is readable by other users: chmod 600 it", path)
    pairs: list[tuple[str, str | None]] = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        if not sep:
            tenant, key = None, line
        else:
            tenant, key = tenant.strip(), key.strip()
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"--api-key-file {path}, line {number}: expected `key` or "
                             "`tenant:key` (keys have no whitespace)")
        if tenant is not None and not _TENANT.match(tenant):
            raise ValueError(f"--api-key-file {path}, line {number}: bad tenant name: use 1-64 "
                             "letters, digits, '.', '_', '@' or '-'")
        pairs.append((key, tenant))
    if not pairs:
        raise ValueError(f"--api-key-file {path} holds no keys")
    return pairs


def owner_tenant(request: Any) -> str:
    """The tenant that owns what a request creates and may see (files, fine-tuning jobs): its
    API key's tenant, else "default" (no keys, or a key without a tenant). Never the request's
    `user` field, which any client may set to anything."""
    return getattr(request.state, "tenant", None) or DEFAULT_TENANT


def is_admin(request: Any) -> bool:
    """Whether the request came with an admin key (`--admin-api-key`)."""
    return getattr(request.state, "admin", False) is True


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    if authorization is None or authorization[:len(_BEARER)].lower() != _BEARER:
        return None
    token = authorization[len(_BEARER):].strip()
    return token or None


class APIKeyMiddleware:
    """Every `/v1/*` request needs `Authorization: Bearer <key>` with a configured key; the key's
    tenant goes on `request.state.tenant`. Without keys the API is open. CORS preflights
    (OPTIONS) pass: browsers send them without credentials."""

    def __init__(self, app: ASGIApp, keys: APIKeyTable | None) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.keys is None
            or scope["type"] != "http"
            or not scope["path"].startswith("/v1/")
            or scope["method"] == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        token = bearer_token(header)
        key = None if token is None else self.keys.match(token)
        if key is not None:
            # Starlette's `request.state` is this dict (uvicorn gives each request a copy).
            state = scope.setdefault("state", {})
            if key.tenant is not None:
                state["tenant"] = key.tenant
            if key.admin:
                state["admin"] = True
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if header is not None
                   else "You didn't provide an API key: send `Authorization: Bearer <key>`.")
        response = error_response(401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
