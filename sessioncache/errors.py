"""One rooted exception hierarchy: every error sessioncache raises on purpose is a
``SessionCacheError``; the API layer maps each class to one HTTP status and nowhere else."""

from __future__ import annotations


class SessionCacheError(Exception):
    """Root of every error raised on purpose by sessioncache."""


class InvalidInput(SessionCacheError, ValueError):
    """The caller passed something malformed (bad token ids, negative TTL, bad id, ...)."""


class PayloadSizeError(InvalidInput):
    """A payload's length does not match the size its namespace or slot requires."""


class UnknownTier(InvalidInput, KeyError):
    """A tier name that the store does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown tier"


class BlockNotFound(SessionCacheError, KeyError):
    """The block is not in the cache (never stored, expired or evicted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "block not found"


class LeaseNotFound(SessionCacheError, KeyError):
    """The lease id is unknown or the lease has already expired or been released."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "lease not found"


class AuthRefused(SessionCacheError):
    """The node refused the connection: no HELLO first, an unknown API key, or a peer that is
    not on this host while the node runs without API keys."""


class StoreRefused(SessionCacheError):
    """A store under a namespace root not resolved on this connection, or hanging off a
    parent that is not held under that root (nobody plants blocks in a chain not their own)."""


class SessionNotFound(SessionCacheError, KeyError):
    """No open session with that id (for that tenant)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "session not found"


class UploadRefused(SessionCacheError):
    """A payload for an id that was not handed out to this caller (or whose slot expired)."""


class TierFull(SessionCacheError):
    """A tier has no room for a payload; the store catches this and evicts or demotes."""


class DurableStoreFailed(SessionCacheError):
    """A durable store whose block could not be written to the durable tier (its filesystem
    full, or nothing there evictable): the caller must not take the block as durable."""


class CorruptBlock(SessionCacheError):
    """A stored payload failed its checksum or was truncated; it is quarantined, never served."""


class EngineNotFound(SessionCacheError, KeyError):
    """No engine of that id is registered (or the caller's tenant may not see it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "engine not found"


class EngineExists(SessionCacheError):
    """An engine of that id is already registered."""
