"""HELLO's API key maps to a tenant exactly as in the REST API; a tenant can neither read nor
extend another tenant's chains through the stream."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from sessioncache.connector import StreamClient, discover
from sessioncache.dataplane import frames
from sessioncache.errors import AuthRefused, ErrorCode, StoreRefused
from sessioncache.hashing import tenant_namespace
from tests.sessioncache.dataplane.conftest import (
    BLOCK,
    NS,
    assert_closed,
    connect,
    pattern,
    raw_connect,
    read_frame,
    rest,
    settled,
    tokens,
    wait_until,
)
from tests.support.servers import Server


@pytest.mark.parametrize("key", [None, "key-nope"])
def test_wrong_credentials_are_refused_and_the_connection_closed(auth_server: Server, key):
    address = discover(auth_server.url, api_key="key-acme")
    with pytest.raises(AuthRefused, match="API key"):
        StreamClient.connect(address, api_key=key)
    with raw_connect(auth_server, "key-acme") as sock:
        sock.sendall(frames.encode_hello(1, frames.Hello(key)))
        header, body = read_frame(sock)
        error = frames.decode_error(body, header.flags)
        assert (error.code, error.closing) == (ErrorCode.AUTH, True)
        assert_closed(sock)
    wait_until(lambda: settled(auth_server, "key-acme"))


def test_discovery_needs_a_key(auth_server: Server):
    assert httpx.get(f"{auth_server.url}/v1/dataplane").status_code == 401


def test_tenants_are_isolated(auth_server: Server):
    toks = tokens(50, 6)
    with connect(auth_server, "key-acme") as acme, connect(auth_server, "key-globex") as globex:
        assert (acme.tenant, acme.auth, globex.tenant) == ("acme", True, "globex")
        acme_root = acme.resolve(NS)
        assert acme_root == tenant_namespace(NS, "acme").root()
        acme_ids = acme.block_hashes(acme_root, toks)
        assert acme.store(acme_root, toks, [pattern(h) for h in acme_ids]).stored == 6
        assert acme.lookup(acme_root, acme_ids).matched == 6

        globex_root = globex.resolve(NS)  # the same namespace: another root
        assert globex_root != acme_root
        # acme's ids, asked for under globex's own root or loaded by id: plain misses, which
        # do not even touch acme's blocks (no hit counted, no TTL slid, no lease)
        hits = rest(auth_server, "/v1/stats", "key-acme")["counters"]["hit_blocks"]
        assert globex.lookup(globex_root, acme_ids, lease_ms=1000).matched == 0
        assert globex.load(acme_ids) == [None] * 6
        assert rest(auth_server, "/v1/stats", "key-acme")["counters"]["hit_blocks"] == hits
        # acme's root was never resolved on globex's connection
        globex._namespaces[acme_root] = NS
        with pytest.raises(StoreRefused, match="not resolved"):
            globex.lookup(acme_root, acme_ids)
        with pytest.raises(StoreRefused, match="not resolved"):
            globex.store(acme_root, tokens(51, 1), [np.zeros(BLOCK, np.uint8)])
        # nor can globex hang blocks off acme's chain under its own root
        with pytest.raises(StoreRefused, match="is not held under"):
            globex.store(
                globex_root, tokens(51, 1), [np.zeros(BLOCK, np.uint8)], parent=acme_ids[-1]
            )
        # acme's blocks are untouched
        found = acme.lookup(acme_root, acme_ids, lease_ms=10_000)
        out = [np.empty(BLOCK, np.uint8) for _ in range(6)]
        acme.load_into(found, out, release=True)
        assert all(np.array_equal(o, pattern(h)) for o, h in zip(out, acme_ids, strict=True))
    assert rest(auth_server, "/v1/stats", "key-acme")["leases"] == 0
