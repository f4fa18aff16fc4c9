"""Block codecs: how a block's payload is stored on the lower tiers (disk, Redis).

The CPU and GPU tiers hold every block as the engine sent it; a codec applies where a block
is written to a durable or shared tier, and is undone when it is read back, into the
engine's own dtype. Four codecs, each with an id that the block header records
(``tiers/header.py``):

- ``raw`` (0): the bytes as sent. The default.
- ``lossless`` (1): a bit shuffle over the KV dtype's element size, then LZ4 (blosc2, one
  thread): byte-exact. A node or tenant setting, or the namespace, may choose it.
- ``int8/<G>`` (2): each run of ``G`` elements (a head's vector of one token when ``G`` is
  the head dimension: the runs of every KV layout are whole vectors) as int8 codes with one
  bf16 scale, ``absmax / 127``. Lossy.
- ``fp8/<G>`` (3): the same runs as float8 e4m3 with one bf16 scale, ``absmax / 448``. Lossy.

A lossy codec is chosen by the engine only, as the namespace's ``kv_codec`` (part of its
digest: a lossy namespace's ids are its own, so an engine that expects exact KV never reads
lossy KV). It needs the elements' dtype, the namespace's ``kv_dtype`` (bf16, f16 or f32;
blocks of another dtype are stored raw).

A lossy block's stored bytes: a 4-byte prefix (u16 ``G``, u8 dtype code, u8 flags), the ``n``
bf16 scales, then the ``n * G`` codes. A group holding an Inf or a NaN has no scale that
codes it: it is kept exact instead, its scale set to -1 and its codes to 0, its raw elements
appended after the codes in group order (flag ``ESCAPED``). Decoding runs in torch on the
calling thread.

``CodecTable``: which codec a namespace root's blocks are stored with; the namespace's own
``kv_codec`` when it sets one, else its tenant's setting, else the node's. The node records
each namespace when it resolves it.
"""

from __future__ import annotations

import logging
import struct
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from sessioncache.errors import InvalidInput

log = logging.getLogger(__name__)

__all__ = [
    "CODEC_IDS",
    "LOSSLESS",
    "RAW",
    "Codec",
    "CodecTable",
    "codec_of",
    "decode_block",
    "parse_codec",
]

RAW_ID, LOSSLESS_ID, INT8_ID, FP8_ID = 0, 1, 2, 3
CODEC_IDS: Final = {"raw": RAW_ID, "lossless": LOSSLESS_ID, "int8": INT8_ID, "fp8": FP8_ID}
_NAMES = {v: k for k, v in CODEC_IDS.items()}

_DTYPE_NAMES: Final = {
    ("bfloat16", 2): ("bf16", "bfloat16", "torch.bfloat16"),
    ("float16", 2): ("f16", "fp16", "float16", "half", "torch.float16"),
    ("float32", 4): ("f32", "fp32", "float32", "float", "torch.float32"),
}
_DTYPES: Final = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}
"""The KV dtype names a lossy codec understands, and their torch dtype and size."""
_DTYPE_CODES: Final = {"bfloat16": 1, "float16": 2, "float32": 3}
_CODE_DTYPES: Final = {v: k for k, v in _DTYPE_CODES.items()}
_PREFIX = struct.Struct("<HBB")

# torch warns that a tensor over read-only bytes may be written through; these only read
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)
_QMAX: Final = {INT8_ID: 127.0, FP8_ID: 448.0}
ESCAPED: Final = 1
"""A lossy block's prefix flag: some groups are kept exact after the codes."""


