"""The data plane's frames: encoding and decoding, no I/O (``docs/dataplane.md`` is the spec).

Every frame is a fixed 24-byte little-endian header and a body of ``body_len`` bytes::

    offset  size  field
         0     4  magic        b"SCDP"
         4     1  version      2 (3 for SESSION frames; see "Versions" in docs/dataplane.md)
         5     1  opcode       ``Op``
         6     2  flags        per opcode (``F_*``)
         8     8  request id   chosen by the client, echoed in every frame of the answer
        16     8  body_len     bytes of body following the header

The client sends requests (``HELLO`` first, then any of the others) and reads each one's
answer before the next: one ``*_OK`` frame, or for ``LOAD`` one ``BLOCK`` frame per block
asked, or an ``ERROR`` frame (which may cut a ``LOAD`` short). Bodies are described beside
their encoders; ids and roots are 16 raw bytes, tokens little-endian ``u32``.

Everything here is pure (the modules ``header``, ``control``, ``blocks``, ``samehost``,
``sessions`` and ``sizes``, whose names this package re-exports): the node (``server.py``) and
the clients (``sessioncache.connector``) do the socket work and call these to build and check
bytes, so both ends share one definition. A decoder that meets bytes breaking the framing
raises ``FrameError`` (the connection is then closed); values that are well framed but wrong
raise ``InvalidInput``.
"""

from __future__ import annotations

from sessioncache.dataplane.frames.blocks import (
    MISS_PRESSURES as MISS_PRESSURES,
)
from sessioncache.dataplane.frames.blocks import (
    MISS_REASONS as MISS_REASONS,
)
from sessioncache.dataplane.frames.blocks import (
    STORE_FIXED as STORE_FIXED,
)
from sessioncache.dataplane.frames.blocks import (
    Exists as Exists,
)
from sessioncache.dataplane.frames.blocks import (
    LoadIds as LoadIds,
)
from sessioncache.dataplane.frames.blocks import (
    LoadLease as LoadLease,
)
from sessioncache.dataplane.frames.blocks import (
    Lookup as Lookup,
)
from sessioncache.dataplane.frames.blocks import (
    LookupOk as LookupOk,
)
from sessioncache.dataplane.frames.blocks import (
    Miss as Miss,
)
from sessioncache.dataplane.frames.blocks import (
    StoreHead as StoreHead,
)
from sessioncache.dataplane.frames.blocks import (
    StoreOk as StoreOk,
)
from sessioncache.dataplane.frames.blocks import (
    block_header as block_header,
)
from sessioncache.dataplane.frames.blocks import (
    decode_exists as decode_exists,
)
from sessioncache.dataplane.frames.blocks import (
    decode_exists_ok as decode_exists_ok,
)
from sessioncache.dataplane.frames.blocks import (
    decode_load as decode_load,
)
from sessioncache.dataplane.frames.blocks import (
    decode_lookup as decode_lookup,
)
from sessioncache.dataplane.frames.blocks import (
    decode_lookup_ok as decode_lookup_ok,
)
from sessioncache.dataplane.frames.blocks import (
    decode_store_head as decode_store_head,
)
from sessioncache.dataplane.frames.blocks import (
    decode_store_ok as decode_store_ok,
)
from sessioncache.dataplane.frames.blocks import (
    encode_exists as encode_exists,
)
from sessioncache.dataplane.frames.blocks import (
    encode_exists_ok as encode_exists_ok,
)
from sessioncache.dataplane.frames.blocks import (
    encode_load as encode_load,
)
from sessioncache.dataplane.frames.blocks import (
    encode_lookup as encode_lookup,
)
from sessioncache.dataplane.frames.blocks import (
    encode_lookup_ok as encode_lookup_ok,
)
from sessioncache.dataplane.frames.blocks import (
    encode_store_head as encode_store_head,
)
from sessioncache.dataplane.frames.blocks import (
    encode_store_ok as encode_store_ok,
)
from sessioncache.dataplane.frames.control import (
    ErrorFrame as ErrorFrame,
)
from sessioncache.dataplane.frames.control import (
    Hello as Hello,
)
from sessioncache.dataplane.frames.control import (
    HelloOk as HelloOk,
)
from sessioncache.dataplane.frames.control import (
    decode_error as decode_error,
)
from sessioncache.dataplane.frames.control import (
    decode_hello as decode_hello,
)
from sessioncache.dataplane.frames.control import (
    decode_hello_ok as decode_hello_ok,
)
from sessioncache.dataplane.frames.control import (
    decode_release as decode_release,
)
from sessioncache.dataplane.frames.control import (
    decode_resolve as decode_resolve,
)
from sessioncache.dataplane.frames.control import (
    decode_resolve_ok as decode_resolve_ok,
)
from sessioncache.dataplane.frames.control import (
    encode_error as encode_error,
)
from sessioncache.dataplane.frames.control import (
    encode_hello as encode_hello,
)
from sessioncache.dataplane.frames.control import (
    encode_hello_ok as encode_hello_ok,
)
from sessioncache.dataplane.frames.control import (
    encode_release as encode_release,
)
from sessioncache.dataplane.frames.control import (
    encode_release_ok as encode_release_ok,
)
from sessioncache.dataplane.frames.control import (
    encode_resolve as encode_resolve,
)
from sessioncache.dataplane.frames.control import (
    encode_resolve_ok as encode_resolve_ok,
)
from sessioncache.dataplane.frames.control import (
    negotiate as negotiate,
)
from sessioncache.dataplane.frames.header import (
    ANSWER as ANSWER,
)
from sessioncache.dataplane.frames.header import (
    DECLINED_VERSION as DECLINED_VERSION,
)
from sessioncache.dataplane.frames.header import (
    F_BLOCK_MISSING as F_BLOCK_MISSING,
)
from sessioncache.dataplane.frames.header import (
    F_ERROR_CLOSING as F_ERROR_CLOSING,
)
from sessioncache.dataplane.frames.header import (
    F_LOAD_BY_LEASE as F_LOAD_BY_LEASE,
)
from sessioncache.dataplane.frames.header import (
    F_LOAD_EACH as F_LOAD_EACH,
)
from sessioncache.dataplane.frames.header import (
    F_LOAD_RELEASE as F_LOAD_RELEASE,
)
from sessioncache.dataplane.frames.header import (
    F_LOOKUP_DECLINED as F_LOOKUP_DECLINED,
)
from sessioncache.dataplane.frames.header import (
    F_LOOKUP_EXPLAIN as F_LOOKUP_EXPLAIN,
)
from sessioncache.dataplane.frames.header import (
    F_LOOKUP_KEYED as F_LOOKUP_KEYED,
)
from sessioncache.dataplane.frames.header import (
    F_RELEASE_CHECK as F_RELEASE_CHECK,
)
from sessioncache.dataplane.frames.header import (
    F_RELEASE_LIVE as F_RELEASE_LIVE,
)
from sessioncache.dataplane.frames.header import (
    F_SESSION as F_SESSION,
)
from sessioncache.dataplane.frames.header import (
    F_STORE_DURABLE as F_STORE_DURABLE,
)
from sessioncache.dataplane.frames.header import (
    F_STORE_FINISH as F_STORE_FINISH,
)
from sessioncache.dataplane.frames.header import (
    F_STORE_KEYED as F_STORE_KEYED,
)
from sessioncache.dataplane.frames.header import (
    F_STORE_LINKED as F_STORE_LINKED,
)
from sessioncache.dataplane.frames.header import (
    F_STORE_PARENT as F_STORE_PARENT,
)
from sessioncache.dataplane.frames.header import (
    F_UNCOUNTED as F_UNCOUNTED,
)
from sessioncache.dataplane.frames.header import (
    FINISH_REASONS as FINISH_REASONS,
)
from sessioncache.dataplane.frames.header import (
    FRAME_VERSION as FRAME_VERSION,
)
from sessioncache.dataplane.frames.header import (
    HEADER as HEADER,
)
from sessioncache.dataplane.frames.header import (
    HEADER_SIZE as HEADER_SIZE,
)
from sessioncache.dataplane.frames.header import (
    KEY_WORDS as KEY_WORDS,
)
from sessioncache.dataplane.frames.header import (
    MAGIC as MAGIC,
)
from sessioncache.dataplane.frames.header import (
    MAX_MESSAGE as MAX_MESSAGE,
)
from sessioncache.dataplane.frames.header import (
    MAX_SESSION_BYTES as MAX_SESSION_BYTES,
)
from sessioncache.dataplane.frames.header import (
    REPLIES as REPLIES,
)
from sessioncache.dataplane.frames.header import (
    REQUESTS as REQUESTS,
)
from sessioncache.dataplane.frames.header import (
    SAME_HOST as SAME_HOST,
)
from sessioncache.dataplane.frames.header import (
    SESSION_LEN as SESSION_LEN,
)
from sessioncache.dataplane.frames.header import (
    SESSION_OPS as SESSION_OPS,
)
from sessioncache.dataplane.frames.header import (
    SESSION_VERSION as SESSION_VERSION,
)
from sessioncache.dataplane.frames.header import (
    VERSION as VERSION,
)
from sessioncache.dataplane.frames.header import (
    VERSIONS as VERSIONS,
)
from sessioncache.dataplane.frames.header import (
    Header as Header,
)
from sessioncache.dataplane.frames.header import (
    Limits as Limits,
)
from sessioncache.dataplane.frames.header import (
    MiB as MiB,
)
from sessioncache.dataplane.frames.header import (
    Op as Op,
)
from sessioncache.dataplane.frames.header import (
    VersionError as VersionError,
)
from sessioncache.dataplane.frames.header import (
    decode_header as decode_header,
)
from sessioncache.dataplane.frames.header import (
    decode_session as decode_session,
)
from sessioncache.dataplane.frames.header import (
    encode_header as encode_header,
)
from sessioncache.dataplane.frames.header import (
    finish_code as finish_code,
)
from sessioncache.dataplane.frames.header import (
    finish_reason as finish_reason,
)
from sessioncache.dataplane.frames.header import (
    join_ids as join_ids,
)
from sessioncache.dataplane.frames.header import (
    session_len as session_len,
)
from sessioncache.dataplane.frames.header import (
    session_section as session_section,
)
from sessioncache.dataplane.frames.header import (
    split_ids as split_ids,
)
from sessioncache.dataplane.frames.samehost import (
    MAX_FDS as MAX_FDS,
)
from sessioncache.dataplane.frames.samehost import (
    MAX_SEGMENTS as MAX_SEGMENTS,
)
from sessioncache.dataplane.frames.samehost import (
    Commit as Commit,
)
from sessioncache.dataplane.frames.samehost import (
    LocateOk as LocateOk,
)
from sessioncache.dataplane.frames.samehost import (
    SegmentsOk as SegmentsOk,
)
from sessioncache.dataplane.frames.samehost import (
    Slot as Slot,
)
from sessioncache.dataplane.frames.samehost import (
    StageOk as StageOk,
)
from sessioncache.dataplane.frames.samehost import (
    decode_abort as decode_abort,
)
from sessioncache.dataplane.frames.samehost import (
    decode_commit as decode_commit,
)
from sessioncache.dataplane.frames.samehost import (
    decode_commit_ok as decode_commit_ok,
)
from sessioncache.dataplane.frames.samehost import (
    decode_locate as decode_locate,
)
from sessioncache.dataplane.frames.samehost import (
    decode_locate_ok as decode_locate_ok,
)
from sessioncache.dataplane.frames.samehost import (
    decode_segments as decode_segments,
)
from sessioncache.dataplane.frames.samehost import (
    decode_segments_ok as decode_segments_ok,
)
from sessioncache.dataplane.frames.samehost import (
    decode_stage_head as decode_stage_head,
)
from sessioncache.dataplane.frames.samehost import (
    decode_stage_ok as decode_stage_ok,
)
from sessioncache.dataplane.frames.samehost import (
    encode_abort as encode_abort,
)
from sessioncache.dataplane.frames.samehost import (
    encode_abort_ok as encode_abort_ok,
)
from sessioncache.dataplane.frames.samehost import (
    encode_commit as encode_commit,
)
from sessioncache.dataplane.frames.samehost import (
    encode_commit_ok as encode_commit_ok,
)
from sessioncache.dataplane.frames.samehost import (
    encode_locate as encode_locate,
)
from sessioncache.dataplane.frames.samehost import (
    encode_locate_ok as encode_locate_ok,
)
from sessioncache.dataplane.frames.samehost import (
    encode_segments as encode_segments,
)
from sessioncache.dataplane.frames.samehost import (
    encode_segments_ok as encode_segments_ok,
)
from sessioncache.dataplane.frames.samehost import (
    encode_stage as encode_stage,
)
from sessioncache.dataplane.frames.samehost import (
    encode_stage_ok as encode_stage_ok,
)
from sessioncache.dataplane.frames.sessions import (
    VERBS as VERBS,
)
from sessioncache.dataplane.frames.sessions import (
    SessionCall as SessionCall,
)
from sessioncache.dataplane.frames.sessions import (
    decode_session_call as decode_session_call,
)
from sessioncache.dataplane.frames.sessions import (
    decode_session_ok as decode_session_ok,
)
from sessioncache.dataplane.frames.sessions import (
    encode_session_call as encode_session_call,
)
from sessioncache.dataplane.frames.sessions import (
    encode_session_ok as encode_session_ok,
)
from sessioncache.dataplane.frames.sizes import (
    check_body as check_body,
)
from sessioncache.dataplane.frames.sizes import (
    max_body as max_body,
)
