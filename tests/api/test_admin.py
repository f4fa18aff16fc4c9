"""``/admin`` access rules and JSON over HTTP against real servers: the admin token (bearer
or login cookie), CSRF on mutations, the dashboard off without a token unless the service
runs open on loopback, bad input answered 4xx, and the token never in the log."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import run_cli
from tests.support.servers import Server, start_server
from tests.support.traffic import agent_traffic

ADMIN_TOKEN = "admin-token-" + "for-test-admin"
KEYS = {"key-acme": "acme", "key-globex": "globex"}
BEARER = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("admin") / "data",
        {"SESSIONCACHE_API_KEYS": json.dumps(KEYS), "SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    agent_traffic(server.url, "key-acme", sessions=5, turns=1, prefix="acme")
    agent_traffic(server.url, "key-globex", sessions=2, turns=1, prefix="globex", model=1)
    yield server
    server.stop()


def logged_in(server: Server) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=server.url, timeout=30)
    r = client.post("/admin/api/login", json={"token": ADMIN_TOKEN})
    assert r.status_code == 204
    csrf = client.get("/admin/api/session").json()["csrf"]
    return client, csrf


GETS = [
    "/admin/api/session",
    "/admin/api/overview",
    "/admin/api/history",
    "/admin/api/namespaces",
    "/admin/api/sessions",
    "/admin/api/sessions/acme/acme-0-0",
]


def test_refused_without_the_token_or_with_a_wrong_one(server: Server):
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "Bearer key-acme"},  # a tenant's API key is no admin token
        {"cookie": "sessioncache_admin=made-up"},
    ):
        for path in GETS:
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
        r = httpx.post(server.url + "/admin/api/sessions/acme/acme-0-0/close", headers=headers)
        assert r.status_code == 401
    assert httpx.post(server.url + "/admin/api/login", json={"token": "wrong"}).status_code == 401
    assert httpx.post(server.url + "/admin/api/login", json={}).status_code == 422
    # the page itself holds no data: it is served, and shows the login form
    page = httpx.get(server.url + "/admin")
    assert page.status_code == 200 and "login-form" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    with httpx.Client(base_url=server.url, headers={"authorization": "Bearer key-acme"}) as c:
        assert c.get("/v1/sessions/acme-0-0").status_code == 200  # nothing was closed


def test_login_cookie_and_csrf(server: Server):
    client, csrf = logged_in(server)
    try:
        cookie = next(c for c in client.cookies.jar if c.name == "sessioncache_admin")
        assert cookie.path == "/admin" and ADMIN_TOKEN not in (cookie.value or "")
        login = client.post("/admin/api/login", json={"token": ADMIN_TOKEN})
        header = login.headers["set-cookie"].lower()
        assert "httponly" in header and "samesite=strict" in header
        csrf = client.get("/admin/api/session").json()["csrf"]  # the new login's
        for path in GETS:
            assert client.get(path).status_code == 200, path
        # mutations without the CSRF token, or with another login's, are refused
        url = "/admin/api/sessions/acme/acme-0-1/extend"
        assert client.post(url, json={}).status_code == 403
        another, other = logged_in(server)
        another.close()
        assert client.post(url, json={}, headers={"x-csrf-token": other}).status_code == 403
        r = client.post(url, json={"ttl_s": 7200}, headers={"x-csrf-token": csrf})
        assert r.status_code == 200 and r.json()["ttl_s"] == 7200
        assert r.json()["expires_at"] == pytest.approx(r.json()["last_seen"] + 7200)
        # logging out ends the login
        assert client.post("/admin/api/logout", headers={"x-csrf-token": csrf}).status_code == 204
        assert client.get("/admin/api/overview").status_code == 401
    finally:
        client.close()


def test_bearer_needs_no_csrf_and_purge_drops_the_chain(server: Server):
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=30) as admin:
        detail = admin.get("/admin/api/sessions/acme/acme-0-2").json()
        assert detail["blocks"] == 6 and {b["tiers"][0] for b in detail["chain"]} == {"cpu"}
        before = admin.get("/admin/api/overview").json()["blocks"]
        r = admin.post("/admin/api/sessions/acme/acme-0-2/purge")
        assert r.status_code == 200
        # the 4 system-prompt blocks are pinned by the tenant's other sessions: they stay
        assert r.json() == {"dropped_blocks": 2}
        assert admin.get("/admin/api/overview").json()["blocks"] == before - 2
        assert admin.get("/admin/api/sessions/acme/acme-0-2").status_code == 404
        assert admin.post("/admin/api/sessions/acme/acme-0-2/close").status_code == 404


def test_sessions_are_searched_sorted_and_paged(server: Server):
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=30) as admin:
        everyone = admin.get("/admin/api/sessions", params={"sort": "id", "order": "asc"}).json()
        ids = [s["id"] for s in everyone["sessions"]]
        assert ids == sorted(ids) and everyone["total"] == len(ids) >= 5
        paged: list[str] = []
        for offset in range(0, len(ids), 2):
            page = admin.get(
                "/admin/api/sessions",
                params={"sort": "id", "order": "asc", "offset": offset, "limit": 2},
            ).json()
            assert page["total"] == len(ids)
            paged += [s["id"] for s in page["sessions"]]
        assert paged == ids
        found = admin.get("/admin/api/sessions", params={"q": "GLOBEX"}).json()
        assert found["total"] == 2 and {s["tenant"] for s in found["sessions"]} == {"globex"}
        # LIKE wildcards are literal characters
        assert admin.get("/admin/api/sessions", params={"q": "%"}).json()["total"] == 0
        row = found["sessions"][0]
        assert row["blocks"] == 6 and row["pinned"] and row["pinned_bytes"] == 6 * 4096
        assert row["hit_tokens"] > 0


@pytest.mark.parametrize(
    "params",
    [{"sort": "bogus"}, {"order": "up"}, {"limit": 0}, {"limit": 501}, {"offset": -1}],
)
def test_bad_listing_parameters_are_422(server: Server, params: dict[str, object]):
    r = httpx.get(server.url + "/admin/api/sessions", params=params, headers=BEARER)  # type: ignore[arg-type]
    assert r.status_code == 422 and r.json()["error"] == "ValidationError"


def test_unknown_session_and_bad_ttl(server: Server):
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=30) as admin:
        assert admin.get("/admin/api/sessions/acme/nope").status_code == 404
        assert admin.post("/admin/api/sessions/acme/nope/extend", json={}).status_code == 404
        assert (
            admin.post("/admin/api/sessions/acme/acme-0-3/extend", json={"ttl_s": -1}).status_code
            == 422
        )


def test_the_token_is_never_logged(server: Server):
    httpx.get(server.url + "/admin/api/overview", headers=BEARER)
    httpx.post(server.url + "/admin/api/login", json={"token": ADMIN_TOKEN})
    assert ADMIN_TOKEN not in server.log.read_text()


def test_open_local_mode_serves_the_dashboard_but_mutations_need_csrf(open_server: Server):
    with httpx.Client(base_url=open_server.url, timeout=30) as c:
        session = c.get("/admin/api/session").json()
        assert session["mode"] == "open" and session["csrf"]
        assert c.get("/admin/api/overview").status_code == 200
        c.post("/v1/sessions", json={"session_id": "open-1"})
        assert c.post("/admin/api/sessions/default/open-1/close").status_code == 403
        r = c.post(
            "/admin/api/sessions/default/open-1/close", headers={"x-csrf-token": session["csrf"]}
        )
        assert r.status_code == 204
        assert c.get("/v1/sessions/open-1").status_code == 404


def test_stats_command_prints_the_overview(server: Server):
    done = run_cli("stats", "--url", server.url, env={"SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN})
    assert done.returncode == 0, done.stderr
    overview = httpx.get(server.url + "/admin/api/overview", headers=BEARER).json()
    out = done.stdout
    assert f"hit tokens       {overview['prefill']['hit_tokens']}" in out
    assert f"sessions         {overview['sessions']}" in out
    assert "tier" in out and "cpu" in out and "disk" in out and "problems: none (ready)" in out
    refused = run_cli("stats", "--url", server.url, "--token", "wrong")
    assert refused.returncode == 2 and "401" in refused.stderr and "wrong" not in refused.stdout


STATS = [sys.executable, "-m", "sessioncache.cli", "stats"]


def test_stats_watch_redraws(server: Server):
    process = subprocess.Popen(
        [*STATS, "--url", server.url, "--watch", "--interval", "0.2", "--token", ADMIN_TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        seen = ""
        assert process.stdout is not None
        while seen.count("sessioncache at ") < 2 and time.monotonic() < deadline:
            seen += process.stdout.readline()
    finally:
        process.terminate()
        process.wait(10)
    assert seen.count("sessioncache at ") >= 2


ROOT = Path(__file__).resolve().parents[2]
NO_FLEET = {  # with Redis only
    "sessioncache_fleet_pending",
    "sessioncache_fleet_nodes",
    "sessioncache_shared_unpublished_blocks",
    "sessioncache_shared_republish_published_total",
    "sessioncache_shared_republish_dropped_total",
}


def test_metrics_docs_and_grafana_agree_with_a_scrape(server: Server):
    text = httpx.get(server.url + "/metrics", headers=BEARER).text  # every series
    scraped = set(re.findall(r"^# TYPE (sessioncache_\w+) (\w+)", text, re.MULTILINE))
    names = set()
    for name, kind in scraped:
        if name.endswith("_created"):
            continue  # prometheus_client's creation time beside each histogram
        names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    docs = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(sessioncache_\w+)`", docs))
    assert names - documented == set(), "on /metrics but not in docs/metrics.md"
    assert documented - names - NO_FLEET == set(), "documented but not on /metrics"
    grafana = (ROOT / "docs" / "grafana" / "sessioncache.json").read_text()
    json.loads(grafana)
    used = {
        re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"sessioncache_\w+", grafana)
    }
    used.discard("sessioncache_overview")  # the dashboard's uid
    assert used - names - NO_FLEET == set(), "the Grafana board asks for unknown series"


def test_a_session_is_named_by_its_tenant_and_its_id(server: Server):
    for key, kind in (("key-acme", "chat"), ("key-globex", "agent")):
        r = httpx.post(
            server.url + "/v1/sessions",
            json={"session_id": "twin", "kind": kind},
            headers={"authorization": f"Bearer {key}"},
        )
        assert r.status_code == 201, r.text
    with httpx.Client(base_url=server.url, headers=BEARER, timeout=30) as admin:
        assert admin.get("/admin/api/sessions/acme/twin").json()["kind"] == "chat"
        assert admin.get("/admin/api/sessions/globex/twin").json()["kind"] == "agent"
        twins = admin.get("/admin/api/sessions", params={"q": "twin"}).json()
        assert sorted(s["tenant"] for s in twins["sessions"]) == ["acme", "globex"]
        assert admin.post("/admin/api/sessions/acme/twin/close").status_code == 204
        assert admin.get("/admin/api/sessions/acme/twin").status_code == 404
        assert admin.get("/admin/api/sessions/globex/twin").json()["kind"] == "agent"
        assert admin.post("/admin/api/sessions/globex/twin/close").status_code == 204
