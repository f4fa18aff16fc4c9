"""Lookups by block id over HTTP: ``POST /v1/namespaces/resolve``, ``block_ids_b64`` and the
compact answer, against a real uvicorn process (open and with API keys)."""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessioncache.api.routes.lookup import blocks_json, tier_runs
from sessioncache.api.schemas import (
    BLOCK_IDS_B64_PATTERN,
    MAX_LOOKUP_IDS,
    CompactLookupResponse,
    LookupResponse,
    ResolveResponse,
    decode_block_ids,
)
from sessioncache.hashing import BlockHash, Namespace, block_hashes, block_hashes_from_bytes
from tests.support.servers import Server

NS = {"model": "ids-model", "block_tokens": 16, "kv_dtype": "float16", "kv_layout": "test"}
BLOCK = 1024


def unique_ns(**extra: object) -> dict[str, object]:
    return {**NS, "model": f"ids-model-{uuid.uuid4().hex}", **extra}


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, n).astype("<u4")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ids_b64(ids: list[BlockHash] | list[bytes]) -> str:
    return b64(b"".join(ids))


def resolve(client: httpx.Client, ns: dict[str, object]) -> ResolveResponse:
    r = client.post("/v1/namespaces/resolve", json={"namespace": ns})
    assert r.status_code == 200, r.text
    return ResolveResponse.model_validate(r.json())


def client_ids(client: httpx.Client, ns: dict[str, object], toks: np.ndarray) -> list[BlockHash]:
    """The ids a client computes from the resolved root (as the connector does)."""
    res = resolve(client, ns)
    return block_hashes_from_bytes(
        bytes.fromhex(res.root), toks.tobytes(), res.block_tokens, res.hash_seed
    )


