"""Routing leaks no tenant's prompt to another: bob, scoring candidate prompts with
``/v1/route`` against an engine shared by every tenant, learns nothing of what alice's
requests cached there; and no tenant points the node at an engine it may not follow (loopback
and ``ipc://`` endpoints, another tenant's or a shared engine's endpoint)."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sessioncache.hashing import Namespace, block_hashes, tenant_namespace
from tests.security.conftest import ALICE, BOB, NodeFactory, client, wait_until
from tests.support import vllm_events as ve
from tests.support.servers import free_port

BLOCK = 16
NS = {"model": "leak-model", "block_tokens": BLOCK, "kv_dtype": "bf16", "kv_layout": "x"}
SALTS = {"alice": "salt-of-alice-4f1c9a", "bob": "salt-of-bob-77d2e0"}
DIGITS = [48 + d for d in range(10)]  # the tokens of "0".."9"
PREFIXES = "SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES"


def loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def digit_block(position: int, digit: int) -> list[int]:
    """One block of alice's prompt: text, then one digit of the secret as its last token."""
    return [1000 + 37 * position + i for i in range(BLOCK - 1)] + [DIGITS[digit]]


def secret_prompt(secret: list[int]) -> list[int]:
    return [t for position, d in enumerate(secret) for t in digit_block(position, d)]


@pytest.fixture
def shared_engine() -> Iterator[ve.Publisher]:
    publisher = ve.Publisher(loopback(), None, legacy=False)
    yield publisher
    publisher.close()


def ids_b64(namespace: Namespace, tokens: list[int]) -> str:
    return base64.b64encode(b"".join(block_hashes(namespace, tokens))).decode()


def shared_score(c: httpx.Client, body: dict[str, Any]) -> float:
    """The shared engine's score for a prompt (0 when the answer leaves the engine out)."""
    r = c.post("/v1/route", json={"namespace": NS, **body})
    assert r.status_code == 200, r.text
    return max((e["score"] for e in r.json()["engines"] if e["engine_id"] == "shared-0"), default=0)


def test_bob_learns_no_digit_of_alices_prompt_on_a_shared_engine(
    guarded_node: NodeFactory, shared_engine: ve.Publisher
) -> None:
    """Alice's requests to the shared engine carry her cache salt (vLLM reports it in the
    first block's extra keys); the engine caches her prompt, four blocks each ending with one
    digit of her secret. Bob scores, position by position, the ten candidate blocks after the
    digits he has recovered: by tokens, by ids under the unsalted root and by ids under
    alice's root (computable by anyone who knows her name). No digit may score apart from
    the others; alice herself is still routed to her prefix."""
    engines = [{"engine_id": "shared-0", "namespace": NS, "endpoint": shared_engine.endpoint}]
    node = guarded_node(
        {
            "SESSIONCACHE_ENGINES": json.dumps(engines),
            "SESSIONCACHE_TENANT_CACHE_SALTS": json.dumps(SALTS),
        }
    )
    secret = [7, 2, 9, 4]
    prompt = secret_prompt(secret)
    rng = random.Random(11)
    shared_engine.wait_subscriber()
    alices: list[tuple[Any, ...] | None] = [(SALTS["alice"],), None, None, None]
    hashes = [rng.getrandbits(64) for _ in secret]
    bobs = digit_block(9, 0)
    shared_engine.publish(
        [
            ve.stored(False, hashes, None, prompt, BLOCK, extra_keys=alices),
            ve.stored(
                False, [rng.getrandbits(64)], None, bobs, BLOCK, extra_keys=[(SALTS["bob"],)]
            ),
        ]
    )
    shared_engine.flush()
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        assert wait_until(lambda: alice.get("/v1/engines/shared-0").json()["last_seq"] == 0, 20)

        ns = Namespace("leak-model", BLOCK, "bf16", "x")  # NS
        forms: dict[str, Callable[[list[int]], dict[str, Any]]] = {
            "tokens": lambda tokens: {"tokens": tokens},
            "unsalted ids": lambda tokens: {"block_ids_b64": ids_b64(ns, tokens)},
            "alice's ids": lambda tokens: {
                "block_ids_b64": ids_b64(tenant_namespace(ns, "alice"), tokens)
            },
        }
        calls = 0
        recovered: dict[str, list[int]] = {}
        for form, body in forms.items():
            known: list[int] = []
            for position in range(len(secret)):
                scores = []
                for d in range(10):
                    calls += 1
                    candidate = secret_prompt(known) + digit_block(position, d)
                    scores.append(shared_score(bob, body(candidate)))
                if len(set(scores)) == 1:
                    break  # no digit stands out: bob learns nothing past this position
                known.append(scores.index(max(scores)))
            recovered[form] = known
        print(f"{calls} route calls by bob; digits recovered: {recovered} (secret {secret})")
        assert recovered == {form: [] for form in forms}, f"in {calls} route calls"
        assert shared_score(alice, {"tokens": prompt}) == len(prompt)
        assert shared_score(bob, {"tokens": bobs}) == BLOCK
        assert shared_score(alice, {"tokens": bobs}) == 0


