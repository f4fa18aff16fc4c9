"""``AdminAuth``: which mode a configuration gives, constant-time token checks, logins that
expire, CSRF per login, wrong tokens counted per source address."""

from __future__ import annotations

from sessioncache.api.admin.auth import MAX_LOGINS, Admin, AdminAuth
from sessioncache.api.admin.lockout import FAILURE_WINDOW_S, MAX_FAILURES, Lockout
from sessioncache.config import Settings
from sessioncache.errors import AuthRefused, RateLimited

HERE = "192.0.2.1"


def test_modes_from_settings():
    keys = {"k": "acme"}
    assert AdminAuth.from_settings(Settings(admin_token="t", api_keys=keys)).mode == "token"
    assert AdminAuth.from_settings(Settings(admin_token="t", host="0.0.0.0")).mode == "token"
    # no admin token: open only when the whole service is (no keys, loopback)
    assert AdminAuth.from_settings(Settings()).mode == "open"
    assert AdminAuth.from_settings(Settings(api_keys=keys)).mode == "disabled"
    assert AdminAuth.from_settings(Settings(host="0.0.0.0")).mode == "disabled"


def test_the_secret_stays_out_of_the_settings_repr():
    settings = Settings(admin_token="hunter2-admin")
    assert "hunter2-admin" not in repr(settings) and "hunter2-admin" not in str(settings)


def test_tokens_logins_and_csrf():
    now = [1000.0]
    auth = AdminAuth("tok", open_mode=False, login_ttl_s=60, clock=lambda: now[0])
    assert not auth.token_matches("tok2", HERE) and not auth.token_matches("", HERE)
    assert auth.token_matches("tok", HERE)
    assert auth.login("nope", HERE) is None
    login = auth.login("tok", HERE)
    assert login is not None and auth.session(login.session_id) == login
    admin = Admin("cookie", login.csrf)
    assert auth.csrf_matches(admin, login.csrf)
    assert not auth.csrf_matches(admin, None) and not auth.csrf_matches(admin, "x")
    assert auth.csrf_matches(Admin("bearer", None), None)
    now[0] += 61
    assert auth.session(login.session_id) is None  # expired
    again = auth.login("tok", HERE)
    assert again is not None
    auth.logout(again.session_id)
    assert auth.session(again.session_id) is None


def test_logins_are_bounded():
    auth = AdminAuth("tok", open_mode=False)
    first = auth.login("tok", HERE)
    assert first is not None
    for _ in range(MAX_LOGINS):
        auth.login("tok", HERE)
    assert auth.session(first.session_id) is None


def test_no_token_means_no_login():
    auth = AdminAuth(None, open_mode=True)
    assert auth.mode == "open" and auth.login("", HERE) is None
    assert not auth.token_matches("x", HERE)


def test_wrong_tokens_lock_their_address_out_but_never_the_right_token():
    auth = AdminAuth("tok", open_mode=False)
    for _ in range(MAX_FAILURES):
        assert not auth.token_matches("guess", HERE)
    assert isinstance(auth.refusal(HERE, AuthRefused("wrong")), RateLimited)
    assert auth.token_matches("tok", HERE) and auth.login("tok", HERE) is not None
    elsewhere = auth.refusal("192.0.2.2", AuthRefused("wrong"))
    assert isinstance(elsewhere, AuthRefused) and str(elsewhere) == "wrong"


def test_the_lockout_passes_with_its_window_and_forgets_the_oldest_address():
    now = [0.0]
    lockout = Lockout(max_addresses=2, clock=lambda: now[0])
    for _ in range(MAX_FAILURES):
        lockout.failed("a")
    assert lockout.locked("a")
    now[0] += FAILURE_WINDOW_S + 1
    assert not lockout.locked("a")
    for _ in range(MAX_FAILURES):
        lockout.failed("a")
    lockout.failed("b")
    lockout.failed("c")  # a table of two: "a", whose last failure is oldest, goes
    assert not lockout.locked("a")


def test_the_metrics_token_or_the_admin_token_opens_the_metrics():
    auth = AdminAuth("tok", open_mode=False, metrics_token="scrape")
    assert auth.metrics_token_matches("scrape", HERE) and auth.metrics_token_matches("tok", HERE)
    assert not auth.metrics_token_matches("guess", HERE)
    assert not auth.token_matches("scrape", HERE)  # the metrics token opens no dashboard
    settings = Settings(api_keys={"k": "acme"}, metrics_token="scrape")
    assert AdminAuth.from_settings(settings).metrics_token_matches("scrape", HERE)
