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
LoRA and the caller's tenant. A prompt by ids (``block_ids_b64``) reaches the engines of the
request's block size, and with API keys only the caller's own: ids prove no tenant.

What a tenant learns is what its own requests cached. With API keys, a tenant's engine is
indexed under the tenant's namespaces; an engine shared by every tenant (the settings') under
the namespaces of the tenant whose vLLM ``cache_salt`` (``SESSIONCACHE_TENANT_CACHE_SALTS``)
each chain's first block carries, and a chain carrying none is not indexed. An endpoint a
tenant registers must be one ``endpoints.allowed`` admits, and no other tenant's (nor a
shared engine's): the node never follows one engine for two tenants.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sessioncache.errors import EngineExists, EngineNotFound, InvalidInput
from sessioncache.hashing import BlockHash, Namespace, block_hashes_from_bytes
from sessioncache.node import CacheNode
from sessioncache.operations import lookups
from sessioncache.quotas import refuse
from sessioncache.routing import endpoints
from sessioncache.routing.engine_index import EngineIndex, RootFor
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


_ROOTS = 1024
"""Chain roots an engine's index keeps (per LoRA and tenant); past that it starts afresh."""


def _compatible(a: Namespace, b: Namespace) -> bool:
    return (a.model, a.kv_dtype, a.kv_layout, a.salt) == (b.model, b.kv_dtype, b.kv_layout, b.salt)


def salt_owners(cache_salts: Mapping[str, str]) -> dict[str, str]:
    """``SESSIONCACHE_TENANT_CACHE_SALTS`` (tenant -> cache salt) turned round; a salt that is
    empty (vLLM ignores it) or given to two tenants is ``InvalidInput``."""
    owners: dict[str, str] = {}
    for tenant, salt in cache_salts.items():
        if not salt:
            raise InvalidInput(f"SESSIONCACHE_TENANT_CACHE_SALTS: tenant {tenant!r} has no salt")
        other = owners.setdefault(salt, tenant)
        if other != tenant:
            raise InvalidInput(
                f"SESSIONCACHE_TENANT_CACHE_SALTS: tenants {other!r} and {tenant!r} have one salt"
            )
    return owners


