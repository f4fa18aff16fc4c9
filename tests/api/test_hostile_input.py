"""Each mismatch Schemathesis found between the OpenAPI description and the server, and the
security holes of issue 14, as a plain regression test."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import KEYS
from tests.support.servers import Server, start_server

NS = {"model": "hostile", "block_tokens": 4, "kv_dtype": "bf16", "kv_layout": "x"}
TOKS = list(range(100, 116))
ADMIN_KEY = "admin-key-0123"


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("admin") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_ADMIN_TOKEN": ADMIN_KEY,
        },
    )
    yield server
    server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_a_block_id_outside_its_pattern_is_no_route(client: httpx.Client) -> None:
    # was 422 to a request the description called valid (block_hash had no pattern)
    for method in ("get", "put"):
        r = client.request(method, "/v1/blocks/0", content=b"x")
        assert r.status_code == 404 and r.json()["error"] == "HTTPError"
    spec = client.get("/openapi.json").json()
    param = spec["paths"]["/v1/blocks/{block_hash}"]["get"]["parameters"][0]
    assert param["schema"]["pattern"] == "^[0-9a-f]{32}$"


def test_a_body_that_is_not_json_is_a_documented_400(client: httpx.Client) -> None:
    r = client.post(
        "/v1/sessions", content=b"\x80abc", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and set(r.json()) == {"error", "detail"}
    spec = client.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if "requestBody" in operation:
                assert {"400", "413", "422"} <= set(operation["responses"]), (method, path)


def test_session_kinds_and_id_pattern_are_declared(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    create = spec["components"]["schemas"]["SessionCreate"]["properties"]
    assert create["kind"]["enum"] == ["agent", "chat"]
    assert client.post("/v1/sessions", json={"kind": "0" * 63}).status_code == 422
    # the server accepts exactly what the pattern does: letters beyond ASCII yes, controls no
    assert client.post("/v1/sessions", json={"session_id": "s-é-ü"}).status_code == 201
    assert client.post("/v1/sessions", json={"session_id": "s\x85"}).status_code == 422


def test_no_coercion_of_json_types(client: httpx.Client) -> None:
    # pydantic's lax mode took true for a TTL and "4" for a block size
    assert client.post("/v1/sessions", json={"ttl_s": True}).status_code == 422
    bad_ns = {**NS, "block_tokens": "4"}
    assert client.post("/v1/lookup", json={"namespace": bad_ns, "tokens": TOKS}).status_code == 422
    assert client.post("/v1/lookup", json={"namespace": NS, "tokens": [1, True]}).status_code == 422
    assert client.post("/v1/lookup", json={"namespace": NS, "tokens": [1.0, 2]}).status_code == 200
    r = client.post("/v1/lookup", json={"namespace": NS, "tokens": TOKS, "compact": 1})
    assert r.status_code == 422


def test_tokens_b64_pattern(client: httpx.Client) -> None:
    # non-ASCII in tokens_b64 was schema-valid and rejected
    r = client.post("/v1/lookup", json={"namespace": NS, "tokens_b64": "AAAAAA\u00e9="})
    assert r.status_code == 422
    assert client.post("/v1/lookup", json={"namespace": NS, "tokens_b64": "AAAAAA=="}).is_success


def test_405_names_every_method_of_the_path(client: httpx.Client) -> None:
    # Starlette named only the first route's methods (GET /v1/sessions/{id} lacked DELETE)
    cases = {
        "/v1/sessions": "GET, POST",
        "/v1/sessions/abc": "DELETE, GET",
        "/v1/blocks/batch": "POST",
        "/v1/blocks/" + "ab" * 16: "GET, PUT",
        "/v1/gc": "POST",
    }
    for path, allow in cases.items():
        r = client.request("PATCH", path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (path, r.headers)


def test_json_bodies_are_bounded(open_server: Server) -> None:
    # 8 MiB limit in tests/support/servers.py; JSON routes read whole bodies before this
    big = b'{"namespace": ' + b" " * (9 << 20) + b"}"
    r = httpx.post(
        f"{open_server.url}/v1/lookup",
        content=big,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json()["error"] == "BodyTooLarge"

    def chunks() -> Iterator[bytes]:
        yield b'{"namespace": '
        for _ in range(10):
            yield b" " * (1 << 20)
        yield b"}"

    r = httpx.post(
        f"{open_server.url}/v1/sessions",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413


def test_header_sizes_are_bounded(open_server: Server) -> None:
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=10) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
        )
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert httpx.get(f"{open_server.url}/healthz").status_code == 200


def test_lease_release_checks_the_tenant(auth_server: Server) -> None:
    keys = {tenant: key for key, tenant in KEYS.items()}
    acme, globex = bearer(keys["acme"]), bearer(keys["globex"])
    url = auth_server.url
    plan = httpx.post(f"{url}/v1/store", json={"namespace": NS, "tokens": TOKS}, headers=acme)
    for h in plan.json()["missing"]:
        httpx.put(f"{url}/v1/blocks/{h}", content=b"A" * 32, headers=acme).raise_for_status()
    out = httpx.post(
        f"{url}/v1/lookup", json={"namespace": NS, "tokens": TOKS, "lease_ms": 60000}, headers=acme
    ).json()
    lease = out["lease"]["id"]
    foreign = httpx.delete(f"{url}/v1/leases/{lease}", headers=globex)
    unknown = httpx.delete(f"{url}/v1/leases/{'0' * 32}", headers=globex)
    # another tenant's lease answers exactly like an unknown one (modulo the id echoed)
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.json()["error"] == unknown.json()["error"]
    assert httpx.delete(f"{url}/v1/leases/{lease}", headers=acme).status_code == 204


def test_gc_needs_an_admin_key(auth_server: Server, admin_server: Server) -> None:
    tenant_key = next(iter(KEYS))
    # no admin token and auth on: nobody may sweep every tenant's sessions
    assert httpx.post(f"{auth_server.url}/v1/gc", headers=bearer(tenant_key)).status_code == 403
    for server in (auth_server, admin_server):
        assert httpx.post(f"{server.url}/v1/gc").status_code == 401
        assert httpx.post(f"{server.url}/v1/gc", headers=bearer("wrong")).status_code == 401
    assert httpx.post(f"{admin_server.url}/v1/gc", headers=bearer(tenant_key)).status_code == 403
    assert httpx.post(f"{admin_server.url}/v1/gc", headers=bearer(ADMIN_KEY)).status_code == 200


def test_mutating_endpoints_refuse_missing_or_wrong_keys(auth_server: Server) -> None:
    url = auth_server.url
    sid, bid = "some-session", "ab" * 16
    calls = [
        ("post", "/v1/lookup", {"json": {"namespace": NS, "tokens": TOKS}}),
        ("post", "/v1/store", {"json": {"namespace": NS, "tokens": TOKS}}),
        ("post", "/v1/namespaces/resolve", {"json": {"namespace": NS}}),
        ("put", f"/v1/blocks/{bid}", {"content": b"x"}),
        ("get", f"/v1/blocks/{bid}", {}),
        ("post", "/v1/blocks/batch", {"json": {"hashes": [bid]}}),
        ("post", "/v1/sessions", {"json": {}}),
        ("get", "/v1/sessions", {}),
        ("get", f"/v1/sessions/{sid}", {}),
        ("post", f"/v1/sessions/{sid}/extend", {"json": {}}),
        ("delete", f"/v1/sessions/{sid}", {}),
        ("delete", f"/v1/leases/{bid}", {}),
        ("get", "/v1/stats", {}),
        ("get", "/v1/dataplane", {}),
        ("post", "/v1/gc", {}),
    ]
    for headers in ({}, bearer("wrong-key"), {"authorization": "Basic a2V5LWFjbWU="}):
        for method, path, kwargs in calls:
            r = httpx.request(method, f"{url}{path}", headers=headers, **kwargs)  # type: ignore[arg-type]
            assert r.status_code == 401, (method, path, r.status_code)
            assert "wrong-key" not in r.text and "key-acme" not in r.text


def test_secrets_never_in_logs_or_errors(auth_server: Server) -> None:
    httpx.get(f"{auth_server.url}/v1/whoami", headers=bearer("not-a-key-secret"))
    text = Path(auth_server.log).read_text()
    for key in (*KEYS, "not-a-key-secret"):
        assert key not in text
    from sessioncache.config import Settings

    shown = repr(Settings(api_keys={"sekrit-key": "t"}, admin_token="sekrit-admin"))
    assert "sekrit" not in shown


# -- the admin surfaces (/admin/api/*) and the routing endpoints --------------------------------

ADMIN_CALLS = [
    ("get", "/admin/api/session", None),
    ("get", "/admin/api/overview", None),
    ("get", "/admin/api/history", None),
    ("get", "/admin/api/namespaces", None),
    ("get", "/admin/api/sessions", None),
    ("get", "/admin/api/sessions/some-tenant/some-session", None),
    ("post", "/admin/api/sessions/some-tenant/some-session/extend", {"ttl_s": 60}),
    ("post", "/admin/api/sessions/some-tenant/some-session/close", None),
    ("post", "/admin/api/sessions/some-tenant/some-session/purge", None),
    ("post", "/admin/api/logout", None),
]
ENGINE = {"engine_id": "eng-hostile", "namespace": NS, "endpoint": "tcp://127.0.0.1:9"}
ROUTING_CALLS = [
    ("get", "/v1/engines", None),
    ("post", "/v1/engines", ENGINE),
    ("get", "/v1/engines/eng-hostile", None),
    ("delete", "/v1/engines/eng-hostile", None),
    ("post", "/v1/route", {"namespace": NS, "tokens": TOKS}),
]


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Its own node: wrong admin tokens lock token checks for a minute (admin.auth), which
    must not leak into the admin server's other tests."""
    server = start_server(
        tmp_path_factory.mktemp("guarded") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(KEYS), "SESSIONCACHE_ADMIN_TOKEN": ADMIN_KEY},
    )
    yield server
    server.stop()


