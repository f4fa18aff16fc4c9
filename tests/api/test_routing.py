"""KV-aware routing end to end: simulated vLLM engines publish their KV events on real ZMQ
sockets (both encodings, built as vLLM builds them), a real ``sessioncache serve`` follows
them, and every ``/v1/route`` answer is checked against the engines' plain reference."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from sessioncache.api.schemas_routing import RouteOut
from sessioncache.hashing import Namespace, block_hashes
from tests.api.conftest import KEYS
from tests.support import vllm_events as ve
from tests.support.kv_engines import WEIGHTS, SimEngine
from tests.support.servers import Server, free_port, start_server

BASE_NS = {"model": "route-model", "block_tokens": 16, "kv_dtype": "bf16", "kv_layout": "x"}


def unique_ns(block_tokens: int = 16) -> dict[str, Any]:
    return {**BASE_NS, "model": f"route-{uuid.uuid4().hex[:12]}", "block_tokens": block_tokens}


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Fleet:
    """The engines one test starts, closed at its end."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.engines: dict[str, SimEngine] = {}

    def start(
        self,
        ns: dict[str, Any],
        *,
        legacy: bool = False,
        replay: bool = True,
        buffer_steps: int = 10_000,
        register: bool = True,
        engine_id: str | None = None,
        pub: str | None = None,
        rep: str | None = None,
    ) -> tuple[str, SimEngine]:
        engine_id = engine_id or f"eng-{uuid.uuid4().hex[:8]}"
        pub = pub or endpoint()
        rep = rep or (endpoint() if replay else None)
        publisher = ve.Publisher(pub, rep, legacy=legacy, buffer_steps=buffer_steps)
        engine = SimEngine(ns["block_tokens"], legacy, publisher, seed=len(self.engines))
        self.engines[engine_id] = engine
        if register:
            body = {"engine_id": engine_id, "namespace": ns, "endpoint": pub}
            if rep is not None:
                body["replay_endpoint"] = rep
            r = self.client.post("/v1/engines", json=body)
            assert r.status_code == 201, r.text
            publisher.wait_subscriber()
            self.connected(engine_id)
        return engine_id, engine

    def connected(self, engine_id: str) -> dict[str, Any]:
        """Wait until the node has seen its socket connect (and so asked for the connect's
        replay, if any): what the engine publishes next comes after that replay's start."""
        return self._status_once(engine_id, lambda out: out["connects"] >= 1)

    def _status_once(
        self,
        engine_id: str,
        done: Callable[[dict[str, Any]], bool],
        client: httpx.Client | None = None,
    ) -> dict[str, Any]:
        """The engine's status once ``done`` says so (20 s at most)."""
        deadline = time.monotonic() + 20
        while True:
            out: dict[str, Any] = (client or self.client).get(f"/v1/engines/{engine_id}").json()
            if done(out):
                return out
            assert time.monotonic() < deadline, out
            time.sleep(0.02)

    def sync(self, engine_id: str, client: httpx.Client | None = None) -> dict[str, Any]:
        """Wait until the node has every batch the engine published."""
        publisher = self.engines[engine_id].publisher
        assert publisher is not None
        publisher.flush()
        want = publisher._seq - 1
        return self._status_once(
            engine_id, lambda out: out["last_seq"] is not None and out["last_seq"] >= want, client
        )

    def close(self) -> None:
        for engine in self.engines.values():
            if engine.publisher is not None:
                engine.publisher.close()


@pytest.fixture
def fleet(client: httpx.Client) -> Iterator[Fleet]:
    f = Fleet(client)
    yield f
    f.close()