@dataclass(frozen=True, slots=True)
class Codec:
    """One codec and its parameters (see the module docstring)."""

    id: int
    group: int = 0
    """Elements per scale (lossy codecs)."""
    dtype: str = ""
    """The elements' torch dtype name (lossy codecs)."""
    typesize: int = 1
    """The elements' size in bytes (the lossless shuffle's)."""

    @property
    def name(self) -> str:
        base = _NAMES[self.id]
        return f"{base}/{self.group}" if self.lossy else base

    @property
    def lossy(self) -> bool:
        return self.id in (INT8_ID, FP8_ID)

    def encode(self, payload: Any) -> memoryview:
        """The stored bytes of ``payload`` (a flat byte buffer of the raw block)."""
        view = memoryview(payload).cast("B")
        if self.id == RAW_ID:
            return view
        if self.id == LOSSLESS_ID:
            return memoryview(_blosc_compress(view, self.typesize))
        return memoryview(_quantize(self, view))

    def decode(self, stored: Any, raw_nbytes: int) -> npt.NDArray[np.uint8]:
        """The raw block (``raw_nbytes`` bytes) from its stored bytes; ``InvalidInput`` for
        bytes this codec did not make."""
        return decode_block(self.id, stored, raw_nbytes)


MAX_GROUP: Final = 9999
"""The most elements per scale a lossy codec takes (a head dimension)."""
KV_CODEC_PATTERN: Final = r"^(lossless|(int8|fp8)/[1-9][0-9]{0,3})$"
"""What a namespace's ``kv_codec`` may be (the REST schema's pattern)."""
MAX_RAW_NBYTES: Final = 0xFFFFFFFF
"""The longest block a header records a raw length of (longer ones are stored raw)."""
RAW: Final = Codec(RAW_ID)
LOSSLESS: Final = Codec(LOSSLESS_ID, typesize=2)


def encode_or_raw(codec: Codec, payload: Any) -> tuple[Codec, memoryview]:
    """``payload`` as ``codec`` stores it, or raw where it cannot (a block that is not whole
    groups of a lossy codec's elements: kept exact, logged once per codec)."""
    view = memoryview(payload).cast("B")
    if codec.id == RAW_ID or view.nbytes > MAX_RAW_NBYTES:
        return RAW, view
    try:
        stored = codec.encode(view)
    except Exception as exc:  # a codec's own failure never fails the write: kept exact
        if codec.name not in _WARNED:
            _WARNED.add(codec.name)
            log.warning("%s: %s; such blocks are stored raw", codec.name, exc)
        return RAW, view
    if stored.nbytes >= view.nbytes:  # incompressible: raw is smaller, and exact
        return RAW, view
    return codec, stored


_WARNED: set[str] = set()


def parse_codec(text: str | None, kv_dtype: str) -> Codec:
    """The codec a namespace's ``kv_codec`` names (None: raw): ``lossless``, ``int8/<G>`` or
    ``fp8/<G>`` (``G``: elements per scale, the head dimension); ``InvalidInput`` otherwise
    or where ``kv_dtype`` is not one a lossy codec understands."""
    if text is None:
        return RAW
    dtype = _DTYPES.get(kv_dtype.lower())
    if text == "lossless":
        return Codec(LOSSLESS_ID, typesize=dtype[1] if dtype else 1)
    base, _, group = text.partition("/")
    if base not in ("int8", "fp8"):
        raise InvalidInput(
            f"kv_codec {text!r}: one of lossless, int8/<group>, fp8/<group> (group: the "
            "elements per scale, the head dimension)"
        )
    if not group.isdigit() or group.startswith("0") or not 1 <= int(group) <= MAX_GROUP:
        raise InvalidInput(
            f"kv_codec {text!r}: the group is a number of elements, 1 to {MAX_GROUP}"
        )
    if dtype is None:  # not floating-point KV this codec knows: its blocks are stored raw
        return Codec(CODEC_IDS[base], int(group))
    return Codec(CODEC_IDS[base], int(group), dtype[0], dtype[1])


def codec_of(namespace: Any) -> Codec | None:
    """The codec a ``Namespace`` asks for itself (its ``kv_codec``), or None."""
    text = getattr(namespace, "kv_codec", None)
    return None if text is None else parse_codec(text, namespace.kv_dtype)


# -- lossless -----------------------------------------------------------------------------


def _blosc_compress(view: memoryview, typesize: int) -> bytes:
    import blosc2

    out: bytes = blosc2.compress2(
        view,
        cparams=blosc2.CParams(
            codec=blosc2.Codec.LZ4,
            clevel=5,
            typesize=typesize,
            filters=[blosc2.Filter.BITSHUFFLE],
            nthreads=1,
        ),
    )
    return out


