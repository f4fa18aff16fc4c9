"""What the tests of the engine adapters share: LMCache's L2 completions awaited as LMCache's
demux thread awaits them, and an SGLang HiCache storage config."""

from __future__ import annotations

import select
import time
from typing import Any

from sessioncache.connector.lmcache import Completion, SessionCacheL2


def wait_for(adapter: SessionCacheL2, future: int, timeout_s: float = 30.0) -> Completion:
    """What LMCache's demux thread does: poll the eventfd, drain, match the future id."""
    deadline = time.monotonic() + timeout_s
    pending: list[Completion] = []
    while time.monotonic() < deadline:
        for done in pending:
            if done[0] == future:
                return done
        select.select([adapter.event_fd()], [], [], 0.5)
        pending += adapter.drain_completions()
    raise AssertionError(f"future {future} never completed")


def hicache_config(extra: dict[str, Any], *, model: str, tp_rank: int = 0, tp_size: int = 1) -> Any:
    """SGLang's ``HiCacheStorageConfig`` of a page-first, non-MLA model (SGLang is optional:
    callers ``pytest.importorskip`` it first)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )
