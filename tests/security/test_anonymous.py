"""Nothing an anonymous client sends reaches what others share: the admin's lockout, the login
route's parser, and the tenant and model names behind ``/metrics``."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx

from tests.security.conftest import ALICE, BOB, METRICS, Guarded, NodeFactory, client

ADMIN_TOKEN = "admin-" + "token-of-the-anonymous-tests"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
SECRET_MODEL = "bobs-unreleased-model-"
TOP = 5


def namespace(model: str) -> dict[str, object]:
    return {"model": model, "block_tokens": 4, "kv_dtype": "u8", "kv_layout": "x"}


def from_address(node: Guarded, address: str) -> httpx.Client:
    """An anonymous client whose connections leave from ``address`` (any of 127/8 reaches the
    node's 127.0.0.1)."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=node.url, transport=transport, timeout=30)


def test_wrong_admin_tokens_lock_out_neither_the_admin_nor_another_address(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node({"SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN})
    with from_address(node, "127.0.0.1") as bob, from_address(node, "127.0.0.2") as other:
        guesses = [bob.post("/admin/api/login", json={"token": f"guess-{i}"}) for i in range(30)]
        assert [r.status_code for r in guesses] == [401] * 29 + [429]  # the 30th locks it
        for path in ("/admin/api/overview", "/admin/api/session"):
            refused = bob.get(path, headers={"authorization": "Bearer guess"})
            assert refused.status_code == 429 and "30" in refused.json()["detail"], refused.text
        # the valid token is accepted from the locked address too
        assert bob.get("/admin/api/overview", headers=ADMIN).status_code == 200
        assert bob.post("/v1/gc", headers=ADMIN).status_code == 200
        login = bob.post("/admin/api/login", json={"token": ADMIN_TOKEN})
        assert login.status_code == 204, login.text
        assert bob.get("/admin/api/session").json()["via"] == "cookie"
        # another address: its own count, untouched by the first's failures
        wrong = other.post("/admin/api/login", json={"token": "guess"})
        assert wrong.status_code == 401 and wrong.json()["detail"] == "wrong admin token"
        assert other.get("/admin/api/overview", headers=ADMIN).status_code == 200
    with client(node, ALICE) as alice:  # a tenant's key still works beside it
        assert alice.post(
            "/v1/lookup", json={"namespace": namespace("a"), "tokens": [1]}
        ).is_success


def padded_login(size: int) -> bytes:
    """A login body of ``size`` bytes whose token is wrong: parsed whole, it answers 401."""
    head = b'{"token": "wrong", "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_a_large_login_body_is_refused_before_it_is_parsed(guarded_node: NodeFactory) -> None:
    node = guarded_node({"SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN})
    body = padded_login(4 << 20)
    json_headers = {"content-type": "application/json"}
    with httpx.Client(base_url=node.url, timeout=30) as bob:
        declared = bob.post("/admin/api/login", content=body, headers=json_headers)
        assert declared.status_code == 413, declared.text
        assert "8192" in declared.json()["detail"]

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(body), 64 << 10):
                yield body[start : start + (64 << 10)]

        try:
            streamed = bob.post("/admin/api/login", content=chunks(), headers=json_headers)
            assert streamed.status_code == 413, streamed.text
        except httpx.TransportError:
            pass  # answered and closed while the body was still being sent: not read
        assert bob.post("/admin/api/login", json={"token": ADMIN_TOKEN}).status_code == 204
    with client(node, ALICE) as alice:
        assert alice.post(
            "/v1/lookup", json={"namespace": namespace("a"), "tokens": [1]}
        ).is_success


def namespace_values(text: str) -> set[str]:
    return set(re.findall(r'^sessioncache_namespace_\w+\{[^}]*namespace="([^"]*)"', text, re.M))


def total(text: str, name: str) -> float:
    """The sum of a metric's rows."""
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_anonymous_metrics_carry_no_tenant_or_model_names(guarded_node: NodeFactory) -> None:
    node = guarded_node(
        {
            "SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN,
            "SESSIONCACHE_METRICS_TOP_NAMESPACES": str(TOP),
        }
    )
    with client(node, ALICE) as alice, client(node, BOB) as bob:
        ns = namespace("alices-model")
        assert alice.post("/v1/lookup", json={"namespace": ns, "tokens": [1]}).is_success
        before = len(httpx.get(f"{node.url}/metrics").content)
        for i in range(60):
            ns = namespace(SECRET_MODEL + f"{i:03d}-" + "m" * 400)
            assert bob.post("/v1/lookup", json={"namespace": ns, "tokens": [1, 2, 3, 4]}).is_success
        anonymous = httpx.get(f"{node.url}/metrics").text
        as_tenant = bob.get("/metrics").text
        detailed = httpx.get(f"{node.url}/metrics", headers=METRICS).text
        by_admin = httpx.get(f"{node.url}/metrics", headers=ADMIN).text
    for text in (anonymous, as_tenant):
        for name in (SECRET_MODEL, "alices-model", 'tenant="', 'model="', "bob", "alice"):
            assert name not in text, name
        assert "sessioncache_lookups_total 61.0" in text  # the node-wide series stay
    grown = len(anonymous.encode()) - before
    assert grown < 4096, f"anonymous /metrics grew by {grown} bytes with bob's namespaces"
    for text in (detailed, by_admin):
        values = namespace_values(text)
        assert len(values) == TOP + 1 and "other" in values, values
        assert 'tenant="bob"' in text
        assert total(text, "sessioncache_namespace_miss_tokens_total") == 1 + 60 * 4  # all rows
    wrong = httpx.get(f"{node.url}/metrics", headers={"authorization": "Bearer guess"})
    assert wrong.status_code == 401, wrong.text
