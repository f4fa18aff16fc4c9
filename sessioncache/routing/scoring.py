"""The router's question: which engine holds the longest prefix of this prompt, and how much
of it do sessioncache's own tiers hold?

An engine's score is its tier-weighted cached prefix in tokens: each matched block counts
``block_tokens`` times the weight of the best medium holding it (GPU > CPU > storage by
default, ``SESSIONCACHE_ROUTE_MEDIUM_WEIGHTS``). A stale engine (silent longer than
``SESSIONCACHE_ENGINE_STALE_S``) scores nothing. The node's own prefix is scored with
``SESSIONCACHE_ROUTE_CACHE_WEIGHT``, so that a router can weigh "any engine, loading from the
cache" against the engines.

Engines are compared when their namespace equals the request's but for the block size and
the LoRA: a prompt by tokens is hashed once per block size among them, under the request's
LoRA. A prompt by ids (``block_ids_b64``) reaches the engines of the request's block size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sessioncache.errors import EngineExists, EngineNotFound, InvalidInput
from sessioncache.hashing import BlockHash, Namespace, block_hashes_from_bytes
from sessioncache.node import CacheNode
from sessioncache.operations import lookups
from sessioncache.quotas import refuse
from sessioncache.routing.engine_index import EngineIndex
from sessioncache.routing.events import MEDIA
from sessioncache.routing.subscriber import EngineFeeds, EngineSpec


@dataclass(frozen=True, slots=True)
class EngineRoute:
    engine_id: str
    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    per_medium: dict[str, int]
    """Per medium, the tokens of the leading blocks the engine holds there."""
    score: float
    stale: bool
    shared: bool


@dataclass(frozen=True, slots=True)
class CacheRoute:
    block_tokens: int
    matched_blocks: int
    matched_tokens: int
    score: float


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    prompt_tokens: int
    engines: list[EngineRoute]
    """Best first: by score, then matched tokens, then id."""
    cache: CacheRoute


def _compatible(a: Namespace, b: Namespace) -> bool:
    return (a.model, a.kv_dtype, a.kv_layout, a.salt) == (b.model, b.kv_dtype, b.kv_layout, b.salt)


class Router:
    """Engines registered per tenant, their feeds, and the route computation."""

    def __init__(
        self,
        node: CacheNode,
        feeds: EngineFeeds,
        *,
        medium_weights: Mapping[str, float],
        cache_weight: float,
    ) -> None:
        self.node = node
        self.feeds = feeds
        self.index: EngineIndex = feeds.index
        self.medium_weights = dict(medium_weights)
        self.cache_weight = cache_weight

    # -- engines -------------------------------------------------------------------------

    def _key(self, tenant: str | None, engine_id: str) -> str:
        """An engine's id inside the node (feeds, index, ``/metrics``). With API keys each
        tenant has its own id space (``tenant/id``: an engine id holds no ``/``), so a tenant
        can neither collide with another's ids nor learn that they exist by registering
        them; shared engines, and every engine of an open node (one tenant), keep their ids."""
        if tenant is None or not self.node.auth_enabled:
            return engine_id
        return f"{tenant}/{engine_id}"

    def public_id(self, spec: EngineSpec) -> str:
        """The id the engine was registered under, as its tenant knows it."""
        if spec.tenant is None or not self.node.auth_enabled:
            return spec.engine_id
        return spec.engine_id.rsplit("/", 1)[1]

    def register(self, spec: EngineSpec) -> None:
        """Follow ``spec``'s engine; its ids are rooted in its tenant's namespace (unsalted
        for a shared engine, ``tenant`` None). ``EngineExists`` if the tenant already has an
        engine of that id, or a shared engine has it (every tenant sees those)."""
        node = self.node
        seed = node.settings.hash_seed
        taken = self.feeds.spec(spec.engine_id)
        if spec.tenant is not None and taken is not None and taken.tenant is None:
            raise EngineExists(f"engine {spec.engine_id!r} is already registered (shared)")
        if spec.tenant is not None:
            cap = node.quotas.of(spec.tenant).engines
            held = self.engines_per_tenant().get(spec.tenant, 0)
            if held >= cap and self.feeds.spec(self._key(spec.tenant, spec.engine_id)) is None:
                raise refuse(spec.tenant, "engines", held, cap, "engines registered")
        internal = replace(spec, engine_id=self._key(spec.tenant, spec.engine_id))

        def root_for(lora: str | None) -> bytes:
            ns = spec.namespace if lora is None else replace(spec.namespace, lora=lora)
            if spec.tenant is None:
                return ns.root(seed)
            return node.namespace_root(spec.tenant, ns)

        try:
            self.feeds.add(internal, root_for, seed)
        except EngineExists:
            raise EngineExists(f"engine {spec.engine_id!r} is already registered") from None

    def engines_per_tenant(self) -> dict[str, int]:
        """Engines registered through the API, per tenant (shared ones left out)."""
        out: dict[str, int] = {}
        for spec in self.feeds.specs():
            if spec.tenant is not None:
                out[spec.tenant] = out.get(spec.tenant, 0) + 1
        return out

    def visible(self, tenant: str) -> list[EngineSpec]:
        """The engines ``tenant`` may see: its own and the shared ones."""
        return [s for s in self.feeds.specs() if s.tenant in (tenant, None)]

    def get(self, tenant: str, engine_id: str) -> EngineSpec:
        """The tenant's engine of that id, else the shared one (ids of the two never clash:
        ``register``); another tenant's is not found, exactly as an id nobody uses."""
        spec = self.feeds.spec(self._key(tenant, engine_id)) or self.feeds.spec(engine_id)
        if spec is None or spec.tenant not in (tenant, None):
            raise EngineNotFound(f"engine {engine_id!r} is not registered")
        return spec

    def unregister(self, tenant: str, engine_id: str) -> None:
        """Only the owner removes an engine; a shared one only when authentication is off
        (then the one tenant is everyone)."""
        spec = self.get(tenant, engine_id)
        if spec.tenant is None and self.node.auth_enabled:
            raise EngineNotFound(
                f"engine {engine_id!r} is shared (registered in the settings): it cannot be "
                "removed through the API"
            )
        self.feeds.remove(spec.engine_id)

    def close(self) -> None:
        self.feeds.close()

    # -- routes --------------------------------------------------------------------------

    def route(
        self,
        tenant: str,
        namespace: Namespace,
        *,
        token_bytes: bytes | None = None,
        ids: Sequence[BlockHash] | None = None,
        engines: Sequence[str] | None = None,
    ) -> RouteAnswer:
        """Exactly one of ``token_bytes`` (little-endian uint32) and ``ids``."""
        if (token_bytes is None) == (ids is None):
            raise InvalidInput("give the prompt as tokens or as block ids")
        node = self.node
        seed = node.settings.hash_seed
        if engines is not None:
            specs = [self.get(tenant, e) for e in dict.fromkeys(engines)]
        else:
            specs = self.visible(tenant)
        specs = [s for s in specs if _compatible(s.namespace, namespace)]
        if ids is not None:
            specs = [s for s in specs if s.namespace.block_tokens == namespace.block_tokens]
            prompt_tokens = len(ids) * namespace.block_tokens
        else:
            assert token_bytes is not None
            prompt_tokens = len(token_bytes) // 4
        limit = node.settings.max_tokens
        if prompt_tokens > limit:
            raise InvalidInput(f"{prompt_tokens} tokens exceed the limit of {limit}")

        own_root = node.namespace_root(tenant, namespace)
        chains: dict[tuple[int, bool], list[BlockHash]] = {}

        def chain(block_tokens: int, shared: bool) -> list[BlockHash]:
            """The prompt's ids at ``block_tokens`` under the tenant's (or the shared) root."""
            key = (block_tokens, shared and node.auth_enabled)
            found = chains.get(key)
            if found is not None:
                return found
            if ids is not None:
                made = list(ids)
            else:
                assert token_bytes is not None
                ns = replace(namespace, block_tokens=block_tokens)
                root = ns.root(seed) if key[1] else node.namespace_root(tenant, ns)
                made = block_hashes_from_bytes(root, token_bytes, block_tokens, seed)
            chains[key] = made
            return made

        groups: dict[tuple[int, bool], list[EngineSpec]] = {}
        for spec in specs:
            groups.setdefault((spec.namespace.block_tokens, spec.tenant is None), []).append(spec)
        out: list[EngineRoute] = []
        for (block_tokens, shared), members in groups.items():
            by_id = {s.engine_id: s for s in members}
            matches = self.index.match(
                chain(block_tokens, shared), list(by_id), self.medium_weights
            )
            for engine_id, m in matches.items():
                stale = self.feeds.stale(engine_id)
                out.append(
                    EngineRoute(
                        self.public_id(by_id[engine_id]),
                        block_tokens,
                        m.matched_blocks,
                        m.matched_blocks * block_tokens,
                        {medium: m.per_medium[medium] * block_tokens for medium in MEDIA},
                        0.0 if stale else m.weighted_blocks * block_tokens,
                        stale,
                        by_id[engine_id].tenant is None,
                    )
                )
        out.sort(key=lambda r: (-r.score, -r.matched_tokens, r.engine_id))

        own = chain(namespace.block_tokens, False)
        cached = lookups.chain_prefix(node, own_root, own)
        cached_tokens = cached * namespace.block_tokens
        return RouteAnswer(
            prompt_tokens,
            out,
            CacheRoute(
                namespace.block_tokens, cached, cached_tokens, cached_tokens * self.cache_weight
            ),
        )


def open_router(node: CacheNode) -> Router:
    """The node's router, with the engines of its settings registered (their feeds start
    with the first engine: a node without engines runs no subscriber thread)."""
    settings = node.settings
    feeds = EngineFeeds(
        EngineIndex(),
        stale_s=settings.engine_stale_s,
        replay_timeout_s=settings.engine_replay_timeout_s,
    )
    router = Router(
        node,
        feeds,
        medium_weights=settings.route_medium_weights,
        cache_weight=settings.route_cache_weight,
    )
    try:
        for engine in settings.engines:
            ns = engine.namespace
            namespace = Namespace(
                model=ns.get("model"),  # type: ignore[arg-type]
                block_tokens=ns.get("block_tokens"),  # type: ignore[arg-type]
                kv_dtype=ns.get("kv_dtype"),  # type: ignore[arg-type]
                kv_layout=ns.get("kv_layout"),  # type: ignore[arg-type]
                salt=ns.get("salt"),  # type: ignore[arg-type]
                lora=ns.get("lora"),  # type: ignore[arg-type]
            )
            router.register(
                EngineSpec(
                    engine.engine_id,
                    namespace,
                    engine.endpoint,
                    engine.replay_endpoint,
                    engine.topic,
                    engine.tenant,
                )
            )
    except BaseException:
        router.close()
        raise
    return router
