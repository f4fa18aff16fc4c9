"""sessioncache: a prefix-caching KV-cache service for fleets of LLM inference engines."""

from sessioncache.hashing import BlockHash, Namespace, block_hashes

__all__ = ["BlockHash", "Namespace", "block_hashes"]
__version__ = "0.1.0"