def register(
    c: httpx.Client, engine_id: str, endpoint: str, replay: str | None = None
) -> httpx.Response:
    body: dict[str, Any] = {"engine_id": engine_id, "namespace": NS, "endpoint": endpoint}
    if replay is not None:
        body["replay_endpoint"] = replay
    return c.post("/v1/engines", json=body)


def refused(r: httpx.Response, status: int, *words: str) -> bool:
    return r.status_code == status and all(w in r.json()["detail"] for w in words)


def test_keyed_tenants_follow_no_loopback_or_ipc_endpoint_by_default(
    guarded_node: NodeFactory,
) -> None:
    """By default a keyed tenant registers only ``tcp://`` endpoints at an IP address off
    this host (the node would dial the rest on the tenant's behalf: its own host's services,
    local sockets); an endpoint one tenant follows is refused to the other, and the answer
    does not say whose it is."""
    shared = [{"engine_id": "shared-0", "namespace": NS, "endpoint": "tcp://192.0.2.1:5557"}]
    node = guarded_node({"SESSIONCACHE_ENGINES": json.dumps(shared)})
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        for endpoint in (
            loopback(),
            "tcp://localhost:5557",
            "tcp://127.7.7.7:5557",
            "tcp://[::1]:5557",
            "tcp://[::ffff:127.0.0.1]:5557",
            "tcp://0.0.0.0:5557",
            "tcp://192.0.2.7;127.0.0.1:5557",  # a source address, then the loopback
            "ipc:///tmp/engine.sock",
            "inproc://engine",
        ):
            r = register(alice, "e", endpoint)
            assert refused(r, 403, PREFIXES), (endpoint, r.text)
        assert refused(register(alice, "e", "tcp://192.0.2.7:5557", loopback()), 403, PREFIXES)

        assert (
            register(alice, "e", "tcp://192.0.2.7:5557", "tcp://192.0.2.7:5558").status_code == 201
        )
        for endpoint, replay in (
            ("tcp://192.0.2.7:5557", None),
            ("tcp://192.0.2.7:05557", None),  # the same endpoint, spelled otherwise
            ("tcp://192.0.2.8:5557", "tcp://192.0.2.7:5558"),  # alice's replay socket
            ("tcp://192.0.2.1:5557", None),  # the shared engine's
        ):
            r = register(bob, "e", endpoint, replay)
            assert refused(r, 409, "already"), (endpoint, r.text)
            assert "alice" not in r.text
        assert register(bob, "e", "tcp://192.0.2.8:5557").status_code == 201
        assert alice.delete("/v1/engines/e").status_code == 204
        assert register(bob, "f", "tcp://192.0.2.7:5557").status_code == 201


def test_the_setting_names_the_endpoints_tenants_may_follow(guarded_node: NodeFactory) -> None:
    """``SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES`` replaces the default: loopback and ``ipc://``
    endpoints under a listed prefix are followed, anything else is refused; two tenants still
    never follow one endpoint."""
    ipc = "ipc:///tmp/sessioncache-engines/"
    node = guarded_node({PREFIXES: json.dumps(["tcp://127.0.0.1:", ipc])})
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        mine = loopback()
        assert register(alice, "a", mine).status_code == 201
        assert register(alice, "b", f"{ipc}alice.sock").status_code == 201
        for endpoint in (f"{ipc}../elsewhere.sock", "tcp://192.0.2.7:5557", "tcp://[::1]:5557"):
            r = register(alice, "c", endpoint)
            assert refused(r, 403, PREFIXES), (endpoint, r.text)
        assert refused(register(bob, "a", mine), 409, "already")
        assert refused(register(bob, "b", f"{ipc}./alice.sock"), 409, "already")
        assert register(bob, "a", loopback()).status_code == 201


def test_an_open_node_follows_any_endpoint(guarded_node: NodeFactory) -> None:
    """Without API keys (one tenant, loopback clients only) nothing changes."""
    node = guarded_node({"SESSIONCACHE_API_KEYS": "{}"})
    with client(node, {}) as c:
        endpoint = loopback()
        assert register(c, "a", endpoint).status_code == 201
        assert register(c, "b", endpoint).status_code == 201
        assert register(c, "c", "ipc:///tmp/sessioncache-open.sock").status_code == 201
