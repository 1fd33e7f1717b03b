"""Who is calling `specx serve`: the API key (`--api-key`) and the tenants (`--tenant NAME:KEY`).

Without tenants, one key (or none) opens every endpoint, and every request belongs to the default
tenant ''. With tenants, a request's `Authorization: Bearer KEY` names its tenant (an unknown key
is 401); `--api-key` is then the operator's key, which alone reads /metrics (its counts are by
tenant). Keys are compared in constant time.

>>> keys = Keys(None, {"a": "ka", "b": "kb"})
>>> keys.tenant("Bearer kb"), keys.tenants
('b', ['a', 'b'])
"""

from __future__ import annotations

import hmac
from pathlib import Path

from .errors import ApiError


def api_key_problem(api_key: str | None) -> str | None:
    """Why no client could ever send `api_key` (None: it can be sent, or there is none). Clients
    send it in an HTTP header, `Authorization: Bearer KEY`: visible ASCII characters only.

    >>> api_key_problem("s3cret"), api_key_problem(None)
    (None, None)
    >>> api_key_problem("clé")
    "the API key holds 'é' (U+00E9): clients send the key in an HTTP header, which takes visible ASCII characters only"
    """
    bad = next((c for c in api_key or "" if not "!" <= c <= "~"), None)
    if bad is None:
        return None
    return (f"the API key holds {bad!r} (U+{ord(bad):04X}): clients send the key in an HTTP header, which takes "
            "visible ASCII characters only")


def parse_tenants(values: list[str] | None, api_key: str | None = None) -> dict[str, str]:
    """`--tenant NAME:KEY` values as {name: key}; ValueError naming the bad one (a name twice, a key
    twice or equal to the operator's --api-key, a key no client could send)."""
    from ..store.tenants import PUBLIC, check_tenant

    tenants: dict[str, str] = {}
    for value in values or []:
        name, sep, key = value.partition(":")
        if not sep or not key:
            raise ValueError(f"--tenant {value!r}: write NAME:KEY")
        check_tenant(name)
        if name == PUBLIC:
            raise ValueError(f"--tenant {value!r}: {PUBLIC!r} holds the shared corpora every tenant drafts from "
                             "(specx ingest --tenant public); it sends no requests")
        problem = api_key_problem(key)
        if problem:
            raise ValueError(f"--tenant {name}: {problem}")
        if name in tenants:
            raise ValueError(f"--tenant {name}: given twice")
        if key in tenants.values() or key == api_key:
            raise ValueError(f"--tenant {name}: its key is another's (each tenant needs a key of its own)")
        tenants[name] = key
    return tenants


def read_tenant_file(path: Path) -> list[str]:
    """The NAME:KEY lines of a tenant file (blank lines and # comments left out); ValueError naming
    the file (and the line) when others than its owner may read it, it cannot be read, or a line is
    not NAME:KEY. The keys then never appear in the process list, as `--tenant` values do."""
    import os
    import stat

    try:
        info = os.stat(path)
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"{path}: others than its owner may read or write it (chmod 600 {path})")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if ":" not in line:
            raise ValueError(f"{path}, line {number}: write NAME:KEY")
        lines.append(line)
    return lines


class Keys:
    """The operator's key and the tenants' keys of one server."""

    def __init__(self, api_key: str | None, tenants: dict[str, str] | None = None) -> None:
        problem = api_key_problem(api_key)
        if problem:
            raise ValueError(problem)
        self.api_key = api_key or None
        self._tenants = dict(tenants or {})

    @property
    def tenants(self) -> list[str]:
        return list(self._tenants)

    def tenant(self, header: str) -> str:
        """The tenant an Authorization header names ('' without tenants); ApiError 401 otherwise."""
        scheme, _, key = header.partition(" ")
        sent = key.strip().encode() if scheme.lower() == "bearer" else None
        if self._tenants:
            found = [name for name, k in self._tenants.items() if sent is not None and hmac.compare_digest(sent, k.encode())]
            if found:
                return found[0]
            raise _unauthorized(header)
        if self.api_key is not None and (sent is None or not hmac.compare_digest(sent, self.api_key.encode())):
            raise _unauthorized(header)
        return ""

    def operator(self, header: str) -> None:
        """For /metrics: the operator's key where one is set (with tenants, one must be)."""
        if self._tenants and self.api_key is None:
            raise ApiError(403, "With tenants, /metrics is the operator's (its counts are by tenant): start the "
                                "server with --api-key and send that key.", None, "forbidden")
        if self.api_key is None:
            return
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise _unauthorized(header)


def _unauthorized(header: str) -> ApiError:
    return ApiError(401, "Incorrect API key provided." if header else
                    "You didn't provide an API key (Authorization: Bearer KEY).", None, "invalid_api_key")
