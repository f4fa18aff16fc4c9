"""Who may use ``/admin``: the admin token, login sessions (cookie) and CSRF tokens.

The admin token (``SESSIONCACHE_ADMIN_TOKEN``) is separate from the tenants' API keys: a
tenant key never opens the dashboard, which shows and acts on every tenant. A request is an
admin's when it carries

* ``Authorization: Bearer <admin token>`` (scripts, ``sessioncache stats``), or
* the login cookie: ``POST /admin/api/login`` with the token answers a random session id in an
  HttpOnly, SameSite=Strict cookie; the id maps to a login held in memory here (a restart logs
  everyone out; the token itself never goes into a cookie).

Mutations also need the login's CSRF token in ``X-CSRF-Token`` (the page reads it from
``GET /admin/api/session``, which another origin cannot read). A bearer request needs none: a
browser never adds that header by itself, so a cross-site request cannot carry it.

Without an admin token the dashboard is served only in the local-only open mode (no API keys,
bound to loopback: ``serve`` refuses anything else without keys); there every local caller is
an admin, and mutations still need the process's CSRF token, because any web page the operator
visits can send requests to localhost.

Tokens are compared with ``hmac.compare_digest`` and never logged.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sessioncache.config import Settings
from sessioncache.dataplane.transport import is_loopback

COOKIE = "sessioncache_admin"
CSRF_HEADER = "x-csrf-token"
LOGIN_TTL_S = 12 * 3600.0
MAX_LOGINS = 1000
MAX_FAILURES = 30
"""Wrong tokens (login or bearer) per ``FAILURE_WINDOW_S`` after which every token check
fails until the window has passed: guessing costs a window per ``MAX_FAILURES`` tries."""
FAILURE_WINDOW_S = 60.0

Mode = Literal["token", "open", "disabled"]


@dataclass(frozen=True, slots=True)
class Admin:
    """An authenticated admin request."""

    via: Literal["bearer", "cookie", "open"]
    csrf: str | None
    """The CSRF token mutations must echo (None for bearer requests: they need none)."""


@dataclass(frozen=True, slots=True)
class Login:
    session_id: str
    csrf: str
    expires_at: float


class AdminAuth:
    """The admin token, the logins made with it, and the open mode's CSRF token."""

    def __init__(
        self,
        token: str | None,
        *,
        open_mode: bool,
        login_ttl_s: float = LOGIN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._token = token.encode() if token else None
        self.mode: Mode = "token" if token else "open" if open_mode else "disabled"
        self.login_ttl_s = login_ttl_s
        self._clock = clock
        self._logins: dict[str, Login] = {}
        self._failures: list[float] = []
        self._lock = threading.Lock()
        self.open_csrf = secrets.token_urlsafe(32)

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminAuth:
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        return cls(token, open_mode=not settings.api_keys and is_loopback(settings.host))

    def token_matches(self, candidate: str) -> bool:
        """Constant-time comparison with the admin token (False when there is none, and for
        every token while too many wrong ones came recently: ``throttled``)."""
        if self._token is None:
            return False
        matches = hmac.compare_digest(candidate.encode(), self._token)
        now = self._clock()
        with self._lock:
            self._failures = [t for t in self._failures if t > now - FAILURE_WINDOW_S]
            if len(self._failures) >= MAX_FAILURES:
                return False
            if not matches:
                self._failures.append(now)
        return matches

    @property
    def throttled(self) -> bool:
        """Too many wrong tokens lately: token checks fail until the window has passed."""
        now = self._clock()
        with self._lock:
            return sum(t > now - FAILURE_WINDOW_S for t in self._failures) >= MAX_FAILURES

    def login(self, candidate: str) -> Login | None:
        """A new login when ``candidate`` is the admin token, else None."""
        if not self.token_matches(candidate):
            return None
        now = self._clock()
        login = Login(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now + self.login_ttl_s)
        with self._lock:
            if len(self._logins) >= MAX_LOGINS:
                self._logins = {k: v for k, v in self._logins.items() if v.expires_at > now}
                while len(self._logins) >= MAX_LOGINS:  # still full: the oldest goes
                    del self._logins[next(iter(self._logins))]
            self._logins[login.session_id] = login
        return login

    def logout(self, session_id: str) -> None:
        with self._lock:
            self._logins.pop(session_id, None)

    def session(self, session_id: str) -> Login | None:
        """The unexpired login of a cookie's session id."""
        with self._lock:
            login = self._logins.get(session_id)
            if login is not None and login.expires_at <= self._clock():
                del self._logins[session_id]
                return None
            return login

    def csrf_matches(self, admin: Admin, candidate: str | None) -> bool:
        if admin.via == "bearer":
            return True
        if admin.csrf is None or candidate is None:
            return False
        return hmac.compare_digest(candidate.encode(), admin.csrf.encode())
