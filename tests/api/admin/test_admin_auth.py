"""``AdminAuth``: which mode a configuration gives, constant-time token checks, logins that
expire, CSRF per login."""

from __future__ import annotations

from sessioncache.api.admin.auth import MAX_LOGINS, Admin, AdminAuth
from sessioncache.config import Settings


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
    assert (
        not auth.token_matches("tok2") and not auth.token_matches("") and auth.token_matches("tok")
    )
    assert auth.login("nope") is None
    login = auth.login("tok")
    assert login is not None and auth.session(login.session_id) == login
    admin = Admin("cookie", login.csrf)
    assert auth.csrf_matches(admin, login.csrf)
    assert not auth.csrf_matches(admin, None) and not auth.csrf_matches(admin, "x")
    assert auth.csrf_matches(Admin("bearer", None), None)
    now[0] += 61
    assert auth.session(login.session_id) is None  # expired
    again = auth.login("tok")
    assert again is not None
    auth.logout(again.session_id)
    assert auth.session(again.session_id) is None


def test_logins_are_bounded():
    auth = AdminAuth("tok", open_mode=False)
    first = auth.login("tok")
    assert first is not None
    for _ in range(MAX_LOGINS):
        auth.login("tok")
    assert auth.session(first.session_id) is None


def test_no_token_means_no_login():
    auth = AdminAuth(None, open_mode=True)
    assert auth.mode == "open" and auth.login("") is None and not auth.token_matches("x")


def test_guessing_is_throttled():
    from sessioncache.api.admin.auth import FAILURE_WINDOW_S, MAX_FAILURES

    now = [0.0]
    auth = AdminAuth("tok", open_mode=False, clock=lambda: now[0])
    for _ in range(MAX_FAILURES):
        assert not auth.token_matches("guess")
    assert auth.throttled
    assert not auth.token_matches("tok")  # even the right one, for the window
    assert auth.login("tok") is None
    now[0] += FAILURE_WINDOW_S + 1
    assert not auth.throttled and auth.token_matches("tok")
