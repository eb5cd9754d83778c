"""What `--redis-url` names: one Redis, a Redis Cluster, or a primary that Sentinels manage.

    redis://[user:password@]host:port[/db]       one Redis (also rediss://, unix://)
    redis+cluster://[user:password@]host:port,host:port,...[/0]
                                                 a Redis Cluster: any of its nodes, to start from
    redis+sentinel://[user:password@]host:port,host:port,.../service_name[/db]
                  [?sentinel_username=U&sentinel_password=P]
                                                 the primary the Sentinels name `service_name`
    rediss+cluster://..., rediss+sentinel://...  the same over TLS (Sentinels and data nodes)

The user and password are the data nodes' (the cluster's nodes, the Sentinel-managed primary);
Sentinels are asked with `sentinel_username` / `sentinel_password` when the URL gives them
(Sentinel's own `requirepass`, which need not be the primary's), else without. Parsed here,
before anything connects, so a wrong URL is one line at start-up (`gateway serve`,
`gateway check --redis-url`), never a traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

MEMORY, SINGLE, CLUSTER, SENTINEL = "memory", "redis", "cluster", "sentinel"
EXPECTED = ("redis://host:port[/db], redis+cluster://host:port,host:port[/0] or "
            "redis+sentinel://host:port,host:port/service_name[/db] (rediss+...:// for TLS)")
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>\d+)$")
_SERVICE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class StateURL:
    kind: str  # MEMORY, SINGLE, CLUSTER or SENTINEL
    url: str  # as given (SINGLE: passed to redis-py's from_url)
    nodes: tuple[tuple[str, int], ...] = ()  # CLUSTER: startup nodes; SENTINEL: the Sentinels
    service: str = ""  # SENTINEL: the primary's name in the Sentinels' configuration
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False  # CLUSTER, SENTINEL: rediss+...:// (SINGLE: redis-py reads rediss://)
    sentinel_username: str | None = None  # SENTINEL: how to authenticate to the Sentinels
    sentinel_password: str | None = field(default=None, repr=False)


def parse_url(url: str | None) -> StateURL:
    """The state backend `url` names; ValueError (one line, naming what is wrong) if none."""
    if not url or url == "memory://":
        return StateURL(MEMORY, "")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"--redis-url: expected {EXPECTED}, got {safe(url)!r}")
    if scheme in ("redis", "rediss", "unix"):
        return StateURL(SINGLE, url)
    tls = scheme.startswith("rediss+")
    if tls:
        scheme = "redis+" + scheme.removeprefix("rediss+")
    if scheme not in ("redis+cluster", "redis+sentinel"):
        raise ValueError(f"--redis-url: unknown scheme {scheme!r}: expected {EXPECTED}")
    rest, _, query = rest.partition("?")
    if "#" in rest or "#" in query or (query and scheme == "redis+cluster"):
        raise ValueError(f"--redis-url: {scheme}:// takes no query parameters or fragment, got "
                         f"{safe(url)!r}")
    sentinel_auth = _sentinel_auth(query, url)
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    nodes = tuple(_node(part, scheme, url) for part in netloc.split(","))
    segments = [s for s in path.split("/") if s] if path else []
    if scheme == "redis+cluster":
        if segments not in ([], ["0"]):
            raise ValueError(f"--redis-url: a Redis Cluster has database 0 only; expected "
                             f"redis+cluster://host:port,host:port[/0], got {safe(url)!r}")
        return StateURL(CLUSTER, url, nodes, username=username, password=password, tls=tls)
    if not segments or len(segments) > 2 or not _SERVICE.match(segments[0]):
        raise ValueError("--redis-url: expected redis+sentinel://host:port,host:port/"
                         f"service_name[/db] (the primary's name in the Sentinels' "
                         f"configuration), got {safe(url)!r}")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise ValueError(f"--redis-url: the database after the service name must be a "
                             f"number, got {segments[1]!r}")
        db = int(segments[1])
    return StateURL(SENTINEL, url, nodes, segments[0], db, username, password, tls,
                    *sentinel_auth)


_SENTINEL_KEYS = ("sentinel_username", "sentinel_password")


def _sentinel_auth(query: str, url: str) -> tuple[str | None, str | None]:
    """`sentinel_username` and `sentinel_password` from a Sentinel URL's query, decoded."""
    if not query:
        return None, None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        pairs = [("", "")]
    given = dict(pairs)
    unknown = [k for k, _ in pairs if k not in _SENTINEL_KEYS]
    if unknown or len(given) != len(pairs):
        raise ValueError(f"--redis-url: a Sentinel URL takes only ?sentinel_username=...&"
                         f"sentinel_password=... (each once), got {safe(url)!r}")
    return given.get("sentinel_username") or None, given.get("sentinel_password")


def _node(part: str, scheme: str, url: str) -> tuple[str, int]:
    m = _HOST_PORT.match(part)
    port = int(m["port"]) if m else 0
    if m is None or not 0 < port < 65536:
        what = "node" if scheme == "redis+cluster" else "Sentinel"
        raise ValueError(f"--redis-url: each {what} must be host:port, got {part!r} in "
                         f"{safe(url)!r}")
    return (m["v6"] or m["host"], port)


def check_prefix(prefix: str) -> str:
    """A key prefix that keeps every script's keys in one Redis Cluster slot: no braces (a
    `{` in the prefix would move the hash tag off the pool's name), not empty."""
    if not prefix or "{" in prefix or "}" in prefix:
        raise ValueError(f"--state-prefix: expected a non-empty prefix without braces (the "
                         f"keys' {{pool}} hash tag must be the first braces), got {prefix!r}")
    return prefix


def state_problem(url: str | None, prefix: str) -> str | None:
    """What is wrong with `--redis-url` or `--state-prefix`, in one line; None if nothing."""
    try:
        parse_url(url)
        check_prefix(prefix)
    except ValueError as exc:
        return str(exc)
    return None


def safe(url: str) -> str:
    """`url` without its passwords (the user's and the Sentinels'), for logs and messages."""
    url = re.sub(r"([?&]sentinel_password=)[^&#]*", r"\1***", url)
    return re.sub(r"^([^:/]+://[^:@/]*):[^@]*@", r"\1:***@", url)