def store_all(client: httpx.Client, ns: dict[str, object], toks: np.ndarray, **extra: object):
    plan = client.post(
        "/v1/store", json={"namespace": ns, "tokens_b64": b64(toks.tobytes()), **extra}
    )
    assert plan.status_code == 200, plan.text
    for h in plan.json()["missing"]:
        assert (
            client.put(f"/v1/blocks/{h}", content=bytes.fromhex(h) * (BLOCK // 16)).status_code
            == 200
        )
    hashes: list[str] = plan.json()["hashes"]
    return hashes


def lookup(client: httpx.Client, body: dict[str, object]) -> dict[str, object]:
    r = client.post("/v1/lookup", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


@pytest.fixture
def acme(auth_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=auth_server.url, headers={"authorization": "Bearer key-acme"}, timeout=30
    ) as c:
        yield c


@pytest.fixture
def globex(auth_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=auth_server.url, headers={"authorization": "Bearer key-globex"}, timeout=30
    ) as c:
        yield c


# -- resolve ----------------------------------------------------------------------------------


def test_resolve_gives_the_root_the_server_hashes_under(client: httpx.Client):
    ns = unique_ns()
    res = resolve(client, ns)
    assert res.root == Namespace(**ns).root().hex()  # type: ignore[arg-type]
    assert res.block_tokens == 16 and res.hash_seed == 0
    toks = tokens(1, 100)
    hashes = store_all(client, ns, toks)
    assert [h.hex() for h in client_ids(client, ns, toks)] == hashes and len(hashes) == 6
    # the ids computed from it hit after the token store
    out = lookup(client, {"namespace": ns, "block_ids_b64": ids_b64(client_ids(client, ns, toks))})
    assert out["matched_blocks"] == 6 and out["matched_tokens"] == 96


def test_resolve_salt_and_bad_namespace(client: httpx.Client):
    ns = unique_ns()
    salted = resolve(client, {**ns, "salt": "team-1"}).root
    assert salted != resolve(client, ns).root
    assert salted == Namespace(**{**ns, "salt": "team-1"}).root().hex()  # type: ignore[arg-type]
    for body in ({}, {"namespace": {**ns, "block_tokens": 0}}, {"namespace": ns, "extra": 1}):
        r = client.post("/v1/namespaces/resolve", json=body)
        assert r.status_code == 422 and r.json()["error"] == "ValidationError", r.text


# -- the id lookup answers what the token lookup answers ---------------------------------------


@pytest.mark.parametrize("stored_blocks", [0, 1, 4, 6])
def test_id_lookup_matches_the_token_lookup(client: httpx.Client, stored_blocks: int):
    ns = unique_ns()
    toks = tokens(2, 6 * 16 + 7)  # 6 full blocks and a partial tail
    if stored_blocks:
        store_all(client, ns, toks[: stored_blocks * 16])
    ids = client_ids(client, ns, toks)
    by_tokens = lookup(client, {"namespace": ns, "tokens": toks.tolist()})
    full = lookup(client, {"namespace": ns, "block_ids_b64": ids_b64(ids), "compact": False})
    compact = lookup(client, {"namespace": ns, "block_ids_b64": ids_b64(ids)})
    assert full == by_tokens
    assert by_tokens["matched_blocks"] == stored_blocks
    assert [b["hash"] for b in by_tokens["blocks"]] == [h.hex() for h in ids[:stored_blocks]]  # type: ignore[attr-defined,index]
    assert compact == {
        "block_tokens": 16,
        "matched_blocks": stored_blocks,
        "matched_tokens": stored_blocks * 16,
        "tiers": [{"tier": "cpu", "blocks": stored_blocks}] if stored_blocks else [],
        "lease": None,
        "lease_cut": None,
        "locations": None,
        "miss": None,
    }


def test_answers_have_the_declared_shapes(client: httpx.Client):
    ns = unique_ns()
    toks = tokens(3, 64)
    hashes = store_all(client, ns, toks)
    ids = client_ids(client, ns, toks)
    for body, model in (
        ({"tokens": toks.tolist()}, LookupResponse),
        ({"tokens_b64": b64(toks.tobytes()), "compact": False}, LookupResponse),
        ({"block_ids_b64": ids_b64(ids), "compact": False}, LookupResponse),
        ({"tokens": toks.tolist(), "compact": True}, CompactLookupResponse),
        ({"block_ids_b64": ids_b64(ids)}, CompactLookupResponse),
        ({"block_ids_b64": ids_b64(ids), "compact": True}, CompactLookupResponse),
        ({"tokens": toks.tolist(), "explain": True}, LookupResponse),
        ({"block_ids_b64": ids_b64(ids), "explain": True}, CompactLookupResponse),
    ):
        out = lookup(client, {"namespace": ns, "lease_ms": 1000, **body})
        parsed = model.model_validate(out)
        assert set(out) == set(model.model_fields), (body, sorted(out))
        assert parsed.model_dump(mode="json") == out
        assert out["matched_blocks"] == 4 and out["lease"]["id"]  # type: ignore[index]
        if model is LookupResponse:
            assert [b["hash"] for b in out["blocks"]] == hashes  # type: ignore[attr-defined]
        assert client.delete(f"/v1/leases/{out['lease']['id']}").status_code == 204  # type: ignore[index]


def test_tier_runs_and_the_hand_made_blocks_json():
    """Mixed tiers need evictions to happen over HTTP; the encoders are checked directly,
    byte for byte against json.dumps."""
    ids = [bytes([i]) * 16 for i in range(7)]
    tiers = ["gpu", "cpu", "cpu", "disk", "disk", "disk", "cpu"]
    runs = tier_runs(tiers)
    assert runs == [("gpu", 1), ("cpu", 2), ("disk", 3), ("cpu", 1)]
    assert tier_runs([]) == [] and tier_runs(["cpu"] * 5) == [("cpu", 5)]
    expected = [{"hash": h.hex(), "tier": t} for h, t in zip(ids, tiers, strict=True)]
    assert blocks_json(ids, runs) == json.dumps(expected, separators=(",", ":"))  # type: ignore[arg-type]
    assert blocks_json([], []) == "[]"
    odd = ['we"ird', "tier\\name"]
    assert json.loads(blocks_json(ids[:2], tier_runs(odd))) == [  # type: ignore[arg-type]
        {"hash": ids[0].hex(), "tier": odd[0]},
        {"hash": ids[1].hex(), "tier": odd[1]},
    ]


def test_id_lookup_with_a_session_and_a_lease(client: httpx.Client):
    sid = f"s-{uuid.uuid4().hex}"
    assert client.post("/v1/sessions", json={"session_id": sid}).status_code == 201
    ns = unique_ns()
    toks = tokens(4, 48)
    hashes = store_all(client, ns, toks)
    ids = (
        client_ids(client, ns, toks)
        + client_ids(client, ns, np.concatenate([toks, tokens(5, 32)]))[3:]
    )
    out = lookup(
        client,
        {"namespace": ns, "block_ids_b64": ids_b64(ids), "session_id": sid, "lease_ms": 5000},
    )
    assert out["matched_blocks"] == 3 and out["tiers"] == [{"tier": "cpu", "blocks": 3}]
    session = client.get(f"/v1/sessions/{sid}").json()
    assert session["head"] == hashes[-1] and session["pinned"] is True
    lease = out["lease"]
    assert client.delete(f"/v1/leases/{lease['id']}").status_code == 204  # type: ignore[index]
    r = client.post(
        "/v1/lookup",
        json={"namespace": ns, "block_ids_b64": ids_b64(ids), "session_id": "no-such-session"},
    )
    assert r.status_code == 404 and r.json()["error"] == "SessionNotFound"


def test_ids_that_are_not_the_callers_chain_are_misses(client: httpx.Client):
    ns, other = unique_ns(), unique_ns()
    toks = tokens(6, 64)
    store_all(client, ns, toks)
    store_all(client, other, toks)
    ids = client_ids(client, ns, toks)
    theirs = client_ids(client, other, toks)

    def matched(id_list: list[BlockHash], namespace: dict[str, object] = ns) -> object:
        body = {"namespace": namespace, "block_ids_b64": ids_b64(id_list)}
        return lookup(client, body)["matched_blocks"]

    assert matched(ids) == 4
    assert matched(ids, other) == 0  # held, but not under the namespace named
    assert matched(theirs) == 0
    assert matched([*ids[:2], *theirs[2:]]) == 2  # the match stops at the first foreign id
    assert matched([ids[0], ids[2], ids[1], ids[3]]) == 1  # not a chain: stops where it breaks
    assert matched(ids[1:]) == 0  # must start at the root
    assert matched([*ids[:3], ids[3][::-1]]) == 3  # an unknown id: the held run ends
    assert matched([*ids, *ids]) == 4  # repeated: block 4's parent is not block 3


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"block_ids_b64": b64(b"x" * 17)}, "decodes to 17 bytes, not a whole number of 16-byte"),
        ({"block_ids_b64": b64(b"x" * 8)}, "decodes to 8 bytes"),
        ({"block_ids_b64": "###"}, "not valid base64"),
        ({"block_ids_b64": "AAAA" * 5 + "A"}, "not valid base64"),
        ({"block_ids_b64": "é" * 24}, "not valid base64"),
        ({"block_ids_b64": 12}, "block_ids_b64"),
        (
            {"block_ids_b64": b64(b"x" * 16), "tokens": [1]},
            "exactly one of tokens, tokens_b64 or block_ids_b64 (got tokens and block_ids_b64)",
        ),
        (
            {"block_ids_b64": b64(b"x" * 16), "tokens_b64": "AAAA"},
            "(got tokens_b64 and block_ids_b64)",
        ),
        ({}, "give exactly one of tokens, tokens_b64 or block_ids_b64"),
        ({"block_ids_b64": b64(b"x" * 16), "compact": "maybe"}, "compact"),
        (
            {"block_ids_b64": b64(bytes(16 * (MAX_LOOKUP_IDS + 1)))},
            f"more than {MAX_LOOKUP_IDS} ids",
        ),
        (
            {"block_ids_b64": "A" * (4 * MAX_LOOKUP_IDS * 16 // 3 + 8)},
            f"more than {MAX_LOOKUP_IDS} ids",
        ),
    ],
)
def test_bad_id_lookups_are_422_with_a_message(
    client: httpx.Client, extra: dict[str, object], message: str
):
    r = client.post("/v1/lookup", json={"namespace": unique_ns(), **extra})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "ValidationError" and message in body["detail"], body


def test_id_lookups_beyond_max_tokens_are_refused(client: httpx.Client):
    """The server's token limit (SESSIONCACHE_MAX_TOKENS, 2M by default) bounds id lookups
    too: ids x block_tokens."""
    ns = unique_ns(block_tokens=1 << 16)
    r = client.post("/v1/lookup", json={"namespace": ns, "block_ids_b64": b64(bytes(16 * 31))})
    assert r.status_code == 422 and "exceed the limit of 2000000 tokens" in r.json()["detail"]
    ok = client.post("/v1/lookup", json={"namespace": ns, "block_ids_b64": b64(bytes(16 * 30))})
    assert ok.status_code == 200 and ok.json()["matched_blocks"] == 0


def test_the_schema_declares_what_the_server_enforces(client: httpx.Client):
    spec = client.get("/openapi.json").json()
    assert "/v1/namespaces/resolve" in spec["paths"]
    schemas = spec["components"]["schemas"]
    request = schemas["LookupRequest"]
    assert request["oneOf"] == [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
        for name in ("tokens", "tokens_b64", "block_ids_b64")
    ]
    ids = request["properties"]["block_ids_b64"]["anyOf"][0]
    assert ids["pattern"] == BLOCK_IDS_B64_PATTERN
    assert ids["maxLength"] == len(b64(bytes(16 * MAX_LOOKUP_IDS)))
    answers = spec["paths"]["/v1/lookup"]["post"]["responses"]["200"]["content"]
    refs = {s["$ref"] for s in answers["application/json"]["schema"]["anyOf"]}
    assert refs == {
        "#/components/schemas/LookupResponse",
        "#/components/schemas/CompactLookupResponse",
    }
    assert set(schemas["ResolveResponse"]["required"]) == {"root", "block_tokens", "hash_seed"}


def _accepted(text: str) -> bool:
    try:
        decode_block_ids(text)
    except ValueError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode()),
        st.text(alphabet="AQgw+/=9", max_size=120),
        st.binary(max_size=120).map(lambda b: base64.b64encode(b).decode().rstrip("=")),
    )
)
def test_the_declared_pattern_is_exactly_what_the_server_accepts(text: str):
    assert bool(re.fullmatch(BLOCK_IDS_B64_PATTERN, text)) == _accepted(text), text
    if _accepted(text):
        assert len(binascii.a2b_base64(text)) % 16 == 0


