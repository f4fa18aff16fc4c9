"""``SessionCacheConnector``: a vLLM KV connector (``KVConnectorBase_V1``) on a sessioncache
node, loaded by configuration alone (``docs/vllm.md``)::

    KVTransferConfig(kv_connector="SessionCacheConnector",
                     kv_connector_module_path="sessioncache.connector.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"url": "http://127.0.0.1:8080"})

One sessioncache block is one vLLM block (``block_size`` tokens) of every attention layer of
this rank, the layers' block slices back to back (``PagedLayout``). The namespace
(``vllm_namespace``) names the model, the KV dtype, the paged layout of this device and rank
(each tensor-parallel rank holds a slice of the KV heads and stores its own), the request's
``cache_salt`` (the tenant salt) and its LoRA. What the connector reads of vLLM's
configuration and requests (its settings, the namespace, a request's scope and finish reason)
is ``connector.vllm_config``'s.

Scheduler side: ``get_num_new_matched_tokens`` asks the node, over the data plane, for the
longest held prefix of the prompt's full blocks (one LOOKUP, counted as the prompt's hit and
miss tokens, under the request's session when ``kv_transfer_params`` names one); at least one
prompt token is always left to compute. ``update_state_after_alloc`` plans the load into the
blocks vLLM allocated; ``request_finished`` plans the save of the request's computed full
blocks past those the node held and keeps vLLM from freeing them until the save is done
(``get_finished``); the worker's save sends only those past the run the node holds when it
starts (``EngineNode.unsent``: after this engine's earlier saves, and also for a prompt vLLM's
own cache answered, which asks the node no lookup). A request of a session tells the node
why it finished (``finish_reason``: the client's ``kv_transfer_params["finish_reason"]``,
else vLLM's), with the save's STOREs, or alone (a ``SESSION`` finish on the worker's data-plane
connection, ``ops.finish_session``) when there is nothing to save: the node keeps the
session's blocks by when it is predicted back.

Worker side (``connector.paged``, which knows nothing of vLLM, over ``connector.ops``): loads
run in ``start_load_kv``, before the forward pass: one leased LOCATE (same host) or LOOKUP
(stream) per request, on behalf of its session like its lookup and its save, each block
copied run by run into the request's paged blocks. A block that could
not be loaded is reported by ``get_block_ids_with_load_errors``, and vLLM recomputes it. Saves
run on a thread of their own, with their own connection: each block gathered from the paged
cache straight into the node's staging memory (same host) or the stream's frame. A node that
is down makes lookups miss, loads fail (recomputed) and saves drop, at once for a backoff
after a failure (``retry.NodeBackoff``); the engine never stops for it.

Bytes move over the same-host path when the node is on this host, else over the block stream;
never per-block HTTP (``paths=DATA_PLANE_PATHS``).

Roles (``kv_role``, docs/vllm.md "Prefill/decode disaggregation"): a ``kv_consumer`` saves no
block of the prompt (the producer's) and a ``kv_producer`` tells the node no finish reason;
both load. Where vLLM runs the engine with prefix caching and chunked prefill off
(``cannot_attend_to_cache``: MLA on CPUs without AMX), the connector loads nothing and saves;
its lookup is then a declined one (``ops.held``), which the node counts as the session's
``declined`` miss tokens (``GET /v1/sessions/{id}``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from sessioncache.connector import agenthints, ops
from sessioncache.connector.hybrid import Checkpoint, HybridLoad, HybridNode
from sessioncache.connector.paged import EngineNode, PagedLayout, Scope, Transfer
from sessioncache.connector.vllm_config import (
    ConnectorSettings,
    cannot_attend_to_cache,
    finish_reason,
    request_scope,
    vllm_namespace,
)
from sessioncache.connector.vllm_hybrid import (
    Capture,
    HybridCopies,
    HybridGroups,
    HybridPlanner,
    HybridSave,
    Unsupported,
    hybrid_groups,
)
from sessioncache.hashing import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.sessioncache")
"""Under vLLM's logger, whose handlers print in every engine process."""

SAVE_DRAIN_S = 30.0


@dataclass
class SessionCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One scheduler step's loads and saves, for the workers."""

    loads: list[Transfer | HybridLoad] = field(default_factory=list)
    saves: list[Transfer | HybridSave] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)
    """Hybrid models: companion objects to copy at the end of the step."""
    unloaded: list[str] = field(default_factory=list)
    """Hybrid models: requests promised a load that nothing fills (failed: recomputed)."""


class SessionCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector on a sessioncache node (module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = vllm_config.kv_transfer_config
        assert transfer_config is not None
        self.settings = ConnectorSettings.from_extra(
            dict(transfer_config.kv_connector_extra_config)
        )
        self.block_size = vllm_config.cache_config.block_size
        if transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "SessionCacheConnector: kv_load_failure_policy is %r: a block the node cannot "
                'load fails its request; set kv_load_failure_policy="recompute" to recompute it',
                transfer_config.kv_load_failure_policy,
            )
        self._role = transfer_config.kv_role or "kv_both"
        """``kv_consumer`` (decode of a P/D pair) saves no block of the prompt: the producer
        computed and saved it (docs/vllm.md, "Prefill/decode disaggregation")."""
        self._declined = cannot_attend_to_cache(vllm_config)
        if self._declined is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("SessionCacheConnector: loads off, saves on: %s", self._declined)
        self._config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._namespaces: dict[tuple[str | None, str | None], Namespace] = {}
        self._rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        # scheduler side
        self._node = EngineNode(self.settings.node())
        self._matched: dict[str, int] = {}
        self._loads: list[Transfer | HybridLoad] = []
        self._saves: list[Transfer | HybridSave] = []
        # worker side
        self._layout: PagedLayout | None = None
        self._load_errors: set[int] = set()
        self._saver = EngineNode(self.settings.node())
        self._saving: list[Transfer | tuple[HybridSave, list[Checkpoint]]] = []
        self._saved: set[str] = set()
        self._busy = False
        self._save_cond = threading.Condition()
        self._save_thread: threading.Thread | None = None
        # hybrid models (more than one KV-cache group)
        self._hybrid: HybridGroups | None = None
        self._lookups: HybridNode | None = None
        """Hybrid models: lookups and loads on ``_node``."""
        self._stores: HybridNode | None = None
        """Hybrid models: saves on ``_saver``."""
        self._planner: HybridPlanner | None = None
        self._copies: HybridCopies | None = None
        self._unloaded: list[str] = []
        self._recved: set[str] = set()
        """Hybrid models: requests whose (asynchronous) load is done."""
        self._failed: set[str] = set()
        """Hybrid models: requests whose load failed (vLLM recomputes them whole)."""
        self._no_load: set[str] = set()
        """Scheduler side: requests whose load failed; their next lookup is a miss (vLLM asks
        again, and the same load would fail again)."""
        self._read_groups(kv_cache_config)

    def _read_groups(self, kv_cache_config: KVCacheConfig | None) -> None:
        """A hybrid model's groups (``vllm_hybrid``); a layout that cannot be stored turns
        loads and saves off, saying why."""
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1:
            return
        try:
            groups = hybrid_groups(kv_cache_config, self.block_size)
        except Unsupported as exc:
            log.warning("SessionCacheConnector: loads and saves off for this model: %s", exc)
            self.settings = replace(self.settings, load=False, save=False)
            return
        self._hybrid = groups
        self._lookups = HybridNode(self._node, groups.model)
        self._stores = HybridNode(self._saver, groups.model)
        self._planner = HybridPlanner(groups, self.block_size, self.settings.checkpoint_blocks)
        log.info(
            "sessioncache: hybrid model, spine %s, companions %s",
            groups.model.spine.group,
            [c.group for c in groups.model.companions],
        )

    def _namespace(self, scope: Scope) -> Namespace:
        key = (scope.salt, scope.lora)
        ns = self._namespaces.get(key)
        if ns is None:
            ns = self._namespaces[key] = vllm_namespace(
                self._config, self.settings, rank=self._rank, salt=scope.salt, lora=scope.lora
            )
        return ns

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.settings.load or request.request_id in self._no_load:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        full = (len(tokens) - 1) // self.block_size  # at least one token left to compute
        if self._declined is not None:  # nothing loaded: the node is told why
            self._decline(request, tokens[: full * self.block_size])
            return 0, False
        if full * self.block_size <= num_computed_tokens:
            return 0, False
        if self._node.down:  # backing off after a failure: a miss without a call
            return 0, False
        scope = request_scope(request)
        try:
            if self._lookups is not None:
                held = self._lookups.held(
                    self._namespace(scope),
                    tokens[: full * self.block_size],
                    scope,
                    num_computed_tokens // self.block_size,
                )
            else:
                held = self._node.held_blocks(
                    self._namespace(scope), tokens[: full * self.block_size], scope
                )
        except Exception as exc:  # a miss, never a failed request
            backoff = self._node.failure(exc)
            if backoff is None:  # refused for this request alone
                log.warning("sessioncache lookup of %s refused: %s", request.request_id, exc)
            else:  # the node down or slow
                log.warning("sessioncache lookup failed (retry in %.0f s): %s", backoff, exc)
            return 0, False
        self._node.ok()
        self._matched[request.request_id] = held
        extra = max(0, held * self.block_size - num_computed_tokens)
        # A hybrid model's loads are asynchronous: vLLM schedules the request once its load is
        # done (a Mamba state loaded during the step would come too late: vLLM copies it
        # forward, preprocess_mamba, before that step's loads run), and a failed load is
        # reported per request (failed_recving), the only way vLLM takes for several groups.
        return extra, bool(extra) and self._hybrid is not None

    def _finish_reason(self, request: Request) -> str | None:
        """``finish_reason``, but none from a ``kv_producer``: a P/D proxy asks it for one
        token, and the request's turn ends on the consumer."""
        return None if self._role == "kv_producer" else finish_reason(request)

    def _decline(self, request: Request, tokens: list[int]) -> None:
        """A request this engine cannot load into: one declined lookup of its full blocks
        (opening its session for the save), so that the node counts the tokens it holds as
        missed, ``declined``, in the session's attribution; a failure is logged, never the
        request's."""
        if self._node.down:
            return
        scope = request_scope(request)
        try:
            if tokens:
                ns = self._namespace(scope)
                if self._lookups is not None:
                    self._lookups.held(ns, tokens, scope, 0, declined=True)
                else:
                    self._node.held_blocks(ns, tokens, scope, declined=True)
            elif self.settings.save:
                self._node.open_session(scope)
            self._node.ok()
        except Exception as exc:  # the save then drops, as after a failed lookup
            self._node.failure(exc)
            log.warning("sessioncache: declined lookup of %s failed: %s", request.request_id, exc)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        # The node's blocks end where the lookup said; vLLM's own prefix cache holds those
        # before the external tokens (``request.num_computed_tokens`` is not updated yet).
        end = self._matched[request.request_id]
        first = end - num_external_tokens // self.block_size
        tokens = list(request.prompt_token_ids or [])[: end * self.block_size]
        if self._planner is not None:
            plan = self._planner.load(
                request.request_id, tokens, blocks, first, end, request_scope(request)
            )
            if plan is not None:
                self._loads.append(plan)
            else:  # nothing fills them: a failed load, recomputed
                self._unloaded.append(request.request_id)
            return
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(
            Transfer(
                request.request_id,
                tokens,
                first,
                list(block_ids[first:end]),
                request_scope(request),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        captures = []
        if self._planner is not None and self.settings.save:
            captures = self._planner.step(scheduler_output)
        meta = SessionCacheMetadata(self._loads, self._saves, captures, self._unloaded)
        self._loads, self._saves, self._unloaded = [], [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self._no_load.update(connector_output.failed_recving or ())

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._no_load.discard(request.request_id)
        if self._planner is None:
            return self.request_finished(request, block_ids[0])
        agenthints.forward(self._node, request, request_scope(request), self.block_size)
        held = self._matched.pop(request.request_id, 0)
        if not self.settings.save:  # its block tables were not followed either
            return False, None
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if self._role == "kv_consumer":  # as in ``request_finished``
            held = max(held, request.num_prompt_tokens // self.block_size)
        save = self._planner.finished(
            request.request_id,
            list(request.all_token_ids),
            held,
            computed,
            block_ids,
            request_scope(request),
        )
        save.finish_reason = self._finish_reason(request)
        self._saves.append(save)  # also frees the worker's captures of the request
        return save.holds_blocks, None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        agenthints.forward(self._node, request, request_scope(request), self.block_size)
        held = self._matched.pop(request.request_id, 0)
        if not self.settings.save:
            return False, None
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        computed = min(computed, len(request.all_token_ids))  # KV computed, not in flight
        full = min(computed // self.block_size, len(block_ids))
        if self._role == "kv_consumer":  # the prompt's blocks are the producer's to save
            held = max(held, min(request.num_prompt_tokens // self.block_size, full))
        scope, reason = request_scope(request), self._finish_reason(request)
        if full <= held:
            if reason is not None:  # nothing to save: the finish goes alone, from the worker
                self._saves.append(Transfer(request.request_id, [], held, [], scope, reason))
            return False, None
        tokens = list(request.all_token_ids[: full * self.block_size])
        self._saves.append(
            Transfer(request.request_id, tokens, held, list(block_ids[held:full]), scope, reason)
        )
        return True, None  # vLLM frees the blocks once a worker reports the save done

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._kv_cache_config is not None
        if self._hybrid is not None:
            self._copies = HybridCopies(
                self._hybrid,
                kv_caches,
                self._kv_cache_config.num_blocks,
                self.settings.copy_threads,
                self.settings.capture_bytes,
            )
            log.info(
                "sessioncache: hybrid blocks of %d bytes (spine), %s (companions)",
                self._copies.spine.nbytes,
                [c.nbytes for c in self._copies.companions],
            )
            self._connect_at_start()
            return
        layout = self._layout = PagedLayout(
            kv_caches, self._kv_cache_config.num_blocks, copy_threads=self.settings.copy_threads
        )
        log.info(
            "sessioncache: blocks of %d bytes in %d runs on %s, %d copy threads",
            layout.nbytes,
            len(layout.runs),
            layout.device,
            layout.copy_threads,
        )
        self._connect_at_start()

    def _connect_at_start(self) -> None:
        if self._copies is not None:
            device = self._copies.spine.device
        else:
            assert self._layout is not None
            device = self._layout.device
        if self.settings.load:
            try:  # connected, the node's memory mapped (and registered) before the first load
                log.info("sessioncache: loads over %s", self._node.connect(device=device))
            except Exception as exc:
                log.warning("sessioncache node not reachable at start (loads will retry): %s", exc)
                self._node.close()  # no backoff: a load comes only after a lookup succeeded

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SessionCacheMetadata)
        self._failed.update(meta.unloaded)
        if self._copies is not None:
            self._load_hybrid([t for t in meta.loads if isinstance(t, HybridLoad)])
            return
        layout = self._layout
        if layout is None:
            return
        down = False  # after a failure of the node, this step's other loads are not tried
        for transfer in meta.loads:
            assert isinstance(transfer, Transfer)
            start = time.perf_counter()
            n, copy_s = 0, 0.0
            try:
                if not down:
                    n, copy_s = self._node.load(self._namespace(transfer.scope), transfer, layout)
            except Exception as exc:
                if self._node.failure(exc) is not None:
                    down = True
                log.warning("sessioncache load of %s failed, recomputing: %s", transfer.req_id, exc)
            self._load_errors.update(transfer.block_ids[n:])
            log.info(
                "sessioncache load: %d of %d blocks, %d bytes in %.6f s (copies %.6f s), "
                "from block %d",
                n,
                len(transfer.block_ids),
                n * layout.nbytes,
                time.perf_counter() - start,
                copy_s,
                transfer.first,
            )

    def _load_hybrid(self, loads: list[HybridLoad]) -> None:
        copies, node = self._copies, self._lookups
        assert copies is not None and node is not None
        down = False
        for load in loads:
            start = time.perf_counter()
            n, copy_s = 0, 0.0
            try:
                if not down:
                    n, copy_s = node.load(
                        self._namespace(load.scope), load, copies.spine, copies.companions
                    )
            except Exception as exc:
                if self._node.failure(exc) is not None:
                    down = True
                log.warning("sessioncache load of %s failed, recomputing: %s", load.req_id, exc)
            if n < load.end - load.first:  # all or nothing: the request recomputed whole
                self._failed.add(load.req_id)
            else:
                self._recved.add(load.req_id)
            log.info(
                "sessioncache load: %d of %d blocks in %.6f s (copies %.6f s), from block %d, "
                "companion objects %s",
                n,
                load.end - load.first,
                time.perf_counter() - start,
                copy_s,
                load.first,
                [len(part) for part in load.companions],
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves copy whole blocks once their request finished (request_finished)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SessionCacheMetadata)
        saves: list[Transfer | tuple[HybridSave, list[Checkpoint]]] = []
        if self._copies is not None:
            # at the end of the step, before vLLM may free or reuse these blocks
            self._copies.capture(meta.captures)
            for save in meta.saves:
                assert isinstance(save, HybridSave)
                saves.append((save, self._copies.checkpoints(save)))
        else:
            saves += [t for t in meta.saves if isinstance(t, Transfer)]
        if not saves:
            return
        with self._save_cond:
            self._saving.extend(saves)
            self._save_cond.notify()
            if self._save_thread is None:
                self._save_thread = threading.Thread(
                    target=self._save_loop, name="sessioncache-save", daemon=True
                )
                self._save_thread.start()

    def _save_loop(self) -> None:
        while True:
            with self._save_cond:
                while not self._saving:
                    self._save_cond.wait()
                item = self._saving.pop(0)
                self._busy = True
            transfer = item if isinstance(item, Transfer) else item[0]
            try:
                if self._saver.down:
                    log.warning("sessioncache save of %s dropped: backing off", transfer.req_id)
                elif isinstance(item, Transfer):
                    self._save(item)
                    self._saver.ok()
                else:
                    self._save_hybrid(*item)
                    self._saver.ok()
            except Exception as exc:
                backoff = self._saver.failure(exc) or 0.0
                log.warning(
                    "sessioncache save of %s dropped (retry in %.0f s): %s",
                    transfer.req_id,
                    backoff,
                    exc,
                )
            with self._save_cond:
                self._busy = False
                if item.block_ids if isinstance(item, Transfer) else item[0].holds_blocks:
                    self._saved.add(transfer.req_id)  # vLLM frees its blocks now
                self._save_cond.notify_all()

    def _save(self, transfer: Transfer) -> None:
        layout = self._layout
        assert layout is not None
        start = time.perf_counter()
        namespace = self._namespace(transfer.scope)
        sent = self._saver.unsent(namespace, transfer)  # after this engine's earlier saves
        held = self._saver.save(namespace, sent, layout)
        log.info(
            "sessioncache save: %d of %d blocks, %d bytes in %.6f s, from block %d, "
            "%d held already%s",
            held,
            len(sent.block_ids),
            len(sent.block_ids) * layout.nbytes,
            time.perf_counter() - start,
            sent.first,
            sent.first - transfer.first,
            f", finish {transfer.finish_reason}" if transfer.finish_reason else "",
        )

    def _save_hybrid(self, save: HybridSave, checkpoints: list[Checkpoint]) -> None:
        copies, node = self._copies, self._stores
        assert copies is not None and node is not None
        start = time.perf_counter()
        namespace = self._namespace(save.scope)
        held, sent = 0, 0
        if save.spine is not None:
            spine_ns, _ = node.model.namespaces(namespace)
            spine = self._saver.unsent(spine_ns, save.spine)  # as ``_save``
            held, sent = self._saver.save(spine_ns, spine, copies.spine), len(spine.block_ids)
        objects = node.save_checkpoints(namespace, save.tokens, save.scope, checkpoints)
        session = save.scope.session_id
        if save.finish_reason is not None and session is not None:  # after the stores
            ops.finish_session(self._saver.kv(save.scope), session, save.finish_reason)
        log.info(
            "sessioncache save: %d of %d blocks, checkpoints at %s (%d objects held) in %.6f s",
            held,
            sent,
            sorted({c.end for c in checkpoints}),
            objects,
            time.perf_counter() - start,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._save_cond:
            done, self._saved = self._saved, set()
        recved, self._recved = self._recved, set()
        return (done or None), (recved or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done, and (hybrid models) loads done or failed: a failed one is reported by
        request, as vLLM asks of a model with several KV-cache groups, whose block ids are
        not unique across groups."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed = self._failed, set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Let the saves under way end (for ``SAVE_DRAIN_S`` at most), then close."""
        deadline = time.monotonic() + SAVE_DRAIN_S
        with self._save_cond:
            while (self._saving or self._busy) and time.monotonic() < deadline:
                self._save_cond.wait(0.05)
        self._node.close()
        self._saver.close()
        if self._layout is not None:
            self._layout.close()
        if self._copies is not None:
            self._copies.close()
