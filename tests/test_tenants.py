"""Callers and control, against real servers: keys, quotas, priorities, reload, shadow, admin."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from aiohttp import web

from gateway.tenancy.auth import hash_key
from tests.conftest import StartGateway, StartSim, policy_yaml
from tests.servers import (
    bearer,
    free_port,
    gateway_cmd,
    http,
    metric,
    openai_client,
    quiet,
    run_server,
    scrape,
)
from tests.stand_ins import CHAT_OK, StandIn, running

KEY_A, KEY_B, KEY_SHED, ADMIN = "sk-team-a", "sk-team-b", "sk-batch", "sk-admin-secret"
MESSAGES = [{"role": "user", "content": "Hello there, how are you today?"}]


def policy(engine: str, *, require_keys: bool = True, tenants_extra: str = "",
           pool_extra: str = "", extra: str = "") -> str:
    return policy_yaml([engine], pool_extra=pool_extra, extra=f"""
auth:
  require_keys: {str(require_keys).lower()}
  admin_keys: ["{hash_key(ADMIN)}"]
  upstream_api_key_env: TEST_UPSTREAM_KEY
tenants:
  - name: team-a
    api_keys: ["{hash_key(KEY_A)}"]
    priority: critical
  - name: team-b
    api_keys: ["{hash_key(KEY_B)}"]
    tokens_per_minute: 600
    models: [test-model]
  - name: batch
    api_keys: ["{hash_key(KEY_SHED)}"]
    priority: sheddable
{tenants_extra}
{extra}""")


UNKNOWN = "sk-unknown"  # a key the policy does not know: the SDK insists on sending one


# --- an engine stand-in that records what reached it (we do not own vLLM) ---------------

class EchoEngine(StandIn):
    """Keeps the headers of every chat request it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []

    async def chat(self, req: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in req.headers.items()})
        return web.json_response(CHAT_OK)


@pytest.fixture
def echo() -> Iterator[EchoEngine]:
    with running(EchoEngine()) as engine:
        yield engine


