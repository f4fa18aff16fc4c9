"""The values the REST client hands back (the answers of the API, checked), apart from how
they are requested and parsed (``protocol``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from sessioncache.hashing import BlockHash, Namespace, NamespaceRoot
from sessioncache.status import BlockStatus, kept

Buffer: TypeAlias = bytes | bytearray | memoryview
PayloadSource: TypeAlias = Callable[[int], Buffer] | Sequence[Buffer]
"""Block payloads for a store: a function of the block index, or a sequence indexed by block
index (one item per full block of the prompt; only the missing blocks' items are read)."""


# -- values --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WhoAmI:
    tenant: str
    auth: bool


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class Miss:
    """Why a lookup's tokens past the match missed (``explain=True``;
    docs/prompt-stability.md): the first missed block's reason and the missed tokens by
    reason (``diverged``, ``evicted``, ``expired``, ``new``, ``declined``)."""

    reason: str | None
    """The first missed block's reason; None when nothing missed."""
    tokens: dict[str, int]
    block: int | None = None
    token: int | None = None
    """The first missed token (for ``diverged``: the first token that differs)."""
    offset: int | None = None
    """``diverged``: the differing token's position inside ``block``."""
    tier: str | None = None
    ago_s: float | None = None
    pressure: str | None = None


@dataclass(frozen=True, slots=True)
class MissTotals:
    """A session's lookups (``Session.attribution``): tokens hit and missed by reason, and
    where its prompt last diverged from the one before (block, offset, token; or None)."""

    lookups: int
    hit_tokens: int
    miss_tokens: dict[str, int]
    last_divergence: tuple[int, int | None, int] | None


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest cached prefix of a prompt's full blocks."""

    block_tokens: int
    hashes: list[BlockHash]
    """The matched blocks' ids (a prefix of ``prompt_hashes``), checked against the client's."""
    tiers: list[str]
    lease: Lease | None
    prompt_hashes: list[BlockHash]
    """The client's ids of every full block of the prompt."""
    miss: Miss | None = None
    """Why the rest missed (when the lookup asked with ``explain=True``)."""

    @property
    def matched_blocks(self) -> int:
        return len(self.hashes)

    @property
    def matched_tokens(self) -> int:
        return len(self.hashes) * self.block_tokens


@dataclass(frozen=True, slots=True)
class Resolved:
    """A namespace as the server hashes it for this client (``POST /v1/namespaces/resolve``):
    block ``i``'s id is ``XXH3-128(id_{i-1} || tokens_i, hash_seed)`` from ``id_{-1} = root``."""

    namespace: Namespace
    """The namespace as the client names it (the server applies the tenant salt)."""
    root: NamespaceRoot
    block_tokens: int
    hash_seed: int


@dataclass(frozen=True, slots=True)
class StoreResult:
    block_tokens: int
    hashes: list[BlockHash]
    """Every full block's id (checked against the client's)."""
    missing: list[BlockHash]
    """The blocks the server lacked, each of which was uploaded."""
    stored: int
    """How many uploads stored a new block (an upload racing another writer may find it held)."""
    durable: bool
    """The uploads are on a durable tier (False when nothing was uploaded)."""
    status: list[BlockStatus] = field(default_factory=list)
    """Per block of ``hashes``: ``stored``, ``present`` (held already, or by another writer
    meanwhile) or ``dropped`` (the node had no room for it, or for a block before it)."""

    @property
    def kept(self) -> int:
        """How many blocks from the first the node holds after the store."""
        return kept(self.status)


@dataclass(frozen=True, slots=True)
class Prefetch:
    """A prefetch's answer: ``outcome`` is ``accepted`` (``blocks`` are being moved into the
    node's CPU tier), ``deferred`` (retry later) or ``rejected``; ``reason`` says why."""

    outcome: str
    reason: str
    blocks: int


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    tenant: str
    kind: str
    ttl_s: float
    created: float
    last_seen: float
    expires_at: float
    head: BlockHash | None
    pinned: bool
    attribution: MissTotals | None = None
    """Its lookups' misses by reason (``get_session`` only)."""