def _salt_owner(keys: Sequence[object], owners: Mapping[str, str]) -> str | None:
    """The tenant whose cache salt is among a chain's first extra keys (None: no tenant's,
    or two tenants')."""
    found = {owners[k] for k in keys if isinstance(k, str) and k in owners}
    return found.pop() if len(found) == 1 else None


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
        self._salt_owners = salt_owners(node.settings.tenant_cache_salts)
        self._register_lock = threading.Lock()
        """Held from an engine's endpoint checks to its addition: two tenants registering one
        endpoint at once get one engine between them."""

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

    def register(self, spec: EngineSpec, *, by_tenant: bool = False) -> None:
        """Follow ``spec``'s engine. ``EngineExists`` if the tenant already has an engine of
        that id, or a shared engine has it (every tenant sees those). ``by_tenant``: its
        tenant registers it (the API, not the settings); with API keys its endpoints are then
        checked: ``Refused`` for one ``endpoints.allowed`` does not admit, ``EngineExists``
        for one of another tenant's engines or of a shared one."""
        node = self.node
        keyed = by_tenant and spec.tenant is not None and node.auth_enabled
        with self._register_lock:
            taken = self.feeds.spec(spec.engine_id)
            if spec.tenant is not None and taken is not None and taken.tenant is None:
                raise EngineExists(f"engine {spec.engine_id!r} is already registered (shared)")
            if spec.tenant is not None:
                cap = node.quotas.of(spec.tenant).engines
                held = self.engines_per_tenant().get(spec.tenant, 0)
                if held >= cap and self.feeds.spec(self._key(spec.tenant, spec.engine_id)) is None:
                    raise refuse(spec.tenant, "engines", held, cap, "engines registered")
            if keyed:
                self._check_endpoints(spec)
            internal = replace(spec, engine_id=self._key(spec.tenant, spec.engine_id))
            try:
                self.feeds.add(internal, self._root_for(spec), node.settings.hash_seed)
            except EngineExists:
                raise EngineExists(f"engine {spec.engine_id!r} is already registered") from None

    def _check_endpoints(self, spec: EngineSpec) -> None:
        """A keyed tenant's endpoints: admitted by the setting, and no other owner's."""
        prefixes = self.node.settings.engine_endpoint_prefixes
        wanted = [
            endpoints.allowed(e, prefixes)
            for e in (spec.endpoint, spec.replay_endpoint)
            if e is not None
        ]
        for other in self.feeds.specs():
            if other.tenant == spec.tenant:
                continue
            held = {
                endpoints.canonical(e)
                for e in (other.endpoint, other.replay_endpoint)
                if e is not None
            }
            for endpoint in wanted:
                if endpoint in held:  # whose it is stays unsaid
                    raise EngineExists(
                        f"endpoint {endpoint!r} is already followed for another engine: the "
                        "node follows an engine for one tenant only"
                    )

    def _root_for(self, spec: EngineSpec) -> RootFor:
        """Where ``spec``'s chains are rooted: a tenant's engine (and every engine of an open
        node) in its namespace as the tenant's requests are hashed; with API keys, a shared
        engine's in the namespace of the tenant whose cache salt the chain carries, and
        nowhere (not indexed) for a chain carrying none."""
        node, seed = self.node, self.node.settings.hash_seed
        salted = spec.tenant is None and node.auth_enabled
        owners = self._salt_owners
        roots: dict[tuple[str | None, str | None], bytes] = {}

        def root_for(lora: str | None, keys: Sequence[object]) -> bytes | None:
            tenant = _salt_owner(keys, owners) if salted else spec.tenant
            if salted and tenant is None:
                return None
            root = roots.get((lora, tenant))
            if root is None:
                ns = spec.namespace if lora is None else replace(spec.namespace, lora=lora)
                if tenant is not None:
                    ns = node.effective_namespace(tenant, ns)
                if len(roots) >= _ROOTS:
                    roots.clear()
                root = roots[(lora, tenant)] = ns.root(seed)
            return root

        return root_for

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
            # ids say nothing of whose chain they are: a shared engine's chains belong to
            # the tenants whose salts they carry, so ids reach the caller's own engines only
            shared_ok = not node.auth_enabled
            specs = [
                s
                for s in specs
                if s.namespace.block_tokens == namespace.block_tokens
                and (shared_ok or s.tenant is not None)
            ]
            prompt_tokens = len(ids) * namespace.block_tokens
        else:
            assert token_bytes is not None
            prompt_tokens = len(token_bytes) // 4
        limit = node.settings.max_tokens
        if prompt_tokens > limit:
            raise InvalidInput(f"{prompt_tokens} tokens exceed the limit of {limit}")

        own_root = node.namespace_root(tenant, namespace)
        chains: dict[int, list[BlockHash]] = {}

        def chain(block_tokens: int) -> list[BlockHash]:
            """The prompt's ids at ``block_tokens`` under the tenant's root."""
            found = chains.get(block_tokens)
            if found is not None:
                return found
            if ids is not None:
                made = list(ids)
            else:
                assert token_bytes is not None
                root = node.namespace_root(tenant, replace(namespace, block_tokens=block_tokens))
                made = block_hashes_from_bytes(root, token_bytes, block_tokens, seed)
            chains[block_tokens] = made
            return made

        groups: dict[int, list[EngineSpec]] = {}
        for spec in specs:
            groups.setdefault(spec.namespace.block_tokens, []).append(spec)
        out: list[EngineRoute] = []
        for block_tokens, members in groups.items():
            by_id = {s.engine_id: s for s in members}
            matches = self.index.match(chain(block_tokens), list(by_id), self.medium_weights)
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

        cached = lookups.chain_prefix(node, own_root, chain(namespace.block_tokens))
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
        replay_buffer=settings.engine_replay_buffer,
        redial_max_s=settings.engine_redial_max_s,
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
