"""Tenant isolation as a randomized test over every data path: two tenants storing the same
(and different) prompts never hit each other's blocks, cannot read them by id, and cannot
learn that they exist: a foreign id gets exactly the answer of an unknown one.

A path is one ``DataPath`` in ``PATHS``; the adapters and the router of issues 11-13 join by
adding theirs there. The same-host path is not one: it maps the whole CPU tier and is open
only to ``shm_trusted_tenants`` (docs/security.md); that an untrusted tenant is refused there
is tested in tests/sessioncache/dataplane/test_samehost.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Protocol

import httpx
import numpy as np
import pytest

from sessioncache.dataplane import StreamClient, discover
from sessioncache.hashing import Namespace
from tests.api.conftest import KEYS
from tests.support.servers import Server, start_server

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


PATHS = ["rest", "stream"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("isolation") / "data", {"SESSIONCACHE_API_KEYS": json.dumps(KEYS)}
    )
    yield s
    s.stop()


def make_path(name: str, server: Server) -> RestPath | StreamPath:
    return {"rest": RestPath, "stream": StreamPath}[name](server)


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