# -- tenants ----------------------------------------------------------------------------------


def test_resolve_differs_per_tenant(acme: httpx.Client, globex: httpx.Client):
    ns = unique_ns()
    a, g = resolve(acme, ns), resolve(globex, ns)
    assert a.root != g.root
    assert a.root == Namespace(**{**ns, "salt": "acme"}).root().hex()  # type: ignore[arg-type]
    assert g.root == Namespace(**{**ns, "salt": "globex"}).root().hex()  # type: ignore[arg-type]
    assert resolve(acme, {**ns, "salt": "t"}).root == (
        Namespace(**{**ns, "salt": "acme/t"}).root().hex()  # type: ignore[arg-type]
    )
    r = httpx.post(f"{acme.base_url}/v1/namespaces/resolve", json={"namespace": ns})
    assert r.status_code == 401


def test_a_foreign_tenants_ids_are_a_miss(acme: httpx.Client, globex: httpx.Client):
    ns = unique_ns()
    toks = tokens(7, 64)
    acme_hashes = store_all(acme, ns, toks)
    acme_ids = client_ids(acme, ns, toks)
    assert [h.hex() for h in acme_ids] == acme_hashes
    assert (
        lookup(acme, {"namespace": ns, "block_ids_b64": ids_b64(acme_ids)})["matched_blocks"] == 4
    )
    # globex knows acme's ids (they are computable from acme's tenant name): still a miss
    forged = block_hashes(Namespace(**{**ns, "salt": "acme"}), toks)  # type: ignore[arg-type]
    assert forged == acme_ids
    for namespace in (ns, {**ns, "salt": "acme"}):
        for compact in (True, False):
            out = lookup(
                globex,
                {
                    "namespace": namespace,
                    "block_ids_b64": ids_b64(acme_ids),
                    "compact": compact,
                    "lease_ms": 1000,
                },
            )
            assert out["matched_blocks"] == 0 and out["lease"] is None
    # globex's own first two blocks, then acme's: the match stops at the first foreign id
    store_all(globex, ns, toks[:32])
    globex_ids = client_ids(globex, ns, toks)
    mixed = [*globex_ids[:2], *acme_ids[2:]]
    assert lookup(globex, {"namespace": ns, "block_ids_b64": ids_b64(mixed)})["matched_blocks"] == 2
    sid = globex.post("/v1/sessions", json={}).json()["id"]
    out = lookup(globex, {"namespace": ns, "block_ids_b64": ids_b64(mixed), "session_id": sid})
    assert out["matched_blocks"] == 2
    assert globex.get(f"/v1/sessions/{sid}").json()["head"] == globex_ids[1].hex()
