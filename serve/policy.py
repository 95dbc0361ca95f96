"""Tenants: who may ask the discovery service, and which tools of which registries each may be answered with.

``tooltrie serve --policy policy.yaml`` reads a file of this shape (every field checked; an unknown or misspelt key is
an error, since a silently ignored ``alow`` would widen a tenant to every tool)::

    tenants:
      acme:                                   # the tenant's name (in logs and messages, never its keys)
        keys: ["sha256:9f86d081884c7d65..."]  # API keys: sha256 hex digests (preferred) or plain, >= 16 characters
        admin: false                          # may reload registries (POST /v1/registries/{name}/reload)
        registries:                           # the registries it may use; the first is its default
          catalog:
            allow: [weather, NewsTool]        # tool names or tags; absent: every tool
            deny: [StockTool]                 # tool names or tags taken out of allow
            pin: [WeatherTool]                # tools always in its answers (within k: serve/first.py)
          bfcl: {}                            # every tool
        agent_tools:                          # may search the tool lists its agents send (absent: may not)
          deny: [billing]                     # names or tags (namespaces), where a list has them; true: all

Requests send ``Authorization: Bearer <key>``. Only sha256 digests of the keys are held in memory, and a presented
key's digest is compared with every one of them in constant time (``hmac.compare_digest``, no early exit), so the
time taken says nothing about which key, or how much of one, matched. No message or log line names a key.

>>> policy = Policy.parse({"tenants": {"acme": {"keys": ["a key of sixteen chars"],
...                                              "registries": {"catalog": {"allow": ["weather"]}}}}})
>>> policy.authenticate("a key of sixteen chars").name
'acme'
>>> policy.authenticate("a guess") is None
True
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tooltrie.errors import TooltrieError
from tooltrie.registry.loader import first_duplicate_key

MIN_KEY_CHARS = 16  # a plain key shorter than this is guessable; a digest's strength is the operator's business
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_TENANT_FIELDS = {"keys", "admin", "registries", "agent_tools"}
_GRANT_FIELDS = {"allow", "deny", "pin"}


class PolicyError(TooltrieError, ValueError):
    """The policy file is unreadable or malformed; the message says where (never quoting a key)."""


@dataclass(frozen=True)
class Grant:
    """What a tenant may use of one registry: ``allow`` (None: every tool) minus ``deny``, as names or tags; ``pin``
    tool names always in its answers."""

    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] = ()
    pin: tuple[str, ...] = ()

    def within(self, names: Collection[str], tags: Collection[str]) -> Grant:
        """This grant over a registry it was not written for (an agent's tool list): its entries that are names or
        tags there; an ``allow`` none of whose entries is there allows nothing."""
        def kept(entries: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(entry for entry in entries if entry in names or entry in tags)

        return Grant(allow=None if self.allow is None else kept(self.allow), deny=kept(self.deny),
                     pin=tuple(entry for entry in self.pin if entry in names))


@dataclass(frozen=True)
class Tenant:
    """A tenant and its grants, by registry name, in the file's order (the first is its default registry)."""

    name: str
    registries: Mapping[str, Grant]
    admin: bool = False
    # The tool lists its agents send (tool search over their own tools, ``agent_tools.py``): None, refused; a grant's
    # names and tags apply where a list has them (a denied namespace is left out of every list that holds it).
    agent_tools: Grant | None = None

    def default_registry(self, server_default: str) -> str:
        """The server's default when the tenant may use it, else the tenant's first registry."""
        return server_default if server_default in self.registries else next(iter(self.registries))


def key_digest(key: str) -> bytes:
    """What is stored and compared for an API key: its sha256."""
    return hashlib.sha256(key.encode("utf-8")).digest()


class Policy:
    """Tenants and their keys (as digests). Build with :meth:`load` or :meth:`parse`."""

    def __init__(self, tenants: Mapping[str, Tenant], keys: list[tuple[bytes, Tenant]], *, source: str) -> None:
        self.tenants, self._keys, self.source = dict(tenants), keys, source

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose key this is, or None. Compares against every key, always, in constant time each."""
        presented = key_digest(key)
        found: Tenant | None = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(presented, digest):  # no break: the loop's time must not depend on the match
                found = tenant
        return found

    def __repr__(self) -> str:
        return f"Policy({self.source!r}, tenants={sorted(self.tenants)})"  # never the keys

    # -- reading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"{source}: cannot read the policy file: {exc}") from None
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            data = loader.construct_document(root) if root is not None else None
        except yaml.YAMLError as exc:
            # PyYAML's message quotes the offending text, which may be a key: say only where it is.
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise PolicyError(f"{source}: invalid YAML{where}") from None
        finally:
            loader.dispose()
        if root is not None:
            _refuse_duplicate_keys(root, source)
        return cls.parse(data, source=source)

    @classmethod
    def parse(cls, data: Any, *, source: str = "policy") -> Policy:
        if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
            raise PolicyError(f"{source}: expected a mapping with one key, 'tenants' (tenant name -> its keys and "
                              "registries)")
        if not data["tenants"]:
            raise PolicyError(f"{source}: 'tenants' is empty; with no tenant nobody could ask anything")
        tenants: dict[str, Tenant] = {}
        keys: list[tuple[bytes, Tenant]] = []
        owners: dict[bytes, str] = {}
        for name, raw in data["tenants"].items():
            where = f"{source}: tenant {name!r}"
            if not isinstance(name, str) or not name:
                raise PolicyError(f"{source}: tenant names are non-empty strings, got {name!r}")
            raw = _fields(raw, _TENANT_FIELDS, where)
            agent_tools = raw.get("agent_tools", False)
            tenant = Tenant(name=name, registries=_grants(raw, where), admin=_admin(raw, where),
                            agent_tools=None if agent_tools is False else _grant(
                                {} if agent_tools is True else agent_tools, f"{where}, agent_tools"))
            tenants[name] = tenant
            for position, digest in enumerate(_digests(raw, where), start=1):
                if digest in owners:  # two tenants, one key: which one asks would be a coin toss
                    raise PolicyError(f"{where}: key {position} is also a key of tenant {owners[digest]!r}; "
                                      "every key belongs to one tenant")
                owners[digest] = name
                keys.append((digest, tenant))
        return cls(tenants, keys, source=source)


def _fields(raw: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: expected a mapping with {sorted(allowed)}, got {type(raw).__name__}")
    unknown = sorted(map(str, set(raw) - allowed))
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    return raw


def _digests(raw: dict[str, Any], where: str) -> list[bytes]:
    entries = raw.get("keys")
    if not isinstance(entries, list) or not entries:
        raise PolicyError(f"{where}: 'keys' must be a non-empty list of API keys (or 'sha256:<hex>' digests)")
    digests = []
    for position, entry in enumerate(entries, start=1):
        if not isinstance(entry, str):
            raise PolicyError(f"{where}: key {position} must be a string, got {type(entry).__name__}")
        match = _DIGEST.fullmatch(entry)
        if match is not None:
            digests.append(bytes.fromhex(match.group(1)))
        elif entry.startswith("sha256:"):
            raise PolicyError(f"{where}: key {position} starts with 'sha256:' but is not 64 lowercase hex digits")
        elif len(entry) < MIN_KEY_CHARS:
            raise PolicyError(f"{where}: key {position} has fewer than {MIN_KEY_CHARS} characters; use a long random "
                              "key (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        else:
            digests.append(key_digest(entry))
    if len(set(digests)) != len(digests):
        raise PolicyError(f"{where}: the same key is listed twice")
    return digests


def _admin(raw: dict[str, Any], where: str) -> bool:
    admin = raw.get("admin", False)
    if not isinstance(admin, bool):
        raise PolicyError(f"{where}: 'admin' must be true or false, got {admin!r}")
    return admin


def _grants(raw: dict[str, Any], where: str) -> dict[str, Grant]:
    registries = raw.get("registries")
    if not isinstance(registries, dict) or not registries:
        raise PolicyError(f"{where}: 'registries' must be a non-empty mapping of registry name -> allow/deny")
    return {str(registry): _grant(grant, f"{where}, registry {registry!r}") for registry, grant in registries.items()}


def _grant(raw: Any, at: str) -> Grant:
    fields = _fields({} if raw is None else raw, _GRANT_FIELDS, at)
    allow = fields.get("allow")
    return Grant(allow=None if allow is None else _entries(allow, f"{at}, allow"),
                 deny=_entries(fields.get("deny", []), f"{at}, deny"),
                 pin=_entries(fields.get("pin", []), f"{at}, pin"))


def _entries(raw: Any, where: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(entry, str) and entry for entry in raw):
        raise PolicyError(f"{where}: expected a list of tool names or tags, got {raw!r}")
    return tuple(raw)


def _refuse_duplicate_keys(node: yaml.Node, source: str) -> None:
    """A second ``acme:`` would silently replace the first tenant."""
    found = first_duplicate_key(node)
    if found is not None:
        _, line, first = found
        # Not quoting the field: under a misshapen 'keys' it could be an API key.
        raise PolicyError(f"{source}:{line}: a field is given twice (first at line {first})")


# -- serving without a policy -----------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); a name is never resolved."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_open_binding(host: str, policy: Policy | None) -> None:
    """Without a policy every client may ask anything, so the server may listen on loopback only."""
    if policy is None and not is_loopback(host):
        raise PolicyError(f"--host {host} without --policy would serve every tool to anyone who can reach it; "
                          "give a policy file (API keys per tenant, see README) or bind 127.0.0.1")
