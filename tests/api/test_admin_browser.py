"""The admin dashboard end to end in headless Chromium (Debian's ``chromium``, driven by
Playwright for Python; no browser download): a real service with traffic from the client
library, the login, the overview against ``/v1/stats``, a session searched, closed and
extended from the page, a session's chain, the namespaces, and a phone-sized screenshot.

Set ``SESSIONCACHE_DASHBOARD_PNG=docs/dashboard.png`` to also write the README's screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import Server, start_server
from tests.support.traffic import agent_traffic

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = os.environ.get("SESSIONCACHE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ADMIN_TOKEN = "admin-" + "s3cret-for-the-browser-test"
KEYS = {"key-acme": "acme", "key-globex": "globex"}
TIMEOUT_MS = 10_000

pytestmark = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists(),
    reason=f"no Chromium at {CHROMIUM} (.ci/run installs Debian's chromium)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("admin-browser") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_ADMIN_TOKEN": ADMIN_TOKEN,
            "SESSIONCACHE_HISTORY_INTERVAL_S": "1",
        },
    )
    agent_traffic(server.url, "key-acme", sessions=4, turns=3, prefix="acme", seed=1)
    agent_traffic(server.url, "key-globex", sessions=3, turns=2, prefix="globex", model=1, seed=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def api(server: Server, key: str = "key-acme") -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {key}"}, timeout=30)


def login(page: Any, server: Server, token: str = ADMIN_TOKEN) -> None:
    page.goto(f"{server.url}/admin")
    page.fill("#token", token)
    page.click("#login-form button[type=submit]")


def test_dashboard_end_to_end(server: Server, browser: Any, tmp_path: Path):
    expect = sync_api.expect
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # a wrong token is refused, the right one logs in with a strict HttpOnly cookie
    login(page, server, "not-the-token")
    expect(page.locator("#login-error")).to_have_text("wrong admin token")
    expect(page.locator("#nav")).to_be_hidden()
    login(page, server)
    expect(page.locator("#nav")).to_be_visible()
    (cookie,) = context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert ADMIN_TOKEN not in cookie["value"]

    # the overview shows what /v1/stats says (no traffic meanwhile: the figures hold still)
    with api(server) as acme:
        stats = acme.get("/v1/stats").json()
    view = page.locator("#view-overview")
    for key, value in (
        ("blocks", stats["blocks"]),
        ("sessions", stats["sessions"]),
        ("pinned_blocks", stats["pinned_blocks"]),
        ("counters.lookups", stats["counters"]["lookups"]),
        ("counters.puts", stats["counters"]["puts"]),
        ("counters.corrupt_reads", stats["counters"]["corrupt_reads"]),
    ):
        expect(view.locator(f'[data-k="{key}"]')).to_have_text(str(value))
    loaded = view.locator('[data-k="counters.loaded_bytes"]')
    expect(loaded).to_have_attribute("data-value", str(stats["counters"]["loaded_bytes"]))
    assert stats["counters"]["loaded_bytes"] > 0
    for tier in stats["tiers"]:
        row = page.locator(f'#tiers tr[data-tier="{tier["name"]}"]')
        expect(row.locator(".used-bytes")).to_have_attribute("data-value", str(tier["used_bytes"]))
        expect(row.locator(".pinned-bytes")).to_have_attribute(
            "data-value", str(tier["pinned_bytes"])
        )
        expect(row.locator(".blocks")).to_have_text(str(tier["blocks"]))
    hit_tokens = int(view.locator('[data-k="prefill.hit_tokens"]').inner_text())
    assert hit_tokens > 0
    expect(page.locator("#chart-hit canvas")).to_have_count(1)
    expect(page.locator("#problems li.ok")).to_have_count(1)
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)
    target = os.environ.get("SESSIONCACHE_DASHBOARD_PNG")
    if target:
        page.wait_for_timeout(2500)  # a few more history points for the charts
        page.screenshot(path=target, full_page=True)

    # sessions: search one, close it from the page, the API no longer has it
    page.click('nav a[data-view="sessions"]')
    page.fill("#session-search", "acme-1-2")
    rows = page.locator("#sessions tbody tr")
    expect(rows).to_have_count(1)
    expect(page.locator("#session-count")).to_have_text("1 sessions")
    rows.first.locator('button[data-action="close"]').click()
    expect(rows).to_have_count(0)
    with api(server) as acme:
        assert acme.get("/v1/sessions/acme-1-2").status_code == 404
        assert acme.get("/v1/sessions/acme-1-1").status_code == 200

    # extend another: the page shows the new expiry, the API agrees
    with api(server) as acme:
        before = acme.get("/v1/sessions/acme-1-1").json()["expires_at"]
    page.fill("#session-search", "acme-1-1")
    expect(rows).to_have_count(1)
    expires = rows.first.locator("td.expires")
    expect(expires).to_have_attribute("data-value", str(before))
    page.wait_for_timeout(50)  # the new expiry is now + TTL: later than the old one
    rows.first.locator('button[data-action="extend"]').click()
    expect(expires).not_to_have_attribute("data-value", str(before))
    shown = float(expires.get_attribute("data-value") or 0)
    with api(server) as acme:
        after = acme.get("/v1/sessions/acme-1-1").json()["expires_at"]
    assert after > before and shown == pytest.approx(after)

    # its chain: one box per block, coloured by the fastest tier holding it
    rows.first.locator("td a").click()
    expect(page.locator("#detail-id")).to_have_text("acme-1-1")
    strip = page.locator("#strip span")
    expect(strip.first).to_have_attribute("data-tier", "cpu")
    assert strip.count() == 10  # 4 system-prompt blocks + 3 turns of 2

    # sorting and paging over every tenant's sessions
    page.click('nav a[data-view="sessions"]')
    page.fill("#session-search", "")
    expect(page.locator("#session-count")).to_have_text("6 sessions")
    page.click('#sessions th[data-sort="id"]')
    expect(rows.first).to_have_attribute("data-session", "globex-2-2")

    # namespaces and tenants
    page.click('nav a[data-view="namespaces"]')
    expect(page.locator("#namespaces tbody tr")).to_have_count(2)
    expect(page.locator('#tenants tr[data-tenant="acme"]')).to_have_count(1)
    expect(page.locator('#tenants tr[data-tenant="globex"]')).to_have_count(1)
    # what each tenant holds against its bounds
    expect(page.locator('#tenants tr[data-tenant="acme"]')).to_contain_text("sessions 3/65536")
    expect(page.locator('#tenants tr[data-tenant="acme"]')).to_contain_text("namespaces 1/1024")

    # a phone: the overview fits the width (tables scroll inside their boxes)
    page.set_viewport_size({"width": 390, "height": 844})
    page.click('nav a[data-view="overview"]')
    expect(view.locator('[data-k="blocks"]')).not_to_be_empty()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.screenshot(path=str(tmp_path / "phone.png"), full_page=True)
    assert (tmp_path / "overview.png").stat().st_size > 10_000
    assert errors == []
    context.close()


def test_logged_out_page_shows_only_the_login(server: Server, browser: Any):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{server.url}/admin")
    sync_api.expect(page.locator("#login")).to_be_visible()
    sync_api.expect(page.locator("#view-overview")).to_be_hidden()
    # a request from the page without the login's CSRF token is refused
    status = page.evaluate(
        "async () => (await fetch('/admin/api/sessions/acme/acme-1-1/close',"
        " {method: 'POST'})).status"
    )
    assert status == 401
    context.close()
