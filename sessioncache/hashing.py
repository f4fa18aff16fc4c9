"""Content-addressed block ids, and the one checksum of a block's payload.

A prompt's token ids are cut into blocks of ``namespace.block_tokens`` tokens; only full blocks
get ids. Block ``i``'s id is ``XXH3-128(parent || tokens_i as little-endian uint32, seed)``
where the parent of block 0 is the namespace root, a digest of everything that makes KV
incompatible (model, KV dtype and layout, block size, tenant salt, LoRA). Equal prefixes under
an equal namespace give equal ids on every engine and every day. The exact byte layout, with
golden vectors, is in ``docs/hashing.md``; change nothing here without bumping the version tag.

A payload's checksum (``payload_checksum``, XXH3-64 with seed 0) is the one every layer
writes and verifies: the disk and Redis headers, the catalog's ``checksum`` column, the
same-host COMMIT and its slots, the store's verified copies.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NewType, cast

import numpy as np
import numpy.typing as npt
import xxhash

from sessioncache.codecs import parse_codec
from sessioncache.errors import InvalidInput

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

BlockHash = NewType("BlockHash", bytes)
"""16 raw bytes: the XXH3-128 digest identifying one block and, through its parent, its prefix."""

NamespaceRoot = NewType("NamespaceRoot", bytes)
"""16 raw bytes: the digest every chain of one namespace starts from."""

HASH_BYTES = 16
NAMESPACE_TAG = b"sessioncache-ns-v1\x00"
_U64 = 1 << 64
_U32 = 1 << 32

Tokens = Sequence[int] | npt.NDArray[np.integer]


FIELD_LIMITS: dict[str, int] = {
    "model": 512,
    "kv_dtype": 64,
    "kv_layout": 256,
    "salt": 256,
    "lora": 512,
    "group": 256,
    "kv_codec": 32,
}
"""The longest value of each text field of a namespace a client may send, on every carrier
(the salt a server derives, ``"<tenant>/<salt>"``, may be longer)."""
MAX_BLOCK_TOKENS = 1 << 16
OPTIONAL_FIELDS = ("group", "kv_codec")
"""Fields added to ``Namespace`` after its first version: left out of its encoding (and so of
its digest) when unset, so that every id made before them stays as it was."""


def check_client_namespace(namespace: Namespace) -> Namespace:
    """``namespace`` as a client sent it, within ``FIELD_LIMITS`` (``InvalidInput``)."""
    for name, limit in FIELD_LIMITS.items():
        value = getattr(namespace, name)
        if value is not None and len(value) > limit:
            raise InvalidInput(f"namespace {name} is {len(value)} characters, at most {limit}")
    return namespace


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two engines' KV for the same tokens incompatible."""

    model: str
    block_tokens: int
    kv_dtype: str
    kv_layout: str
    salt: str | None = None
    lora: str | None = None
    group: str | None = None
    """The KV-cache group of a hybrid model whose objects this namespace holds (its kind and
    layers: ``"full/..."``, ``"window-<tokens>/..."``, ``"state/..."``; docs/hybrid.md). A
    namespace holds one payload size, so each group of a hybrid model has its own, derived
    from the model's by setting this field; objects of a group hang off the chain blocks of
    another group of the same model (``related``)."""
    kv_codec: str | None = None
    """How the lower tiers may store this namespace's blocks, when the engine asks for it:
    ``lossless``, or a lossy ``int8/<G>`` or ``fp8/<G>`` (``G`` elements per scale, the head
    dimension; ``sessioncache.codecs``). Part of the digest: a lossy namespace's ids are its
    own, so an engine that expects exact KV never reads lossy KV."""

    def __post_init__(self) -> None:
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int):
            raise InvalidInput("block_tokens must be an int")
        if not 0 < self.block_tokens <= MAX_BLOCK_TOKENS:
            raise InvalidInput(
                f"block_tokens must be within [1, {MAX_BLOCK_TOKENS}], got {self.block_tokens}"
            )
        for name in ("model", "kv_dtype", "kv_layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidInput(f"{name} must be a non-empty string")
        for name in ("salt", "lora", "group", "kv_codec"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInput(f"{name} must be a string or None")
        if self.kv_codec is not None:
            parse_codec(self.kv_codec, self.kv_dtype)  # InvalidInput: says what it takes

    def as_json(self) -> dict[str, Any]:
        """The namespace as the REST API and the stream's RESOLVE carry it: every field of
        the first version, and each later field only when it is set (``OPTIONAL_FIELDS``)."""
        fields = asdict(self)
        for name in OPTIONAL_FIELDS:
            if fields[name] is None:
                del fields[name]
        return fields

    def canonical_json(self) -> bytes:
        """The namespace's canonical encoding, the input of its root digest: ``as_json``, so
        that a field added later and left unset changes no id (docs/hashing.md)."""
        return json.dumps(
            self.as_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode()

    def related(self, other: Namespace) -> bool:
        """Both are groups of one hybrid model's KV under one tenant: equal in every field
        but ``group``, which both set."""
        return (
            self.group is not None
            and other.group is not None
            and replace(self, group=None) == replace(other, group=None)
        )

    def root(self, seed: int = 0) -> NamespaceRoot:
        """The chain root of this namespace under ``seed``."""
        return namespace_root(self, seed)

    @cached_property
    def _root0(self) -> NamespaceRoot:
        return NamespaceRoot(xxhash.xxh3_128_digest(NAMESPACE_TAG + self.canonical_json(), 0))


def tenant_namespace(namespace: Namespace, tenant: str | None) -> Namespace:
    """The namespace a server hashes under for ``tenant`` (None: authentication is off): the
    salt becomes ``"<tenant>"`` or ``"<tenant>/<salt>"``, so that two tenants sending the same
    tokens get different ids (docs/hashing.md). Servers and clients both call this."""
    if tenant is None:
        return namespace
    salt = tenant if namespace.salt is None else f"{tenant}/{namespace.salt}"
    return replace(namespace, salt=salt)


def _check_seed(seed: int) -> None:
    if not 0 <= seed < _U64:
        raise InvalidInput(f"seed must be an unsigned 64-bit integer, got {seed}")


def namespace_root(namespace: Namespace, seed: int = 0) -> NamespaceRoot:
    """``XXH3-128(b"sessioncache-ns-v1\\0" + canonical_json, seed)``."""
    _check_seed(seed)
    if seed == 0:
        return namespace._root0
    return NamespaceRoot(xxhash.xxh3_128_digest(NAMESPACE_TAG + namespace.canonical_json(), seed))


def tokens_to_le_bytes(tokens: Tokens) -> bytes:
    """Token ids as little-endian uint32 bytes; ids outside [0, 2**32) raise ``InvalidInput``."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidInput(f"tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype == np.dtype("<u4"):
            return tokens.tobytes()
        if not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidInput(f"tokens must be integers, got dtype {tokens.dtype}")
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError, TypeError) as exc:
            raise InvalidInput(f"tokens must be integers in [0, 2**32): {exc}") from exc
        if arr.ndim != 1:
            raise InvalidInput("tokens must be a flat sequence of integers")
        if arr.size == 0:
            return b""
        if arr.dtype.kind not in "iu":
            # floats, strings, bools and integers beyond int64 (object arrays) alike
            raise InvalidInput("token ids must be integers in [0, 2**32)")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _U32):
        raise InvalidInput("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def block_hashes_from_bytes(
    root: bytes, token_bytes: bytes, block_tokens: int, seed: int = 0
) -> list[BlockHash]:
    """Chain ids over little-endian uint32 token bytes already validated by the caller."""
    step = block_tokens * 4
    end = len(token_bytes) // step * step
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    append = out.append
    parent = root
    # One concatenation and one digest per block: the measured floor for a Python loop
    # (bench/hashing.py); building a strided buffer and hashing memoryview slices is slower,
    # and so is wrapping each digest in BlockHash() (NewType is a call at run time).
    if seed == 0:
        for off in range(0, end, step):
            parent = digest(parent + token_bytes[off : off + step])
            append(parent)
    else:
        for off in range(0, end, step):
            parent = digest(parent + token_bytes[off : off + step], seed)
            append(parent)
    return cast(list[BlockHash], out)


def block_hashes(namespace: Namespace, tokens: Tokens, seed: int = 0) -> list[BlockHash]:
    """Ids of every full block of ``tokens`` under ``namespace``; a partial tail gets none."""
    root = namespace_root(namespace, seed)
    return block_hashes_from_bytes(root, tokens_to_le_bytes(tokens), namespace.block_tokens, seed)


def payload_checksum(data: ReadableBuffer) -> int:
    """The checksum of a block payload: XXH3-64 (seed 0) of its bytes (``data``: any
    contiguous buffer). Hashed with the GIL released (``xxhash.xxh3_64(data)``;
    ``xxh3_64_intdigest`` would hold it for the whole payload), so the node's other threads
    run meanwhile."""
    return xxhash.xxh3_64(data).intdigest()


def payload_hasher() -> xxhash.xxh3_64:
    """``payload_checksum`` taken piece by piece: ``update`` it with the payload's pieces in
    order, and its ``intdigest()`` is the checksum of the whole (each update releases the
    GIL as ``payload_checksum`` does)."""
    return xxhash.xxh3_64()


def to_hex(block_hash: bytes) -> str:
    """The wire form of an id: 32 lowercase hex digits."""
    return block_hash.hex()


def from_hex(text: str) -> BlockHash:
    """Parse a wire id; anything but 32 hex digits raises ``InvalidInput``."""
    if not isinstance(text, str) or len(text) != 2 * HASH_BYTES:
        raise InvalidInput(f"a block id is {2 * HASH_BYTES} hex digits, got {text!r:.80}")
    try:
        return BlockHash(bytes.fromhex(text))
    except ValueError as exc:
        raise InvalidInput(f"a block id is {2 * HASH_BYTES} hex digits, got {text!r:.80}") from exc


# -- keyed blocks ----------------------------------------------------------------------------
#
# Engines that address KV by keys of their own (LMCache's chunk hashes, SGLang's page hashes)
# store and read blocks by *key* instead of by tokens: a keyed block's id is derived from its
# namespace root and a 16-byte key alone, so finding one key needs no context (no parent, no
# tokens). ``docs/hashing.md`` and ``docs/dataplane.md`` ("Keyed blocks") describe it.

KEY_BYTES = 16
"""A block key on the wire: 16 bytes (``block_key`` makes one of any engine key)."""
KEY_TAG = b"sessioncache-key-v1"
"""Appended to a keyed id's input. It is 19 bytes long, so a keyed input (16 + 16 + 19 bytes)
never has the length of a chain block's (16 + 4 x tokens): no keyed id equals a chain id."""


def block_key(key: bytes | str) -> bytes:
    """The 16-byte block key of an engine's key of any length: ``XXH3-128(key)`` (a ``str``
    as UTF-8). Engines whose keys are 16 random bytes already may send them as they are."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    return xxhash.xxh3_128_digest(data)


def keyed_block_ids(root: bytes, keys: Sequence[bytes], seed: int = 0) -> list[BlockHash]:
    """The id of each keyed block: ``XXH3-128(root || key || KEY_TAG, seed)``. Only the
    tenant's root and the key enter it, so, as for chains, nobody can name a block of
    another namespace or tenant, and the node derives the ids itself from what it is sent."""
    _check_seed(seed)
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    for key in keys:
        if len(key) != KEY_BYTES:
            raise InvalidInput(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
        out.append(digest(root + bytes(key) + KEY_TAG, seed))
    return cast(list[BlockHash], out)


def segment_ids(
    root: bytes,
    parent: bytes | None,
    units: bytes,
    block_tokens: int,
    *,
    keyed: bool = False,
    seed: int = 0,
) -> list[BlockHash]:
    """The ids of one stored segment, as the node derives them from what a STORE, a STAGE or
    a planned REST store sends: ``units`` is its token section (little-endian uint32 tokens,
    chained from ``parent``, or from the namespace ``root`` when the segment starts a chain:
    ``block_hashes_from_bytes``) or, ``keyed``, its key section (16-byte keys, each id from
    ``root`` alone: ``keyed_block_ids``)."""
    if keyed:
        keys = [units[i : i + KEY_BYTES] for i in range(0, len(units), KEY_BYTES)]
        return keyed_block_ids(root, keys, seed)
    return block_hashes_from_bytes(root if parent is None else parent, units, block_tokens, seed)


def divergence_block(hashes: Sequence[BlockHash], prev_ids: bytes) -> int | None:
    """The first block where ``hashes`` differs from ``prev_ids`` (joined ids), None when one
    is a prefix of the other. Ids commit to their whole prefix: equal at i means equal before
    i, so a binary search finds it."""
    n = min(len(hashes), len(prev_ids) // HASH_BYTES)
    if n == 0:
        return None

    def same(i: int) -> bool:
        return hashes[i] == prev_ids[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    if same(n - 1):
        return None
    lo, hi = 0, n - 1  # the answer is in [lo, hi]: hashes[hi] differs
    while lo < hi:
        mid = (lo + hi) // 2
        if same(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo
