"""Reusable receive buffers for block uploads (``sessioncache.buffers.BufferPool``).

Uploads of one deployment all have the same payload size, so pooled buffers keep them in
memory the process has already faulted in. The store copies a payload into its tier before
``put`` returns, so a buffer is free again as soon as the upload is done.
"""

from __future__ import annotations

from sessioncache.buffers import BufferPool

__all__ = ["BufferPool"]
