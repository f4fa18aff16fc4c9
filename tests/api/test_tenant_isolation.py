"""Tenant isolation as a randomized test over every data path: two tenants storing the same
(and different) prompts never hit each other's blocks, cannot read them by id, and cannot
learn that they exist: a foreign id gets exactly the answer of an unknown one.

A path is one ``DataPath`` in ``PATHS``: REST, the stream, the same-host socket (both tenants
are trusted with it in this node, so LOCATE really runs; what a trusted tenant can read by
mapping the CPU tier is docs/security.md's business, and that an untrusted tenant is refused
there is tested in tests/sessioncache/dataplane/test_samehost.py) and keyed blocks over the
stream and the same-host socket. The LMCache L2 adapter, the SGLang HiCache backend and the
router (``/v1/engines``, ``/v1/route``) have tests of their own below, on the same node.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Protocol

import httpx
import numpy as np
import pytest

from sessioncache.connector import StreamClient, discover
from sessioncache.connector.lmcache import SessionCacheL2
from sessioncache.connector.samehost import SameHostClient
from sessioncache.connector.stream import discover_same_host
from sessioncache.hashing import Namespace, block_key
from tests.api.conftest import KEYS, METRICS, METRICS_TOKEN
from tests.support.adapters import hicache_config, wait_for
from tests.support.servers import Server, free_port, start_server

NS = Namespace("isolation-model", block_tokens=4, kv_dtype="bf16", kv_layout="x")
NS_JSON = {"model": NS.model, "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
KEY_OF = {tenant: key for key, tenant in KEYS.items()}
BLOCK = 256


class DataPath(Protocol):
    """What the test does through one path, as one tenant (its API key)."""

    def store(self, key: str, tokens: list[int]) -> list[bytes]:
        """Store every full block of ``tokens``; their ids."""

    def matched(self, key: str, tokens: list[int]) -> int:
        """Blocks of ``tokens`` a lookup matches."""

    def fetch(self, key: str, ids: list[bytes]) -> list[bytes | None]:
        """Each block's payload, None where not readable."""

    def read(self, key: str, ids: list[bytes]) -> list[object]:
        """The answer to a read of each id by id, as something comparable across ids
        (the id itself scrubbed from it)."""


def zmq_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def payload(block_id: bytes) -> bytes:
    return (block_id * (BLOCK // len(block_id) + 1))[:BLOCK]


class RestPath:
    def __init__(self, server: Server) -> None:
        self.url = server.url

    def _h(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    def store(self, key: str, tokens: list[int]) -> list[bytes]:
        plan = httpx.post(
            f"{self.url}/v1/store",
            json={"namespace": NS_JSON, "tokens": tokens},
            headers=self._h(key),
        ).json()
        for h in plan["missing"]:
            r = httpx.put(
                f"{self.url}/v1/blocks/{h}", content=payload(bytes.fromhex(h)), headers=self._h(key)
            )
            assert r.status_code == 200, r.text
        return [bytes.fromhex(h) for h in plan["hashes"]]

    def matched(self, key: str, tokens: list[int]) -> int:
        out = httpx.post(
            f"{self.url}/v1/lookup",
            json={"namespace": NS_JSON, "tokens": tokens},
            headers=self._h(key),
        ).json()
        return int(out["matched_blocks"])

    def fetch(self, key: str, ids: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for bid in ids:
            r = httpx.get(f"{self.url}/v1/blocks/{bid.hex()}", headers=self._h(key))
            out.append(r.content if r.status_code == 200 else None)
        return out

    def read(self, key: str, ids: list[bytes]) -> list[object]:
        answers: list[object] = []
        for bid in ids:
            r = httpx.get(f"{self.url}/v1/blocks/{bid.hex()}", headers=self._h(key))
            answers.append((r.status_code, re.sub(r"[0-9a-f]{32}", "<id>", r.text)))
        batch = httpx.post(
            f"{self.url}/v1/blocks/batch",
            json={"hashes": [b.hex() for b in ids]},
            headers=self._h(key),
        )
        body = batch.content
        # the batch answer with the ids scrubbed: per record status and length
        answers.append((batch.status_code, len(body), body[:8]))
        return answers


class StreamPath:
    def __init__(self, server: Server) -> None:
        self.url = server.url
        self.clients: dict[str, StreamClient] = {}

    def client(self, key: str) -> StreamClient:
        if key not in self.clients:
            self.clients[key] = StreamClient.connect(
                discover(self.url, api_key=key), api_key=key, timeout=30
            )
        return self.clients[key]

    def store(self, key: str, tokens: list[int]) -> list[bytes]:
        c = self.client(key)
        root = c.resolve(NS)
        toks = np.asarray(tokens, dtype=np.uint32)
        ids = c.block_hashes(root, toks)
        c.store(root, toks, [np.frombuffer(payload(h), np.uint8) for h in ids])
        return list(ids)

    def matched(self, key: str, tokens: list[int]) -> int:
        c = self.client(key)
        root = c.resolve(NS)
        return c.lookup(root, c.block_hashes(root, np.asarray(tokens, dtype=np.uint32))).matched

    def fetch(self, key: str, ids: list[bytes]) -> list[bytes | None]:
        return [None if x is None else bytes(x) for x in self.client(key).load(ids)]

    def read(self, key: str, ids: list[bytes]) -> list[object]:
        return list(self.fetch(key, ids))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


class SameHostPath(StreamPath):
    """Chains through the same-host socket: stores staged in shared memory, lookups and
    reads by LOCATE (the lease and the slots), LOOKUP, EXISTS and a LOAD by id."""

    def client(self, key: str) -> StreamClient:
        if key not in self.clients:
            self.clients[key] = SameHostClient.connect(
                discover_same_host(self.url, api_key=key), api_key=key, timeout=30
            )
        return self.clients[key]

    def shm(self, key: str) -> SameHostClient:
        c = self.client(key)
        assert isinstance(c, SameHostClient)
        return c

    def matched(self, key: str, tokens: list[int]) -> int:
        c = self.shm(key)
        root = c.resolve(NS)
        found = c.locate(root, c.block_hashes(root, np.asarray(tokens, dtype=np.uint32)))
        if found.lease is not None:
            c.release(found.lease)
        return found.matched

    def fetch(self, key: str, ids: list[bytes]) -> list[bytes | None]:
        c = self.shm(key)
        found = c.locate(c.resolve(NS), ids)
        if found.lease is None:
            return [None] * len(ids)
        got: list[bytes | None] = list(c.load(found))
        return got + [None] * (len(ids) - len(got))

    def read(self, key: str, ids: list[bytes]) -> list[object]:
        c = self.shm(key)
        root = c.resolve(NS)
        answers: list[object] = []
        for keyed in (False, True):
            found = c.locate(root, ids, keyed=keyed)
            answers.append((found.matched, found.located, found.lease, found.slots))
            looked = c.lookup(root, ids, lease_ms=1000, keyed=keyed)
            answers.append((looked.matched, looked.lease))
        answers.append(c.exists(root, ids))
        answers.append(StreamPath.fetch(self, key, ids))  # a LOAD by id over the socket
        return answers


class KeyedPath(StreamPath):
    """Keyed blocks (an engine's own keys, one per block of the prompt) over the stream or
    the same-host socket: EXISTS, keyed LOOKUP (and LOCATE there), LOAD by id."""

    def __init__(self, server: Server, same_host: bool) -> None:
        super().__init__(server)
        self.same_host = same_host

    def client(self, key: str) -> StreamClient:
        if key not in self.clients:
            if self.same_host:
                where = discover_same_host(self.url, api_key=key)
                self.clients[key] = SameHostClient.connect(where, api_key=key, timeout=30)
            else:
                return super().client(key)
        return self.clients[key]

    @staticmethod
    def keys(tokens: list[int]) -> list[bytes]:
        return [block_key(repr(tokens[: i + 4])) for i in range(0, len(tokens) - 3, 4)]

    def store(self, key: str, tokens: list[int]) -> list[bytes]:
        c = self.client(key)
        root = c.resolve(NS)
        keys = self.keys(tokens)
        ids = c.key_ids(root, keys)
        ack = c.store_keyed(root, keys, [np.frombuffer(payload(h), np.uint8) for h in ids])
        assert ack.status.count("dropped") == 0, ack
        return ids

    def matched(self, key: str, tokens: list[int]) -> int:
        c = self.client(key)
        root = c.resolve(NS)
        ids = c.key_ids(root, self.keys(tokens))
        if isinstance(c, SameHostClient):
            found = c.locate(root, ids, keyed=True)
            if found.lease is not None:
                c.release(found.lease)
            assert found.matched == c.lookup(root, ids, keyed=True).matched
            return found.matched
        return c.lookup(root, ids, keyed=True).matched

    def read(self, key: str, ids: list[bytes]) -> list[object]:
        c = self.client(key)
        root = c.resolve(NS)
        answers: list[object] = [c.exists(root, ids), c.lookup(root, ids, keyed=True).matched]
        if isinstance(c, SameHostClient):
            found = c.locate(root, ids, keyed=True)
            answers.append((found.matched, found.located, found.lease))
        return [*answers, super().read(key, ids)]


PATHS = ["rest", "stream", "same_host", "keyed_stream", "keyed_same_host"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("isolation") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_METRICS_TOKEN": METRICS_TOKEN,
            # a 64 MiB slab chunk per payload size in use (tiers/slab.py): three sizes here
            "SESSIONCACHE_CPU_BYTES": str(256 << 20),
            # both tenants may use the socket, so their reads there really run
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(sorted(KEYS.values())),
            "SESSIONCACHE_ENGINES": json.dumps(
                [{"engine_id": "shared-0", "namespace": NS_JSON, "endpoint": zmq_endpoint()}]
            ),
            # the tenants' engines are simulated on this host
            "SESSIONCACHE_ENGINE_ENDPOINT_PREFIXES": json.dumps(["tcp://127.0.0.1:"]),
        },
    )
    yield s
    s.stop()


def make_path(name: str, server: Server) -> StreamPath | RestPath:
    if name == "rest":
        return RestPath(server)
    if name == "stream":
        return StreamPath(server)
    if name == "same_host":
        return SameHostPath(server)
    return KeyedPath(server, same_host=name == "keyed_same_host")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", PATHS)
def test_tenants_never_see_each_other(server: Server, name: str, seed: int) -> None:
    rng = np.random.default_rng(seed * 100 + PATHS.index(name))
    path = make_path(name, server)
    acme, globex = KEY_OF["acme"], KEY_OF["globex"]
    try:
        shared = [int(t) for t in rng.integers(0, 50_000, 4 * int(rng.integers(2, 8)))]
        own = {
            k: [int(t) for t in rng.integers(0, 50_000, 4 * int(rng.integers(1, 6)))]
            for k in (acme, globex)
        }
        order = [acme, globex] if rng.random() < 0.5 else [globex, acme]
        ids: dict[str, list[bytes]] = {}
        # the first tenant stores the shared prompt and its own; the other stores its own only
        ids[order[0]] = path.store(order[0], shared) + path.store(order[0], own[order[0]])
        mine = path.store(order[1], own[order[1]])
        other = order[1]
        # no hit on the other's prompt, shared or not
        assert path.matched(other, shared) == 0
        assert path.matched(other, own[order[0]]) == 0
        assert path.matched(order[0], shared) == len(shared) // 4
        # the other's ids read by id: the same answer as random unknown ids
        foreign = ids[order[0]][:4]
        unknown = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in foreign]
        assert path.read(other, foreign) == path.read(other, unknown)
        # and its own blocks are its own, intact
        assert path.fetch(other, mine) == [payload(h) for h in mine]
        # now the other stores the shared prompt too: its own ids, still no cross hit
        theirs = path.store(other, shared)
        assert set(theirs).isdisjoint(ids[order[0]])
        assert path.matched(other, shared) == len(shared) // 4
    finally:
        if isinstance(path, StreamPath):
            path.close()


# -- the adapters: LMCache's L2 adapter, SGLang's HiCache backend ----------------------------


@pytest.mark.parametrize("data_path", ["stream", "same_host"])
def test_lmcache_tenants_never_read_each_other(server: Server, data_path: str) -> None:
    size = 4096
    chunks = [f"iso-model@00000000@0@{uuid.uuid4().hex}" for _ in range(3)]
    unknown = [f"iso-model@00000000@0@{uuid.uuid4().hex}" for _ in range(3)]
    a = SessionCacheL2(server.url, KEY_OF["acme"], data_path=data_path)  # type: ignore[arg-type]
    g = SessionCacheL2(server.url, KEY_OF["globex"], data_path=data_path)  # type: ignore[arg-type]
    try:
        assert a.data_path == g.data_path == data_path
        mine = [memoryview(bytes([i + 1]) * size) for i in range(3)]
        assert wait_for(a, a.submit_batch_set(chunks, mine))[1:3] == (True, "")
        # the same keys from the other tenant: neither there nor readable, as unknown keys
        for asked in (chunks, unknown):
            assert wait_for(g, g.submit_batch_exists(asked))[1:] == (True, "", [False] * 3)
            out = [bytearray(size) for _ in asked]
            got = wait_for(g, g.submit_batch_get(asked, [memoryview(b) for b in out]))
            assert got[1:] == (True, "", [False] * 3)
            assert out == [bytearray(size)] * 3  # nothing copied in
        # the other stores the same keys: its own blocks, and the first tenant's stay intact
        theirs = [memoryview(b"\xee" * size) for _ in range(3)]
        assert wait_for(g, g.submit_batch_set(chunks, theirs))[1:3] == (True, "")
        out = [bytearray(size) for _ in chunks]
        got = wait_for(a, a.submit_batch_get(chunks, [memoryview(b) for b in out]))
        assert got[1:] == (True, "", [True] * 3) and out == [bytearray(m) for m in mine]
    finally:
        a.close()
        g.close()


def test_sglang_tenants_never_read_each_other(server: Server) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sessioncache.connector.sglang import SessionCacheHiCacheStorage

    def backend(key: str, path: str) -> SessionCacheHiCacheStorage:
        config = hicache_config(
            {"url": server.url, "api_key": key, "path": path}, model="iso-sglang"
        )
        return SessionCacheHiCacheStorage(config)

    for path in ("same_host", "stream"):
        mine, theirs = backend(KEY_OF["acme"], path), backend(KEY_OF["globex"], path)
        try:
            keys = [f"{path}-{uuid.uuid4().hex}" for _ in range(3)]
            pages = [torch.full((1024,), float(i + 1)) for i in range(3)]
            assert mine.batch_set(keys, pages)
            assert mine.batch_exists(keys) == 3
            assert theirs.batch_exists(keys) == 0 and not theirs.exists(keys[0])
            assert theirs.get(keys[0], torch.zeros(1024)) is None
            # its own page under the same key does not touch the first tenant's
            assert theirs.set(keys[0], torch.full((1024,), -1.0))
            out = mine.get(keys[0], torch.zeros(1024))
            assert out is not None and torch.equal(out, pages[0])
        finally:
            mine.close()
            theirs.close()


# -- routing: /v1/engines and /v1/route --------------------------------------------------------


def test_routing_never_shows_another_tenants_engines(server: Server) -> None:
    def client(key: str) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"}
        return httpx.Client(base_url=server.url, headers=headers, timeout=30)

    def scrub(r: httpx.Response, engine_id: str) -> tuple[int, str]:
        return r.status_code, r.text.replace(engine_id, "<id>")

    with client(KEY_OF["acme"]) as acme, client(KEY_OF["globex"]) as globex:
        own: dict[httpx.Client, str] = {}
        for c in (acme, globex):
            own[c] = f"eng-{uuid.uuid4().hex[:12]}"
            body = {"engine_id": own[c], "namespace": NS_JSON, "endpoint": zmq_endpoint()}
            assert c.post("/v1/engines", json=body).status_code == 201
        prompt = list(range(64))
        for c, other in ((acme, globex), (globex, acme)):
            listed = {e["engine_id"] for e in c.get("/v1/engines").json()["engines"]}
            assert listed == {own[c], "shared-0"}
            r = c.post("/v1/route", json={"namespace": NS_JSON, "tokens": prompt})
            assert r.status_code == 200, r.text
            assert {e["engine_id"] for e in r.json()["engines"]} == {own[c], "shared-0"}
            # a foreign engine id: exactly the answer of an unknown one, on every route
            foreign, unknown = own[other], f"eng-{uuid.uuid4().hex[:12]}"
            for name in (foreign, unknown):
                assert c.get(f"/v1/engines/{name}").status_code == 404
            assert scrub(c.get(f"/v1/engines/{foreign}"), foreign) == scrub(
                c.get(f"/v1/engines/{unknown}"), unknown
            )
            routed = [
                scrub(
                    c.post(
                        "/v1/route",
                        json={"namespace": NS_JSON, "tokens": prompt, "engines": [name]},
                    ),
                    name,
                )
                for name in (foreign, unknown)
            ]
            assert routed[0] == routed[1] and routed[0][0] == 404
            deleted = [scrub(c.delete(f"/v1/engines/{n}"), n) for n in (foreign, unknown)]
            assert deleted[0] == deleted[1] and deleted[0][0] == 404
        # engine ids are per tenant: registering the other's id is no probe, it just works
        # (and is the registrant's own engine); a shared engine's id, public, is taken
        same = f"eng-{uuid.uuid4().hex[:12]}"
        endpoints = {}
        for c in (acme, globex):
            endpoints[c] = zmq_endpoint()
            body = {"engine_id": same, "namespace": NS_JSON, "endpoint": endpoints[c]}
            r = c.post("/v1/engines", json=body)
            assert r.status_code == 201 and r.json()["engine_id"] == same, r.text
            assert c.post("/v1/engines", json=body).status_code == 409  # its own, twice
            shared = {**body, "engine_id": "shared-0"}
            assert c.post("/v1/engines", json=shared).status_code == 409
        for c in (acme, globex):
            assert c.get(f"/v1/engines/{same}").json()["endpoint"] == endpoints[c]
        assert acme.delete(f"/v1/engines/{same}").status_code == 204
        assert globex.get(f"/v1/engines/{same}").json()["endpoint"] == endpoints[globex]
        routed = globex.post(
            "/v1/route", json={"namespace": NS_JSON, "tokens": prompt, "engines": [same]}
        )
        assert [e["engine_id"] for e in routed.json()["engines"]] == [same]
        metrics = httpx.get(f"{server.url}/metrics", headers=METRICS).text
        assert f'sessioncache_engine_stale{{engine="globex/{same}"}}' in metrics
        # neither delete touched the other's engine
        for c in (acme, globex):
            assert c.delete(f"/v1/engines/{own[c]}").status_code == 204
        assert globex.delete(f"/v1/engines/{same}").status_code == 204
