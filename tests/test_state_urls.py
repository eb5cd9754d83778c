"""`--redis-url` names one Redis, a Redis Cluster or a Sentinel-managed primary; a URL that
names none is one line at start-up (`gateway serve`, `gateway check`), never a traceback."""

from __future__ import annotations

import subprocess

import pytest

from gateway.state.urls import CLUSTER, MEMORY, SENTINEL, SINGLE, parse_url
from tests.servers import ROOT, gateway_cmd

POLICY = str(ROOT / "policies" / "demo.yaml")


def test_the_three_kinds() -> None:
    assert parse_url(None).kind == parse_url("memory://").kind == MEMORY
    assert parse_url("redis://127.0.0.1:6379/0").kind == SINGLE
    assert parse_url("rediss://:pw@redis.example:6380/1").kind == SINGLE
    c = parse_url("redis+cluster://127.0.0.1:7000,127.0.0.1:7001,[::1]:7002/")
    assert c.kind == CLUSTER and c.nodes == (("127.0.0.1", 7000), ("127.0.0.1", 7001),
                                              ("::1", 7002))
    s = parse_url("redis+sentinel://app:s%40cret@sentinel-0:26379,sentinel-1:26379/mymaster/2")
    assert s.kind == SENTINEL and s.service == "mymaster" and s.db == 2
    assert s.nodes == (("sentinel-0", 26379), ("sentinel-1", 26379))
    assert (s.username, s.password) == ("app", "s@cret")
    assert "s@cret" not in repr(s)


@pytest.mark.parametrize(("url", "says"), [
    ("redis+clustr://a:1", "unknown scheme 'redis+clustr'"),
    ("127.0.0.1:6379", "expected redis://host:port"),
    ("redis+cluster://a:1,b", "each node must be host:port, got 'b'"),
    ("redis+cluster://a:1,b:99999", "each node must be host:port, got 'b:99999'"),
    ("redis+cluster://a:1/2", "database 0 only"),
    ("redis+cluster://a:1?ssl=true", "no query parameters"),
    ("redis+sentinel://a:26379", "service_name"),
    ("redis+sentinel://a:26379/mymaster/x", "must be a number, got 'x'"),
    ("redis+sentinel://a:26379,:26380/mymaster", "each Sentinel must be host:port"),
    ("redis+sentinel://a:26379/m?password=x", "takes only ?sentinel_username"),
    ("redis+sentinel://a:26379/m?sentinel_password=x&sentinel_password=y", "each once"),
    ("rediss+sentinel://a:26379/m?sentinel_password", "takes only ?sentinel_username"),
])
def test_a_wrong_url_is_one_line_at_start_up(url: str, says: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_url(url)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    for cmd in (gateway_cmd("serve", "--policy", POLICY, "--port", "1", "--redis-url", url),
                gateway_cmd("check", "--redis-url", url, POLICY)):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (cmd, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, lines
        assert lines[0].startswith(f"gateway {cmd[1]}: --redis-url: "), lines


def test_tls_and_the_sentinels_own_password() -> None:
    c = parse_url("rediss+cluster://app:pw@a:7000,b:7001")
    assert (c.kind, c.tls, c.nodes, c.password) == (CLUSTER, True, (("a", 7000), ("b", 7001)),
                                                     "pw")
    assert not parse_url("redis+cluster://a:7000").tls
    s = parse_url("rediss+sentinel://app:pw@s0:26379,s1:26379/mymaster/1"
                  "?sentinel_username=watch&sentinel_password=s%26nt")
    assert (s.kind, s.tls, s.service, s.db) == (SENTINEL, True, "mymaster", 1)
    assert (s.username, s.password) == ("app", "pw")
    assert (s.sentinel_username, s.sentinel_password) == ("watch", "s&nt")
    assert "s&nt" not in repr(s)
    plain = parse_url("redis+sentinel://s0:26379/mymaster")
    assert (plain.tls, plain.sentinel_username, plain.sentinel_password) == (False, None, None)
    with pytest.raises(ValueError) as raised:
        parse_url("redis+sentinel://s0:26379/m?sentinel_password=hunter2&x=1")
    assert "hunter2" not in str(raised.value) and "sentinel_password=***" in str(raised.value)


def test_a_password_never_reaches_the_message() -> None:
    with pytest.raises(ValueError) as raised:
        parse_url("redis+cluster://app:hunter2@a:1,b")
    assert "hunter2" not in str(raised.value) and "app:***@" in str(raised.value)


def test_check_names_the_state_it_would_use() -> None:
    done = subprocess.run(gateway_cmd("check", "--redis-url",
                                      "redis+sentinel://127.0.0.1:26379/mymaster", POLICY),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "state: primary 'mymaster' (db 0) named by the Sentinels at 127.0.0.1:26379")
    done = subprocess.run(gateway_cmd(
        "check", "--redis-url", "rediss+sentinel://127.0.0.1:26379/mymaster?sentinel_password=p",
        POLICY), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == (
        "state: primary 'mymaster' (db 0) named by the Sentinels at 127.0.0.1:26379, over TLS, "
        "Sentinels asked with a password")
    done = subprocess.run(gateway_cmd("check", "--state-prefix", "gw{x}", POLICY),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--state-prefix" in done.stderr, done.stderr