def test_keys_accepted_refused_and_never_forwarded(echo: EchoEngine,
                                                   start_gateway: StartGateway) -> None:
    env = {"TEST_UPSTREAM_KEY": "engine-secret"}
    with start_gateway(policy(echo.url), env=env) as gw:
        body = json.dumps({"model": "test-model", "messages": MESSAGES}).encode()
        reply = http("POST", gw.url + "/v1/chat/completions", body)
        assert reply.status == 401
        assert "didn't provide an API key" in reply.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError) as err:
            openai_client(gw.url, api_key="sk-wrong").chat.completions.create(
                model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
        assert err.value.code == "invalid_api_key"
        assert err.value.message.endswith("Incorrect API key provided.")
        resp = openai_client(gw.url, api_key=KEY_A).chat.completions.create(
            model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
            extra_headers={"connection": "keep-alive, x-hop", "x-hop": "1",
                           "proxy-authorization": "Basic Zm9v"})
        assert resp.choices[0].message.content == "ok"
        seen = echo.headers[-1]
        assert seen["authorization"] == "Bearer engine-secret"  # the policy's key, not theirs
        assert KEY_A not in json.dumps(echo.headers)
        assert "proxy-authorization" not in seen and "x-hop" not in seen
        deadline = time.monotonic() + 5
        while '"tenant":"team-a"' not in (log := gw.log()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the access log is written by a background thread
        assert '"tenant":"team-a"' in log
        assert KEY_A not in log and hash_key(KEY_A) not in log
        assert "Hello there" not in log  # prompt text is never logged


def test_model_not_allowed_for_tenant(echo: EchoEngine, start_gateway: StartGateway) -> None:
    text = policy(echo.url).replace("    models: [test-model]\n  - name: batch",
                                    "    models: [other]\n  - name: batch")
    text = text.replace("models:\n  - name: test-model",
                        "models:\n  - {name: other, architecture: llama-3-8b}\n"
                        "  - name: test-model")
    with start_gateway(text) as gw:
        with pytest.raises(openai.PermissionDeniedError) as err:
            openai_client(gw.url, api_key=KEY_B).chat.completions.create(
                model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
        assert "may not use the model `test-model`" in err.value.message


def test_quota_drains_rejects_with_headers_and_refills(echo: EchoEngine,
                                                       start_gateway: StartGateway) -> None:
    # team-b: 600 tokens a minute = 10 a second. Each request reserves prompt + expected
    # output (max_tokens 100) and is reconciled to the engine's usage (18 tokens).
    with start_gateway(policy(echo.url)) as gw:
        c = openai_client(gw.url, api_key=KEY_B)
        raw = c.chat.completions.with_raw_response.create(
            model="test-model", messages=MESSAGES, max_tokens=100)  # type: ignore[arg-type]
        assert raw.headers["x-ratelimit-limit-tokens"] == "600"
        first_remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
        assert 450 <= first_remaining <= 500  # ~115 reserved before forwarding
        # Reconciled to 18 used: the next request sees the difference refunded.
        raw2 = c.chat.completions.with_raw_response.create(
            model="test-model", messages=MESSAGES, max_tokens=100)  # type: ignore[arg-type]
        assert int(raw2.headers["x-ratelimit-remaining-tokens"]) > first_remaining - 40
        with pytest.raises(openai.RateLimitError) as err:
            for _ in range(20):
                c.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=2000)
        h = err.value.response.headers
        assert h["x-ratelimit-limit-tokens"] == "600"
        assert int(h["x-ratelimit-remaining-tokens"]) < 2000
        assert h["x-ratelimit-reset-tokens"].endswith("s")
        assert int(h["retry-after"]) >= 1
        assert "Rate limit reached for tenant `team-b`" in err.value.message
        # Another tenant is not affected; and team-b refills at 10 tokens/s.
        openai_client(gw.url, api_key=KEY_A).chat.completions.create(
            model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
        time.sleep(2.5)
        c.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
        assert metric(scrape(gw.url), "gateway_quota_rejections_total", tenant="team-b") >= 1


def test_priority_orders_the_queue(start_sim: StartSim, start_gateway: StartGateway) -> None:
    admission = "    admission: {kv_usage_max: 0.9, queue_size: 16, queue_wait_max_s: 20}\n"
    with start_sim("--num-gpu-blocks", "40", "--block-size", "16") as sim, \
            start_gateway(policy(sim.url, pool_extra=admission)) as gw:
        order: list[str] = []
        lock = threading.Lock()

        def one(key: str, who: str) -> None:
            openai_client(gw.url, api_key=key).chat.completions.create(
                model="test-model", messages=MESSAGES, max_tokens=150,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True})
            with lock:
                order.append(who)

        with cf.ThreadPoolExecutor(12) as pool:
            # Fill the engine first, then queue sheddable work, then critical work.
            fillers = [pool.submit(one, KEY_A, "filler") for _ in range(3)]
            time.sleep(0.5)
            sheds = [pool.submit(one, KEY_SHED, "sheddable") for _ in range(3)]
            time.sleep(0.3)
            crits = [pool.submit(one, KEY_A, "critical") for _ in range(3)]
            for f in fillers + sheds + crits:
                f.result()
        tail = [w for w in order if w != "filler"]
        assert tail.index("critical") < tail.index("sheddable"), order
        # A caller may lower its priority but never raise it above its tenant's.
        raw = openai_client(gw.url, api_key=KEY_SHED).chat.completions.with_raw_response.create(
            model="test-model", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
            extra_headers={"x-priority": "critical"})
        assert raw.headers["x-gateway-decision"] == "admitted"


def write(path: Path, text: str) -> None:
    path.write_text(text)


def test_reload_valid_keeps_streams_and_invalid_changes_nothing(
        start_sim: StartSim, tmp_path: Path) -> None:
    with start_sim() as sim:
        path = tmp_path / "policy.yaml"
        write(path, policy(sim.url, require_keys=False))
        cmd = gateway_cmd("serve", "--policy", str(path), "--port", "{port}")
        with run_server(cmd, "/healthz", tmp_path, "gw") as gw:
            anon = openai_client(gw.url, api_key=UNKNOWN)
            stream = anon.chat.completions.create(
                model="test-model", messages=MESSAGES, max_tokens=300, stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True})
            it = iter(stream)
            next(it)
            # Valid change: keys become required. In flight, the stream goes on.
            write(path, policy(sim.url, require_keys=True))
            reply = http("POST", gw.url + "/admin/reload", headers=bearer(ADMIN))
            assert reply.status == 200, reply
            rest = list(it)
            assert len(rest) > 100
            with pytest.raises(openai.AuthenticationError):
                anon.chat.completions.create(model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
            # Invalid change: refused with the path of the bad key; the old policy stays.
            write(path, policy(sim.url, require_keys=False).replace("max_model_len: 8192",
                                                                    "max_model_len: lots"))
            reply = http("POST", gw.url + "/admin/reload", headers=bearer(ADMIN))
            assert reply.status == 400
            message = reply.json()["error"]["message"]
            assert "pools.default.max_model_len" in message and "old one stays" in message
            with pytest.raises(openai.AuthenticationError):
                anon.chat.completions.create(model="test-model", messages=MESSAGES)  # type: ignore[arg-type]
            # SIGHUP reloads too.
            write(path, policy(sim.url, require_keys=False))
            gw.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    anon.chat.completions.create(model="test-model", messages=MESSAGES,  # type: ignore[arg-type]
                                                 max_tokens=2)
                    break
                except openai.AuthenticationError:
                    time.sleep(0.1)
            else:
                pytest.fail("SIGHUP did not reload the policy")
            s = quiet(gw.url)
            assert metric(s, "gateway_policy_reloads_total", result="ok") == 2
            assert metric(s, "gateway_policy_reloads_total", result="invalid") == 1
            assert metric(s, "gateway_kv_blocks_reserved") == 0


def test_shadow_mode_counts_but_forwards(start_sim: StartSim,
                                         start_gateway: StartGateway) -> None:
    shadow = "    admission: {kv_usage_max: 0.9, queue_size: 0, shadow: true}\n"
    with start_sim("--num-gpu-blocks", "40", "--block-size", "16") as sim, \
            start_gateway(policy(sim.url, require_keys=False, pool_extra=shadow)) as gw:
        def one(_: int) -> int:
            openai_client(gw.url, api_key=UNKNOWN).chat.completions.create(
                model="test-model", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True})
            return 200

        with cf.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(one, range(6))) == [200] * 6  # all forwarded
        s = quiet(gw.url)
        assert metric(s, "gateway_shadow_decisions_total", decision="rejected") >= 1
        assert metric(s, "gateway_shadow_decisions_total", decision="admitted") >= 1
        assert metric(s, "gateway_admission_decisions_total", decision="rejected") == 0
        assert metric(s, "gateway_kv_blocks_reserved") == 0