def test_admin_api_refuses_missing_or_wrong_tokens(guarded_server: Server) -> None:
    url = guarded_server.url
    tenant_key = next(iter(KEYS))
    refusals = (
        {},
        bearer("wrong-admin-secret"),
        bearer(tenant_key),  # a tenant's API key is no admin token
        {"authorization": f"Basic {ADMIN_KEY}"},  # the right token, the wrong scheme
        {"cookie": "sessioncache_admin=made-up-session"},
    )
    for headers in refusals:
        for method, path, body in ADMIN_CALLS:
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.json()["error"] == "AdminAuthRequired"
            assert "wrong-admin-secret" not in r.text and tenant_key not in r.text
    # and the token itself still opens it (fewer wrong tries than the lock-out needs)
    r = httpx.get(f"{url}/admin/api/overview", headers=bearer(ADMIN_KEY))
    assert r.status_code == 200
    r = httpx.post(
        f"{url}/admin/api/sessions/some-tenant/some-session/close", headers=bearer(ADMIN_KEY)
    )
    assert r.status_code == 404  # authenticated: an unknown session, not a refusal
    text = Path(guarded_server.log).read_text()
    assert "wrong-admin-secret" not in text and ADMIN_KEY not in text


def test_routing_endpoints_refuse_missing_or_wrong_keys(guarded_server: Server) -> None:
    url = guarded_server.url
    for headers in ({}, bearer("wrong-key"), bearer(ADMIN_KEY), {"authorization": "Basic x"}):
        for method, path, body in ROUTING_CALLS:
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            # the admin token is no tenant key: routing is per tenant
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert "wrong-key" not in r.text and ADMIN_KEY not in r.text
    # nothing was registered by the refused calls
    r = httpx.get(f"{url}/v1/engines", headers=bearer(next(iter(KEYS))))
    assert r.status_code == 200 and r.json()["engines"] == []


@pytest.mark.parametrize(
    "path",
    [
        "/admin/api/login",
        "/admin/api/sessions/some-tenant/some-session/extend",
        "/v1/engines",
        "/v1/route",
    ],
)
def test_admin_and_routing_bodies_are_bounded(guarded_server: Server, path: str) -> None:
    # 8 MiB limit in tests/support/servers.py: a declared length over it, then a streamed one
    big = b'{"token": "' + b"a" * (9 << 20) + b'"}'
    headers = {"content-type": "application/json", **bearer(ADMIN_KEY)}
    r = httpx.post(f"{guarded_server.url}{path}", content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"] == "BodyTooLarge", r.text

    def chunks() -> Iterator[bytes]:
        yield b'{"token": "'
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = httpx.post(f"{guarded_server.url}{path}", content=chunks(), headers=headers, timeout=30)
    assert r.status_code == 413, r.text
    assert httpx.get(f"{guarded_server.url}/healthz").status_code == 200