def _blosc_decompress(stored: Any, raw_nbytes: int) -> npt.NDArray[np.uint8]:
    import blosc2

    out = np.empty(raw_nbytes, np.uint8)
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(stored)
        if nbytes != raw_nbytes or cbytes != memoryview(stored).nbytes:
            raise InvalidInput(
                f"lossless block of {nbytes} bytes in {cbytes}, {raw_nbytes} expected"
            )
        blosc2.decompress2(stored, dst=out, dparams=blosc2.DParams(nthreads=1))
    except InvalidInput:
        raise
    except Exception as exc:  # blosc2 raises its own errors for a bad frame
        raise InvalidInput(f"lossless block: {exc}") from None
    return out


# -- lossy --------------------------------------------------------------------------------


def _quantize(codec: Codec, view: memoryview) -> bytes:
    import torch

    if not codec.dtype:
        raise InvalidInput(f"{codec.name} quantizes floating-point KV: one of {sorted(_DTYPES)}")
    dtype = getattr(torch, codec.dtype)
    if view.nbytes % (codec.group * codec.typesize):
        raise InvalidInput(
            f"a block of {view.nbytes} bytes is not whole groups of {codec.group} "
            f"{codec.dtype} elements"
        )
    elements = torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(-1, codec.group)
    x = elements.float()
    escaped = ~torch.isfinite(x).all(dim=1)
    kept = b""
    if bool(escaped.any()):  # Inf or NaN: no scale codes the group, so it is kept exact
        kept = elements[escaped].view(torch.uint8).numpy().tobytes()
        x[escaped] = 0.0
    qmax = _QMAX[codec.id]
    scale = (x.abs().amax(dim=1, keepdim=True) / qmax).to(torch.bfloat16)
    safe = scale.float().clamp_min(torch.finfo(torch.float32).tiny)
    if codec.id == INT8_ID:
        codes = torch.round(x / safe).clamp_(-127, 127).to(torch.int8)
    else:
        codes = (x / safe).clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    scale[escaped] = -1.0
    prefix = _PREFIX.pack(codec.group, _DTYPE_CODES[codec.dtype], ESCAPED if kept else 0)
    return b"".join(
        (
            prefix,
            scale.view(torch.uint8).numpy().tobytes(),
            codes.view(torch.uint8).numpy().data,
            kept,
        )
    )


def _dequantize(codec_id: int, stored: Any, raw_nbytes: int) -> npt.NDArray[np.uint8]:
    import torch

    view = memoryview(stored).cast("B")
    if view.nbytes < _PREFIX.size:
        raise InvalidInput("a lossy block shorter than its prefix")
    group, dcode, flags = _PREFIX.unpack_from(view)
    name = _CODE_DTYPES.get(dcode)
    if name is None or group == 0 or flags & ~ESCAPED:
        raise InvalidInput("a lossy block with an unknown dtype, group or flag")
    dtype = getattr(torch, name)
    item = torch.empty(0, dtype=dtype).element_size()
    n, rest = divmod(raw_nbytes, group * item)
    coded = _PREFIX.size + 2 * n + n * group
    if rest or view.nbytes < coded or (view.nbytes > coded and not flags & ESCAPED):
        raise InvalidInput(f"a lossy block of {view.nbytes} bytes for {raw_nbytes} raw")
    body = torch.frombuffer(view, dtype=torch.uint8)
    scale = body[_PREFIX.size : _PREFIX.size + 2 * n].view(torch.bfloat16).view(n, 1)
    codes = body[_PREFIX.size + 2 * n : coded].view(n, group)
    out = np.empty(raw_nbytes, np.uint8)
    dst = torch.from_numpy(out).view(dtype).view(n, group)
    if codec_id == INT8_ID:
        dst.copy_(codes.view(torch.int8))  # exact: |code| <= 127
    else:
        dst.copy_(codes.view(torch.float8_e4m3fn).to(dtype))
    dst.mul_(scale.to(dtype))
    if flags & ESCAPED:
        escaped = (scale < 0).view(n)
        kept = body[coded:]
        if kept.numel() != int(escaped.sum()) * group * item:
            raise InvalidInput(f"a lossy block of {view.nbytes} bytes for {raw_nbytes} raw")
        dst[escaped] = kept.clone().view(dtype).view(-1, group)  # clone: aligned
    return out