def test_admin_api_refuses_tenant_keys_and_can_have_its_own_port(
        echo: EchoEngine, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    write(path, policy(echo.url))
    admin_port = free_port()
    cmd = gateway_cmd("serve", "--policy", str(path), "--port", "{port}",
                      "--admin-port", str(admin_port))
    with run_server(cmd, "/healthz", tmp_path, "gw") as gw:
        admin = f"http://127.0.0.1:{admin_port}"
        # Not on the main port.
        assert http("GET", gw.url + "/admin/state", headers=bearer(ADMIN)).status == 404
        # The admin port also serves health and metrics, from the same runtime.
        assert b"gateway_backend_up" in http("GET", admin + "/metrics").body
        reply = http("GET", admin + "/admin/state", headers=bearer(KEY_A))
        assert reply.status == 401 and reply.json()["error"]["code"] == "invalid_admin_key"
        assert http("GET", admin + "/admin/state").status == 401
        status, _, data = http("GET", admin + "/admin/state", headers=bearer(ADMIN))
        assert status == 200
        body = json.loads(data)
        pool = body["pools"]["default"]
        assert pool["backends"]["e0"]["status"] == "up"
        assert pool["thresholds"]["kv_usage_max"] == {"value": 0.9, "source": "default"}
        assert "latency_guard_limit_tokens" in pool["thresholds"]
        assert [t["name"] for t in body["tenants"]] == ["team-a", "team-b", "batch"]
        status, _, data = http("GET", admin + "/admin/policy", headers=bearer(ADMIN))
        assert status == 200
        body = json.loads(data)
        assert hash_key(KEY_A) not in json.dumps(body)
        assert body["tenants"][0]["api_keys"] == "<1 key(s)>"


def test_admin_disabled_without_admin_key(echo: EchoEngine,
                                          start_gateway: StartGateway) -> None:
    text = policy(echo.url).replace(f'admin_keys: ["{hash_key(ADMIN)}"]', "admin_keys: []")
    with start_gateway(text) as gw:
        reply = http("GET", gw.url + "/admin/state", headers=bearer(ADMIN))
        assert reply.status == 403 and reply.json()["error"]["code"] == "admin_disabled"
