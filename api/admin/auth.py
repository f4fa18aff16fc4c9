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

Tokens are compared with ``hmac.compare_digest`` and never logged. A wrong one counts against
its source address (``lockout.Lockout``): a locked address's wrong tokens are answered 429, and
the right token is accepted from any address, whatever its count.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from sessioncache.api.admin.lockout import Lockout
from sessioncache.config import Settings
from sessioncache.dataplane.transport import is_loopback
from sessioncache.errors import AuthRefused, RateLimited

COOKIE = "sessioncache_admin"
CSRF_HEADER = "x-csrf-token"
LOGIN_TTL_S = 12 * 3600.0
MAX_LOGINS = 1000

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
    """The admin token, the logins made with it, and the open mode's CSRF token; and the
    metrics token, which opens ``/metrics``' per-tenant series (``metrics.reads_detail``)."""

    def __init__(
        self,
        token: str | None,
        *,
        open_mode: bool,
        metrics_token: str | None = None,
        login_ttl_s: float = LOGIN_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._token = token.encode() if token else None
        self._metrics_token = metrics_token.encode() if metrics_token else None
        self.mode: Mode = "token" if token else "open" if open_mode else "disabled"
        self.login_ttl_s = login_ttl_s
        self._clock = clock
        self._logins: dict[str, Login] = {}
        self._lock = threading.Lock()
        self.lockout = Lockout()
        self.open_csrf = secrets.token_urlsafe(32)

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminAuth:
        token = settings.admin_token.get_secret_value() if settings.admin_token else None
        metrics = settings.metrics_token.get_secret_value() if settings.metrics_token else None
        open_mode = not settings.api_keys and is_loopback(settings.host)
        return cls(token, open_mode=open_mode, metrics_token=metrics)

    def token_matches(self, candidate: str, address: str) -> bool:
        """Constant-time comparison with the admin token (False when there is none). A wrong
        candidate counts against ``address``; the right one is accepted whatever its count."""
        return self._matches(candidate, address, self._token)

    def metrics_token_matches(self, candidate: str, address: str) -> bool:
        """``token_matches`` for the metrics token or the admin token."""
        return self._matches(candidate, address, self._metrics_token, self._token)

    def _matches(self, candidate: str, address: str, *secrets_: bytes | None) -> bool:
        held = [secret for secret in secrets_ if secret is not None]
        if not held:
            return False
        if any(hmac.compare_digest(candidate.encode(), secret) for secret in held):
            return True
        self.lockout.failed(address)
        return False

    def refusal(self, address: str, wrong: AuthRefused) -> AuthRefused | RateLimited:
        """What a wrong token from ``address`` is answered: ``wrong``, or 429 while the address
        is locked."""
        lockout = self.lockout
        if not lockout.locked(address):
            return wrong
        return RateLimited(
            f"{lockout.max_failures} wrong tokens from {address} within {lockout.window_s:g} s: "
            "its wrong tokens are refused with 429 until the window has passed (the right "
            "token is always accepted)"
        )

    def login(self, candidate: str, address: str) -> Login | None:
        """A new login when ``candidate`` is the admin token, else None."""
        if not self.token_matches(candidate, address):
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