def decode_block(codec_id: int, stored: Any, raw_nbytes: int) -> npt.NDArray[np.uint8]:
    """The raw block from bytes stored with codec ``codec_id`` (the header's);
    ``InvalidInput`` for an unknown codec or bytes it did not make."""
    if codec_id == RAW_ID:
        out = np.frombuffer(stored, np.uint8)
        if out.nbytes != raw_nbytes:
            raise InvalidInput(f"a raw block of {out.nbytes} bytes, {raw_nbytes} expected")
        return out
    if codec_id == LOSSLESS_ID:
        return _blosc_decompress(stored, raw_nbytes)
    if codec_id in (INT8_ID, FP8_ID):
        return _dequantize(codec_id, stored, raw_nbytes)
    raise InvalidInput(f"unknown block codec {codec_id}")


# -- what the codecs save ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredBytes:
    """One namespace's blocks on one tier: raw bytes, and the bytes stored for them."""

    tier: str
    root: bytes
    tenant: str
    model: str
    codec: str
    raw: int
    stored: int

    @property
    def ratio(self) -> float:
        return self.raw / self.stored if self.stored else 1.0


def stored_bytes(tiers: Any, codecs: CodecTable, describe: Any) -> list[StoredBytes]:
    """Per tier that may store blocks encoded (``tiers.base.CodedTier``, a wrapper's
    ``inner`` too) and per namespace root on it, what its blocks take there; ``describe``:
    root -> (tenant, namespace fields) or None (``tenancy.NamespaceOwners.describe``)."""
    out: list[StoredBytes] = []
    for tier in tiers:
        inner = getattr(tier, "inner", tier)
        by_root = getattr(inner, "stored_by_root", None)
        if by_root is None:
            continue
        for root, (raw, stored) in sorted(by_root().items()):
            known = describe(root)
            tenant, fields = known if known is not None else ("", {})
            out.append(
                StoredBytes(
                    tier.name,
                    root,
                    tenant,
                    str(fields.get("model", "")),
                    codecs.for_root(root).name,
                    raw,
                    stored,
                )
            )
    return out


# -- which codec a root's blocks get --------------------------------------------------------


class CodecTable:
    """The codec of each namespace root's blocks on the lower tiers (module docstring).
    ``node``: the node's setting (raw or lossless); ``tenants``: tenant -> setting."""

    def __init__(self, node: str = "raw", tenants: Mapping[str, str] | None = None) -> None:
        for what, text in (("node", node), *(tenants or {}).items()):
            if text not in ("raw", "lossless"):  # settings name raw; a namespace leaves it unset
                raise InvalidInput(
                    f"codec setting of {what}: raw or lossless (a lossy codec is the "
                    f"engine's choice, its namespace's kv_codec), got {text!r}"
                )
        self._node = node
        self._tenants = dict(tenants or {})
        self._lock = threading.Lock()
        self._roots: dict[bytes, Codec] = {}

    def remember(self, root: bytes, namespace: Any, tenant: str | None) -> Codec:
        """Record the codec of ``namespace``'s blocks (its root ``root``, resolved for
        ``tenant``): its own ``kv_codec``, else the tenant's or the node's setting."""
        own = codec_of(namespace)
        if own is None:
            setting = self._tenants.get(tenant or "", self._node)
            own = RAW if setting == "raw" else parse_codec(setting, namespace.kv_dtype)
        if own.id != RAW_ID:
            with self._lock:
                self._roots[bytes(root)] = own
        return own

    def for_root(self, root: bytes) -> Codec:
        """The codec of ``root``'s blocks (raw for a root never recorded)."""
        return self._roots.get(bytes(root), RAW)
