"""The edges of HTTP itself: a request head's size and time, idle connections, bodies that
never come or are malformed, paths with a trailing slash, compressed bodies, the admin port's
address; and `gateway demo`'s port check.

Raw sockets where the point is how the bytes arrive (at once, in pieces, a byte at a time, not
at all), since an HTTP client library would not send them that way.
"""

from __future__ import annotations

import gzip
import json
import select
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.tenancy.auth import hash_key
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import ROOT, Server, bearer, free_port, gateway_cmd, http, poll_metric

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "test-model", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def read_reply(s: socket.socket, deadline_s: float = 10.0) -> bytes:
    """One response: its head and as much body as content-length says (or all until EOF)."""
    end = time.monotonic() + deadline_s
    reply = b""
    while time.monotonic() < end:
        head, sep, body = reply.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(body) >= length:
                return reply
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return reply
        if not chunk:
            return reply
        reply += chunk
    raise AssertionError(f"no whole reply within {deadline_s}s: {reply[:200]!r}")


def parse(reply: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines)}
    return int(status_line.split()[1]), headers, json.loads(body) if body else None


def send(port: int, pieces: list[bytes]) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before the rest was sent: the reply is what counts
        return read_reply(s)


def closed_after(s: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closed `s` (failing past `limit_s`), and what it sent."""
    start = time.monotonic()
    s.settimeout(limit_s)
    reply = b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {limit_s}s") from None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return time.monotonic() - start, reply
        reply += chunk
        s.settimeout(max(0.01, limit_s - (time.monotonic() - start)))


def assert_openai_error(reply: bytes, status: int, code: str) -> dict[str, str]:
    got, headers, body = parse(reply)
    assert got == status, reply[:300]
    assert headers["content-type"] == "application/json"
    assert body["error"]["type"] == ("not_found_error" if status == 404
                                     else "invalid_request_error")
    assert body["error"]["code"] == code and body["error"]["message"]
    return headers


# --- the request head: size ---------------------------------------------------------------


def request_with_head_of(size: int, shape: str, line: bytes = b"POST " + CHAT.encode()) -> bytes:
    start = (line + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"
             b"content-type: application/json\r\ncontent-length: %d\r\n" % len(BODY))
    if shape == "one header":
        filler = b"x-filler: " + b"a" * (size - len(start)) + b"\r\n"
    else:
        filler = b"".join(b"x-filler-%04d: %s\r\n" % (i, b"a" * 984)
                          for i in range((size - len(start)) // 1000))
    return start + filler + b"\r\n" + BODY


def in_pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def test_header_limit_holds_however_the_head_arrives(start_gateway: StartGateway) -> None:
    """70, 100 and 180 KB heads were served (200) when they came in one read, and refused only
    when they came in pieces; 431 in OpenAI's shape both ways now, and a head under the
    limit is served both ways."""
    with start_gateway(policy_yaml([f"http://127.0.0.1:{free_port()}"])) as gw:
        for shape in ("one header", "many headers"):
            for kb in (70, 100, 180):
                request = request_with_head_of(kb * 1000, shape)
                for pattern, pieces in (("at once", [request]),
                                        ("16 KB pieces", in_pieces(request, 16 * 1024))):
                    reply = send(gw.port, pieces)
                    assert parse(reply)[0] == 431, (shape, kb, pattern, reply[:200])
                    assert_openai_error(reply, 431, "request_header_fields_too_large")
            under = request_with_head_of(60 * 1000, shape, b"GET /healthz")
            for pieces in ([under], in_pieces(under, 16 * 1024)):
                assert parse(send(gw.port, pieces))[0] == 200, shape
        assert http("POST", gw.url + CHAT, b"{}").status == 400  # the server is fine


# --- the request head: time, and idle connections ----------------------------------------


def test_slow_and_idle_connections_are_closed(start_gateway: StartGateway) -> None:
    """A request line and one header, then nothing, kept the connection open for more than
    100 s; so did a head sent a byte at a time, and a keep-alive connection given one byte.
    Now the head has `header_timeout_s`, an idle connection `keep_alive_timeout_s`."""
    extra = "server: {header_timeout_s: 1, keep_alive_timeout_s: 1}\n"
    limit = 1 + 1 + 1.5  # the timeout, the drain before closing, slack for a loaded machine
    with start_gateway(policy_yaml([f"http://127.0.0.1:{free_port()}"], extra=extra)) as gw:
        address = ("127.0.0.1", gw.port)
        # Part of a head, then silence: 408, then closed.
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
            elapsed, reply = closed_after(s, limit)
        assert elapsed > 0.8
        assert_openai_error(reply, 408, "request_timeout")
        # A head trickled a byte every 0.1 s: the limit is on the whole head, not each read.
        with socket.create_connection(address, timeout=10) as s:
            start = time.monotonic()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
            for _ in range(int(limit / 0.1)):
                if select.select([s], [], [], 0.1)[0]:
                    break  # answered
                try:
                    s.send(b"a")
                except (BrokenPipeError, ConnectionResetError):
                    break
            _, reply = closed_after(s, max(0.1, limit - (time.monotonic() - start)))
        assert time.monotonic() - start < limit
        assert_openai_error(reply, 408, "request_timeout")
        # Connected, and nothing sent: closed, nothing said.
        with socket.create_connection(address, timeout=10) as s:
            elapsed, reply = closed_after(s, limit)
        assert reply == b"" and elapsed > 0.8
        # Keep-alive: a response, then idle; then a response, then one byte of the next.
        for then in (b"", b"G"):
            with socket.create_connection(address, timeout=10) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                assert parse(read_reply(s))[0] == 200
                s.sendall(then)
                elapsed, reply = closed_after(s, limit)
            if then:
                assert_openai_error(reply, 408, "request_timeout")
            else:
                assert reply == b""
        # A prompt caller on the same server is unaffected.
        with socket.create_connection(address, timeout=10) as s:
            for _ in range(3):  # keep-alive still works for requests that come in time
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                assert parse(read_reply(s))[0] == 200
                time.sleep(0.3)


def test_a_request_whose_body_never_comes_is_answered_and_closed(
        start_gateway: StartGateway) -> None:
    """Issue 43: an answer given before the body came (a GET declaring a body, a bad key's
    401) and the gateway's own 408 for a late body left the connection open for ever, past
    every timeout (the next request on it read as the old body); enough such connections held
    the server at its cap, every request 503. Now each answer says `connection: close` and
    the connection closes; a malformed chunked body is uvicorn's 400 at once, not a 408 30 s
    later."""
    key = "sk-edge"
    extra = f"""server: {{body_timeout_s: 1}}
auth:
  require_keys: true
tenants:
  - name: team
    api_keys: ["{hash_key(key)}"]
"""
    limit = 1 + 1 + 1.5  # the body timeout, the drain before closing, slack
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n")
    with start_gateway(policy_yaml([f"http://127.0.0.1:{free_port()}"], extra=extra)) as gw:
        address = ("127.0.0.1", gw.port)
        for request, status in (
                (b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 10\r\n\r\n",
                 200),
                (head + b"authorization: Bearer sk-wrong\r\ncontent-length: 100\r\n\r\n{",
                 401),
                (head + b"authorization: Bearer %s\r\ncontent-length: 100\r\n\r\n{"
                 % key.encode(), 408)):
            with socket.create_connection(address, timeout=10) as s:
                s.sendall(request)
                reply = read_reply(s)
                got, headers, _ = parse(reply)
                assert (got, headers.get("connection")) == (status, "close"), reply[:300]
                if status == 408:
                    assert_openai_error(reply, 408, "request_timeout")
                # What comes next is no request, nor the rest of the old body: unanswered.
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                assert closed_after(s, limit)[1] == b""
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(head + b"authorization: Bearer %s\r\ntransfer-encoding: chunked\r\n\r\n"
                      % key.encode())
            time.sleep(0.2)  # the gateway waits for the body
            s.sendall(b"ffffffffffffffffff\r\n")  # a chunk size that overflows
            start = time.monotonic()
            reply = read_reply(s, deadline_s=limit)
            assert time.monotonic() - start < 1.0
            # uvicorn's own answer to what it cannot parse: text, not OpenAI's shape (what
            # sends it is no SDK), and a close.
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"\r\nconnection: close" in head
            assert body == b"Invalid HTTP request received."
            closed_after(s, limit)
        assert parse(send(gw.port, [b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"]))[0] == 200


# --- paths and bodies ---------------------------------------------------------------------


def test_a_caller_gone_mid_body_is_counted_and_logged_as_499(
        start_gateway: StartGateway) -> None:
    """A caller that leaves before its request goes upstream (here mid-body) was in no metric
    and no access log line: now a 499, as one that leaves later is."""
    with start_gateway(policy_yaml([f"http://127.0.0.1:{free_port()}"])) as gw:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                      b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
                      b'{"model": "test-model", ')
            time.sleep(0.3)
        poll_metric(gw.url, "gateway_requests_total", lambda v: v == 1, status="499")
        deadline = time.monotonic() + 5  # the access log is written in batches
        while '"status":499' not in gw.log_path.read_text():
            assert time.monotonic() < deadline, gw.log_path.read_text()
            time.sleep(0.1)


def test_trailing_slash_is_404_and_compressed_bodies_415(
        sim_and_gateway: tuple[Server, Server]) -> None:
    """A trailing slash answered 307 to a URL built from the caller's Host header, before
    authentication; a gzip body got 400 "not valid UTF-8"."""
    _, gw = sim_and_gateway
    for method, path in (("POST", CHAT + "/"), ("POST", "/v1/completions/"),
                         ("GET", "/v1/models/"), ("GET", "/healthz/")):
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            s.sendall(b"%s %s HTTP/1.1\r\nhost: evil.example\r\ncontent-type: application/json"
                      b"\r\ncontent-length: %d\r\n\r\n%s"
                      % (method.encode(), path.encode(), len(BODY), BODY))
            headers = assert_openai_error(read_reply(s), 404, "not_found")
        assert "location" not in headers, path
    for path in (CHAT, "/gateway/estimate"):
        for encoding in ("gzip", "br", "GZIP"):
            reply = http("POST", gw.url + path, gzip.compress(BODY),
                         headers={"content-encoding": encoding})
            assert reply.status == 415, (path, encoding, reply.body)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "unsupported_content_encoding"
    reply = http("POST", gw.url + CHAT, BODY, headers={"content-encoding": "identity"})
    assert reply.status == 200, reply.body


# --- the admin port's address -------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses listening on `port`, from /proc/net/tcp (IPv4, hex as the kernel
    writes them: 0100007F is 127.0.0.1)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(address)
    return found


def test_admin_port_has_an_address_of_its_own(start_sim: StartSim,
                                              start_gateway: StartGateway) -> None:
    """--admin-port bound to --host, so a container's 0.0.0.0 exposed the admin API too;
    --admin-host (default 127.0.0.1) is its own."""
    import argparse

    from gateway.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--policy", "p.yaml", "--host", "0.0.0.0", "--admin-port", "9"])
    assert args.host == "0.0.0.0" and args.admin_host == "127.0.0.1"
    admin_port = free_port()
    with start_sim() as sim, start_gateway(
            policy_yaml([sim.url]), "--admin-port", str(admin_port),
            "--admin-host", "127.0.0.1", env={"GATEWAY_ADMIN_KEY": "admin-key"}) as gw:
        assert listening_addresses(admin_port) == {"0100007F"}
        admin = f"http://127.0.0.1:{admin_port}"
        assert http("GET", admin + "/admin/state", headers=bearer("admin-key")).status == 200
        assert http("GET", gw.url + "/admin/state", headers=bearer("admin-key")).status == 404
        reply = http("GET", admin + "/admin/state/", headers=bearer("admin-key"))
        assert reply.status == 404 and "location" not in reply.headers


# --- gateway demo's port check ------------------------------------------------------------


def port_in_time_wait() -> int:
    """A port whose last connection waits in TIME_WAIT on the server's side, as after a demo
    stopped: bound with SO_REUSEADDR, as uvicorn binds."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            conn, _ = listener.accept()
            conn.close()  # the server's end closes first, so it is the one that waits
            assert client.recv(1) == b""
    return port


def test_demo_port_check_ignores_time_wait_and_says_how_to_move_engines(
        tmp_path: Path) -> None:
    """`make demo` again within a minute refused: its check bound without SO_REUSEADDR, so a
    connection in TIME_WAIT made the port "in use", and the message offered --port, which
    moves only the gateway."""
    gateway_port = port_in_time_wait()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", gateway_port))  # what the old check did, and failed on
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        engine_port = int(held.getsockname()[1])
        text = (ROOT / "policies" / "demo.yaml").read_text()
        policy = tmp_path / "demo.yaml"
        policy.write_text(text.replace("8101", str(engine_port))
                          .replace("8102", str(free_port())))
        done = subprocess.run(gateway_cmd("demo", "--port", str(gateway_port),
                                          "--policy", str(policy)),
                              capture_output=True, cwd=ROOT, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert f"port {gateway_port}" not in err  # TIME_WAIT is not in use
    assert f"port {engine_port} (engine default/engine-0, its url in {policy})" in err
    assert "--policy FILE" in err and "--port moves only the gateway" in err
