"""An engine request's agent hints, sent to its session on the node.

An engine's request carries hints in the field's formats (``sessioncache.sessions.hints``):
``agent_hint`` (uni-agent's or vLLM's) and ``agent_hints`` (SGLang's) in its
``kv_transfer_params``, ``retention_directives`` and ``retention_scope`` in its sampling
parameters' ``extra_args``. ``forward`` sends them, as they are, to the request's session
(``SESSION`` ``hint`` on the data-plane connection: ``ops.hint_session``) when the request
finishes, before its KV is saved, so that the save is filed under what they say (a ``final``
session's save pins nothing). A malformed hint, or a failed call, is a logged warning: it
never fails the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from sessioncache.connector import ops
from sessioncache.connector.paged import EngineNode, Scope
from sessioncache.errors import InvalidInput
from sessioncache.sessions.hints import has_hints, parse_hints

log = logging.getLogger("vllm.sessioncache")

PARAMS = ("agent_hint", "agent_hints")
"""The hints a request's ``kv_transfer_params`` may carry."""
EXTRA_ARGS = ("retention_directives", "retention_scope")
"""The hints its sampling parameters' ``extra_args`` may carry."""


def request_hints(
    params: Mapping[str, Any] | None, extra_args: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The hint body of a request (empty: it carries none)."""
    body = {k: (params or {})[k] for k in PARAMS if (params or {}).get(k) is not None}
    if isinstance(extra_args, Mapping) and extra_args.get("retention_directives") is not None:
        body |= {k: extra_args[k] for k in EXTRA_ARGS if extra_args.get(k) is not None}
    return body


def forward(node: EngineNode, request: Any, scope: Scope, block_tokens: int) -> bool:
    """Send a vLLM request's hints (module docstring) to its session: the scope's, else the
    one the hint names; whether the node took them. Never raises."""
    try:
        sampling = getattr(request, "sampling_params", None)
        body = request_hints(
            request.kv_transfer_params, getattr(sampling, "extra_args", None) or None
        )
        if not has_hints(body):
            return False
        hint = parse_hints(body, time.time(), block_tokens)  # the node's clock is wall time
        session = scope.session_id or hint.session_id
        if session is None:
            log.warning(
                "sessioncache: request %s: agent hints with no session_id: not sent",
                request.request_id,
            )
            return False
        if node.down:  # backing off after a failure: the hint is dropped, as a save would be
            return False
        # the request's own session is opened as for its lookup; one only its hint names
        # must be open already (``SessionNotFound``, a warning)
        kv = node.open_session(scope) if scope.session_id else node.kv(scope)
        ops.hint_session(kv, session, body, block_tokens)
        return True
    except InvalidInput as exc:
        log.warning("sessioncache: request %s: agent hint ignored: %s", _id(request), exc)
    except Exception as exc:  # the node down or refusing: never the request's failure
        log.warning("sessioncache: request %s: agent hint not sent: %s", _id(request), exc)
    return False


def _id(request: Any) -> str:
    return str(getattr(request, "request_id", "?"))