def route(
    client: httpx.Client, ns: dict[str, Any], prompt: list[int], **extra: Any
) -> dict[str, Any]:
    r = client.post("/v1/route", json={"namespace": ns, "tokens": prompt, **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    RouteOut.model_validate(out)  # the answer is built by hand: it keeps the model's shape
    return out


def check_route(
    client: httpx.Client,
    fleet: Fleet,
    ns: dict[str, Any],
    prompt: list[int],
    lora: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The answer for every engine of the fleet equals its reference, best first."""
    answer = route(client, {**ns, "lora": lora}, prompt, **extra)
    got = {e["engine_id"]: e for e in answer["engines"]}
    for engine_id, engine in fleet.engines.items():
        if engine_id not in got:
            continue
        want = engine.reference(prompt, lora)
        e = got[engine_id]
        assert e["block_tokens"] == engine.block_size
        assert {k: e[k] for k in want} == want, engine_id  # exact: multiples of 1/4
    scores = [e["score"] for e in answer["engines"]]
    assert scores == sorted(scores, reverse=True)
    assert answer["prompt_tokens"] == len(prompt)
    return answer


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 for i in range(n)]


@pytest.mark.parametrize("legacy", [True, False], ids=["vllm<=0.23", "vllm>=0.24"])
def test_route_follows_the_engines(client: httpx.Client, fleet: Fleet, legacy: bool):
    ns = unique_ns()
    a, ea = fleet.start(ns, legacy=legacy)
    b, eb = fleet.start(ns, legacy=not legacy)
    system = prompt(1, 160)
    ea.cache(system + prompt(2, 100))
    eb.cache(system + prompt(3, 300))
    eb.cache(system + prompt(3, 300), medium="CPU")  # offloaded too
    eb.cache(system + prompt(4, 64), medium="CPU")
    fleet.sync(a)
    fleet.sync(b)
    for p in (system + prompt(2, 100), system + prompt(3, 400), system + prompt(4, 64), []):
        check_route(client, fleet, ns, p)
    answer = check_route(client, fleet, ns, system + prompt(3, 300))
    assert [e["engine_id"] for e in answer["engines"]] == [b, a]
    assert answer["engines"][0]["per_medium"] == {"GPU": 448, "CPU": 448, "STORAGE": 0}
    # only the engines named
    named = route(client, ns, system, engines=[a])
    assert [e["engine_id"] for e in named["engines"]] == [a]
    listed = {e["engine_id"]: e for e in client.get("/v1/engines").json()["engines"]}
    assert listed[b]["blocks"] == {"GPU": 28, "CPU": 32, "STORAGE": 0}
    assert listed[b]["events"]["blocks_stored"] == 28 + 28 + 4
    assert listed[a]["gaps"] == 0 and listed[a]["stale"] is False
    metrics = client.get("/metrics").text
    assert f'sessioncache_engine_blocks{{engine="{b}",medium="CPU"}} 32.0' in metrics
    assert f'sessioncache_engine_events_total{{engine="{a}"}} 1.0' in metrics


def test_a_gap_is_filled_from_the_replay_socket(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, e = fleet.start(ns)
    e.cache(prompt(1, 64))
    before = fleet.sync(a)["replays"]  # the connect's own replay counts if it found seq 0
    e.cache(prompt(2, 64), send=False)  # lost on the way: the next one shows the gap
    e.remove(e.cache(prompt(3, 96), send=False)[2:3], send=False)
    e.cache(prompt(4, 32))
    status = fleet.sync(a)
    assert (status["gaps"], status["replays"] - before, status["views_dropped"]) == (1, 1, 0)
    for seed, n in ((1, 64), (2, 64), (3, 96), (4, 32)):
        check_route(client, fleet, ns, prompt(seed, n))
    assert route(client, ns, prompt(3, 96))["engines"][0]["matched_blocks"] == 2


def test_the_status_says_whether_the_node_has_reached_the_engine(
    client: httpx.Client, fleet: Fleet
):
    ns = unique_ns()
    pub = endpoint()
    engine_id = f"eng-{uuid.uuid4().hex[:8]}"
    body = {"engine_id": engine_id, "namespace": ns, "endpoint": pub}
    assert client.post("/v1/engines", json=body).status_code == 201
    try:  # the module's node bounds the engines of its tenant: leave it as it was
        time.sleep(0.3)  # nothing listens there yet
        assert client.get(f"/v1/engines/{engine_id}").json()["connects"] == 0
        _, e = fleet.start(ns, register=False, engine_id=engine_id, pub=pub, replay=False)
        assert e.publisher is not None
        e.publisher.wait_subscriber()
        assert fleet.connected(engine_id)["connects"] == 1
        e.cache(prompt(1, 64))
        fleet.sync(engine_id)
        check_route(client, fleet, ns, prompt(1, 64))
    finally:
        assert client.delete(f"/v1/engines/{engine_id}").status_code == 204


def test_what_an_engine_cached_before_it_was_registered_comes_from_its_replay(
    client: httpx.Client, fleet: Fleet
):
    ns = unique_ns()
    a, e = fleet.start(ns, register=False)
    e.cache(prompt(1, 64))  # published to nobody yet
    e.cache(prompt(1, 64) + prompt(2, 32))
    assert e.publisher is not None
    e.publisher.flush()
    body = {"engine_id": a, "namespace": ns, "endpoint": e.publisher.endpoint}
    r = client.post("/v1/engines", json={**body, "replay_endpoint": e.publisher.replay_endpoint})
    assert r.status_code == 201, r.text
    e.publisher.wait_subscriber()
    e.cache(prompt(3, 16))  # seq 2: the node asks the replay for 0 and 1 first
    status = fleet.sync(a)
    assert (status["gaps"], status["replays"], status["views_dropped"]) == (0, 1, 0)
    check_route(client, fleet, ns, prompt(1, 64) + prompt(2, 32))
    assert route(client, ns, prompt(1, 64) + prompt(2, 32))["engines"][0]["matched_blocks"] == 6


@pytest.mark.parametrize("replay", [True, False], ids=["replay-too-short", "no-replay"])
def test_a_gap_the_replay_cannot_fill_drops_the_view(
    client: httpx.Client, fleet: Fleet, replay: bool
):
    ns = unique_ns()
    a, e = fleet.start(ns, replay=replay, buffer_steps=2)
    e.cache(prompt(1, 64))
    # the connect's own replay counts once if it found the first batch
    before = fleet.sync(a)["replays"]
    for seed in (2, 3, 4):  # three lost batches, two left in the engine's buffer
        e.cache(prompt(seed, 64), send=False)
    e.cache(prompt(1, 64) + prompt(5, 32))  # its parent was in the dropped view
    e.cache(prompt(6, 48))
    status = fleet.sync(a)
    assert status["gaps"] == 1 and status["views_dropped"] == 1
    assert status["replays"] - before == (1 if replay else 0)
    # rebuilt from the events that followed: only what they said is known
    assert route(client, ns, prompt(1, 64))["engines"][0]["matched_blocks"] == 0
    assert route(client, ns, prompt(2, 64))["engines"][0]["matched_blocks"] == 0
    check_route(client, fleet, ns, prompt(6, 48))
    assert status["events"]["skipped_blocks"] == 2


def test_all_blocks_cleared(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, e = fleet.start(ns, legacy=True)
    e.cache(prompt(1, 128))
    e.clear()
    fleet.sync(a)
    assert route(client, ns, prompt(1, 128))["engines"][0]["matched_blocks"] == 0
    e.cache(prompt(1, 64))
    status = fleet.sync(a)
    check_route(client, fleet, ns, prompt(1, 128))
    assert route(client, ns, prompt(1, 128))["engines"][0]["matched_blocks"] == 4
    assert status["events"]["cleared"] == 1 and status["blocks"]["GPU"] == 4


def test_a_block_removed_in_the_middle_ends_the_prefix(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, e = fleet.start(ns)
    hashes = e.cache(prompt(1, 160))
    e.cache(prompt(1, 160), medium="CPU")
    e.remove(hashes[4:5])
    fleet.sync(a)
    answer = check_route(client, fleet, ns, prompt(1, 160))
    engine = answer["engines"][0]
    # the GPU copy of block 4 left, the CPU copy holds it: the prefix goes on in CPU
    assert engine["matched_blocks"] == 10
    assert engine["per_medium"] == {"GPU": 64, "CPU": 160, "STORAGE": 0}
    assert engine["score"] == 9 * 16 * WEIGHTS["GPU"] + 16 * WEIGHTS["CPU"]
    e.remove(hashes[4:5], medium="CPU")
    fleet.sync(a)
    assert check_route(client, fleet, ns, prompt(1, 160))["engines"][0]["matched_blocks"] == 4


def test_engines_of_different_block_sizes(client: httpx.Client, fleet: Fleet):
    ns16 = unique_ns(16)
    ns32 = {**ns16, "block_tokens": 32}
    a, e16 = fleet.start(ns16)
    b, e32 = fleet.start(ns32, legacy=True)
    p = prompt(1, 200)
    e16.cache(p[:100])
    e32.cache(p)
    fleet.sync(a)
    fleet.sync(b)
    answer = check_route(client, fleet, ns16, p)
    assert [(e["engine_id"], e["matched_tokens"]) for e in answer["engines"]] == [
        (b, 192),
        (a, 96),
    ]
    # by ids: only the engines of the ids' block size
    ids = block_hashes(Namespace(**ns16), p)
    r = client.post(
        "/v1/route",
        json={"namespace": ns16, "block_ids_b64": base64.b64encode(b"".join(ids)).decode()},
    )
    assert r.status_code == 200, r.text
    assert [(e["engine_id"], e["matched_tokens"]) for e in r.json()["engines"]] == [(a, 96)]
    # an engine of another model is never compared
    c, other = fleet.start(unique_ns(16))
    other.cache(p)
    fleet.sync(c)
    assert c not in {e["engine_id"] for e in route(client, ns16, p)["engines"]}


def test_lora_blocks_route_only_under_their_lora(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, e = fleet.start(ns)
    p = prompt(1, 96)
    e.cache(p, lora="sql-adapter", lora_id=3)
    e.cache(p[:32])
    fleet.sync(a)
    assert check_route(client, fleet, ns, p)["engines"][0]["matched_blocks"] == 2
    got = check_route(client, fleet, ns, p, lora="sql-adapter")
    assert got["engines"][0]["matched_blocks"] == 6


def test_the_answer_gives_the_prefix_held_by_the_cache(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, e = fleet.start(ns)
    p = prompt(1, 128)
    plan = client.post("/v1/store", json={"namespace": ns, "tokens": p[:80]}).json()
    for h in plan["missing"]:
        r = client.put(
            f"/v1/blocks/{h}",
            content=bytes(64),
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
    e.cache(p[:32])
    fleet.sync(a)
    answer = route(client, ns, p)
    assert answer["cache"] == {
        "block_tokens": 16,
        "matched_blocks": 5,
        "matched_tokens": 80,
        "score": 80 * 0.25,
    }
    assert answer["engines"][0]["matched_tokens"] == 32


def test_bad_requests_get_4xx(client: httpx.Client, fleet: Fleet):
    ns = unique_ns()
    a, _ = fleet.start(ns)
    body = {"engine_id": a, "namespace": ns, "endpoint": endpoint()}
    assert client.post("/v1/engines", json=body).status_code == 409
    for bad in (
        {**body, "engine_id": "x y"},
        {**body, "engine_id": "new", "endpoint": "http://host:1"},
        {**body, "engine_id": "new", "namespace": {"model": "m"}},
        {**body, "engine_id": "new", "extra": 1},
    ):
        r = client.post("/v1/engines", json=bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"] == "ValidationError"
    assert client.delete("/v1/engines/nope").status_code == 404
    assert client.get("/v1/engines/nope").status_code == 404
    for bad_route, status in (
        ({"namespace": ns}, 422),
        ({"namespace": ns, "tokens": [1], "tokens_b64": "AAAA"}, 422),
        ({"namespace": ns, "tokens": [-1]}, 422),
        ({"namespace": ns, "tokens_b64": "AAA"}, 422),
        ({"namespace": ns, "block_ids_b64": "AAAA"}, 422),
        ({"namespace": ns, "tokens": [1], "session_id": "s"}, 422),
        ({"namespace": ns, "tokens": [1], "engines": ["nope"]}, 404),
    ):
        r = client.post("/v1/route", json=bad_route)
        assert r.status_code == status, (bad_route, r.text)
    assert client.delete(f"/v1/engines/{a}").status_code == 204
    assert a not in {e["engine_id"] for e in client.get("/v1/engines").json()["engines"]}


# -- tenants, and a stale engine (one server: starting one takes seconds) ------------------

SHARED_PUB = endpoint()
SHARED_NS = unique_ns()
SALTS = {"acme": "acme-salt", "globex": "globex-salt"}


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    shared = [{"engine_id": "shared-0", "namespace": SHARED_NS, "endpoint": SHARED_PUB}]
    server = start_server(
        tmp_path_factory.mktemp("tenants") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_ENGINES": json.dumps(shared),
            "SESSIONCACHE_TENANT_CACHE_SALTS": json.dumps(SALTS),
            # the tenants' engines are simulated on this host
            "SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES": json.dumps(["tcp://127.0.0.1:"]),
            # short, for the stale engine's test; the tenant test compares no scores
            "SESSIONCACHE_ENGINE_STALE_S": "1.5",
        },
    )
    yield server
    server.stop()


def test_a_tenant_sees_only_its_engines_and_the_shared_ones(tenant_server: Server):
    def client(key: str) -> httpx.Client:
        return httpx.Client(
            base_url=tenant_server.url, headers={"authorization": f"Bearer {key}"}, timeout=30
        )

    with client("key-acme") as acme, client("key-globex") as globex:
        fleet = Fleet(acme)
        try:
            _, shared = fleet.start(SHARED_NS, register=False, engine_id="shared-0", pub=SHARED_PUB)
            assert shared.publisher is not None
            shared.publisher.wait_subscriber()
            own, e = fleet.start(SHARED_NS)
            p, q = prompt(1, 64), prompt(2, 64)
            e.cache(p)
            # the shared engine holds what each tenant's requests cached, under its salt
            shared.cache(p[:32], cache_salt=SALTS["acme"])
            shared.cache(q[:48], cache_salt=SALTS["globex"])
            shared.cache(q, cache_salt="nobody's")
            fleet.sync(own)
            fleet.sync("shared-0")

            def seen(c: httpx.Client) -> set[str]:
                return {x["engine_id"] for x in c.get("/v1/engines").json()["engines"]}

            def matched(c: httpx.Client, tokens: list[int]) -> list[tuple[str, int]]:
                answer = route(c, SHARED_NS, tokens)
                return [(x["engine_id"], x["matched_tokens"]) for x in answer["engines"]]

            assert seen(acme) == {own, "shared-0"}
            assert seen(globex) == {"shared-0"}
            assert matched(acme, p) == [(own, 64), ("shared-0", 32)]
            assert matched(acme, q) == [(own, 0), ("shared-0", 0)]
            assert matched(globex, p) == [("shared-0", 0)]
            assert matched(globex, q) == [("shared-0", 48)]
            assert (
                globex.post(
                    "/v1/route", json={"namespace": SHARED_NS, "tokens": p, "engines": [own]}
                ).status_code
                == 404
            )
            assert globex.get(f"/v1/engines/{own}").status_code == 404
            assert globex.delete(f"/v1/engines/{own}").status_code == 404
            assert acme.delete("/v1/engines/shared-0").status_code == 404
            assert httpx.get(f"{tenant_server.url}/v1/engines").status_code == 401
            assert acme.delete(f"/v1/engines/{own}").status_code == 204
        finally:
            fleet.close()


def test_a_silent_engine_goes_stale_and_scores_nothing(tenant_server: Server):
    with httpx.Client(
        base_url=tenant_server.url, headers={"authorization": "Bearer key-acme"}, timeout=30
    ) as c:
        fleet = Fleet(c)
        try:
            ns = unique_ns()
            a, e = fleet.start(ns)
            e.cache(prompt(1, 64))
            fleet.sync(a)
            fresh = route(c, ns, prompt(1, 64), engines=[a])["engines"][0]
            assert (fresh["stale"], fresh["score"]) == (False, 64.0)
            time.sleep(2.0)
            old = route(c, ns, prompt(1, 64), engines=[a])["engines"][0]
            assert (old["stale"], old["score"], old["matched_tokens"]) == (True, 0.0, 64)
            assert c.get(f"/v1/engines/{a}").json()["stale"] is True
            e.cache(prompt(2, 16))
            fleet.sync(a)
            assert route(c, ns, prompt(1, 64), engines=[a])["engines"][0]["score"] == 64.0
        finally:
            fleet.close()
