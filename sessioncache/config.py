"""Settings, read from ``SESSIONCACHE_*`` environment variables and an optional TOML file
(``SESSIONCACHE_CONFIG=/etc/sessioncache.toml``; the environment wins over the file).

README.md's configuration table is rendered from the fields below (their docstrings and
defaults): after changing a field, run ``python -m sessioncache.config --write README.md``.
``tests/sessioncache/test_config.py`` fails while the two differ.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

GiB = 1 << 30
MiB = 1 << 20
DAY_S = 86400.0


class EngineSetting(BaseModel):
    """An engine registered at start (``SESSIONCACHE_ENGINES``): see docs/routing.md."""

    model_config = ConfigDict(extra="forbid")

    engine_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")
    namespace: dict[str, str | int | None] = Field(
        description="model, block_tokens, kv_dtype, kv_layout[, salt, lora]"
    )
    endpoint: str = Field(pattern=r"^(tcp|ipc|inproc)://\S+$")
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp|ipc|inproc)://\S+$")
    topic: str = ""
    tenant: str | None = Field(None, description="None: shared by every tenant")


Share = Annotated[float, Field(ge=0, le=1)]
"""A share of a whole, 0 to 1."""
PositiveShare = Annotated[float, Field(gt=0, le=1)]
"""A share of a whole, above 0, up to 1."""
Port = Annotated[int, Field(ge=0, lt=65536)]
"""A TCP port; 0 picks a free one."""


class Settings(BaseSettings):
    """The service's configuration; embedded defaults need no external service.

    One setting a field: its type (with its bounds), its default, and below it the docstring
    that is its description (README's table folds its lines into one).
    """

    model_config = SettingsConfigDict(
        env_prefix="SESSIONCACHE_", extra="ignore", use_attribute_docstrings=True
    )

    # -- tiers
    data_dir: Path = Path(".sessioncache")
    """disk tier (`blocks/`) and the SQLite catalog (`catalog.db`)"""
    gpu_bytes: NonNegativeInt = 0
    """GPU tier capacity in bytes; 0 leaves the tier out"""
    gpu_device: str | None = Field(
        None, json_schema_extra={"doc_default": "current CUDA device, else `cpu`"}
    )
    """torch device of the GPU tier"""
    cpu_bytes: NonNegativeInt = 4 * GiB
    """CPU tier capacity; 0 leaves it out"""
    cpu_spare_chunks: NonNegativeInt = 2
    """with `cpu_preallocate=off`: 64 MiB chunks of the CPU tier made (and faulted in) ahead of
    need by a background thread from the node's start, within its capacity; 0: made by the store
    that needs it, at the kernel's rate"""
    cpu_preallocate: Literal["background", "wait", "off"] = "background"
    """make the whole CPU tier ahead of need: `background` (a thread makes it 64 MiB at a time from
    the node's start, while it serves; a store that comes first waits for the chunk being made),
    `wait` (the node serves once it is made), `off` (made as stores need it, `cpu_spare_chunks`
    ahead). `background` and `wait` hold `cpu_bytes` of memory from start, never more; `true` and
    `false` mean `wait` and `off`"""
    shm: bool = Field(
        default_factory=lambda: sys.platform == "linux",
        json_schema_extra={"doc_default": "`true` on Linux"},
    )
    """the CPU tier in shared memory (memfd segments), which engines on this host map through the
    same-host socket (`docs/dataplane.md`); engines on a CUDA host register their mappings of it
    with CUDA, and a node with a GPU tier its own"""
    shm_socket: Path | None = Field(
        None, json_schema_extra={"doc_default": "`sessioncache.sock` in the data dir"}
    )
    """the same-host Unix socket (mode 0600)"""
    shm_trusted_tenants: list[str] = Field(default_factory=list)
    """JSON list of the tenants served on the same-host socket: they map the whole CPU tier, every
    tenant's blocks (without API keys the one tenant is trusted)"""
    disk_bytes: NonNegativeInt = 64 * GiB
    """disk tier capacity; 0 leaves it out"""
    disk_codec: Literal["raw", "lossless"] = "raw"
    """how the disk tier stores blocks: `raw`, or `lossless` (bit shuffle + LZ4, byte-exact;
    docs/codecs.md); a namespace's own `kv_codec` (an engine's choice, lossy ones included) comes
    first"""
    tenant_codecs: dict[str, Literal["raw", "lossless"]] = Field(default_factory=dict)
    """JSON per tenant, its disk codec (`{"<tenant>": "lossless"}`), before `disk_codec`"""
    default_ttl_s: PositiveFloat = 3 * DAY_S
    """TTL of blocks stored outside a session"""
    hash_seed: int = Field(0, ge=0, lt=1 << 64)
    """the seed of every block id (the same on every node and client)"""
    promote_on_get: bool = True
    """copy a lower-tier hit up into the first tier"""
    max_lease_s: PositiveFloat = 3600.0
    """the longest lease a lookup may take"""

    # -- sessions
    agent_ttl_s: PositiveFloat = 3 * DAY_S
    """sliding TTL of `agent` sessions"""
    chat_ttl_s: PositiveFloat = 7 * DAY_S
    """sliding TTL of `chat` sessions"""
    session_kinds: dict[str, float] = Field(default_factory=dict)
    """more session kinds, JSON name -> TTL seconds"""
    idle_timeout_s: PositiveFloat = 300.0
    """idle time after which a session's pins are released"""
    pin_share: Share = 0.5
    """largest share of a tier's capacity that pins may hold"""
    pins_follow_forecast: bool = False
    """when a session's request finishes, release its pins at once if its forecast return lies
    further ahead than `idle_timeout_s` (a finished turn whose user reads for minutes), instead
    of holding them idle that long (docs/sessions.md). Off by default: the finished turns then
    compete by forecast alone, which another tenant's finish reasons steer (one claiming tool
    calls keeps its chains over them)"""
    sweep_interval_s: PositiveFloat = 60.0
    """period of the background sweep"""
    eviction_policy: Literal["forecast", "next_use", "lru"] = "forecast"
    """`forecast`: the tail least likely to be read per second it is held leaves first (its
    session's chance of a return within the tier's turnover, from return times fitted per
    finish class, docs/sessions.md); `next_use`: the tail whose session is predicted back last
    (the time it is back with probability 0.8: the default before 2026-12-07); `lru`: least
    recently used tail first (the policy before forecasts, for comparison and fallback)"""
    prefetch_forecast: bool = True
    """move a session's chain up into the CPU tier ahead of its forecast return (its predicted
    next use less the time its bytes take at the disk's measured speed), into free room or
    room held by blocks forecast back later, never evicting a pinned block or a sooner return
    (docs/sessions.md); false: only explicit prefetches (`POST /v1/sessions/{id}/prefetch`)"""
    prefetch_hold_s: PositiveFloat = 300.0
    """how long an explicit prefetch keeps the session's chain leased in the CPU tier (admitted
    against the tenant's `tenant_pin_share`, as a lease is), waiting for its lookup"""
    attribution_ring_blocks: PositiveInt = 65_536
    """miss attribution: ids remembered per tier after their last copy left"""
    attribution_sessions: PositiveInt = 10_000
    """miss attribution: sessions whose previous prompt is kept"""

    # -- catalog
    database_url: str | None = Field(
        None, json_schema_extra={"doc_default": "SQLite under the data dir"}
    )
    """catalog URL, e.g. `postgresql+psycopg://user@host/db`"""
    database_schema: str | None = None
    """PostgreSQL schema of the catalog"""
    migrate_on_start: bool = True
    """run catalog migrations when the service starts"""
    catalog_flush_interval_s: PositiveFloat = 0.2
    """period of the catalog's write-behind flush"""
    catalog_wait_s: Annotated[float, Field(gt=0, le=60)] = 1.5
    """longest a call waits for the catalog (a lock, a connection) before its request is
    answered 503 with `Retry-After`, so that the answer comes within 2 s (a PostgreSQL that is
    stopped refuses at once)"""
    reconcile_verify: bool = True
    """on start, read back disk files the catalog lacks"""

    # -- shared tier and fleet (Redis)
    redis_url: str | None = None
    """shared tier and fleet index: `redis://host:port/db` or `redis+cluster://host:port`; unset:
    neither"""
    redis_bytes: PositiveInt = 64 * GiB
    """this node's budget in the shared tier"""
    redis_prefix: str = Field("sc:", min_length=1)
    """prefix of every Redis key (one per deployment)"""
    redis_write_policy: Literal["write_through", "write_back"] = "write_through"
    """`write_through`: every stored block also goes to Redis; `write_back`: only blocks demoted
    from the last local tier do"""
    node_id: str = Field(
        default_factory=socket.gethostname, json_schema_extra={"doc_default": "the host name"}
    )
    """this node's name in the fleet index"""
    node_url: str | None = Field(None, json_schema_extra={"doc_default": "`http://{host}:{port}`"})
    """where other nodes reach this one (advertised in the fleet index)"""
    fleet_ttl_s: PositiveFloat = 15.0
    """heartbeat expiry of a node's fleet index entry"""

    # -- service
    host: str = "127.0.0.1"
    """address `sessioncache serve` binds"""
    port: Port = 8080
    """port `sessioncache serve` binds"""
    # secrets: never in a printed or logged Settings
    api_keys: dict[str, str] = Field(default_factory=dict, repr=False)
    """JSON `{"<key>": "<tenant>"}`; empty runs open, loopback only"""
    http_max_connections: PositiveInt = 4096
    """most REST connections open at once, lowered to stay below the process's descriptor limit; at
    the cap a new connection evicts the one stalled longest (waiting for a request head or body),
    or is answered 503 when every one is busy"""
    http_tenant_share: PositiveShare = 0.5
    """share of `http_max_connections` one tenant's REST connections may hold, counted from their
    first request head (those without a known key count together); past it a request is answered
    429 and its connection closed; `http_connections` in `tenant_limits` sets a tenant's count
    instead; unused without API keys"""
    http_head_timeout_s: PositiveFloat = 10.0
    """a REST connection that has not sent a whole request head this long after it opened, or after
    its previous response, is closed"""
    http_body_floor_s: PositiveFloat = 10.0
    """grace a REST request body gets after its head before `http_body_min_bytes_per_s` applies; a
    body behind it is answered 408 and its connection closed"""
    http_body_min_bytes_per_s: PositiveInt = 65_536
    """least rate of a REST request body: t seconds after its head, at least
    (t - `http_body_floor_s`) times this many bytes of it have arrived"""
    http_keepalive_s: PositiveFloat = 5.0
    """an idle REST connection is closed after this long"""
    max_body_bytes: PositiveInt = 256 * MiB
    """largest request body"""
    tenant_upload_slots: PositiveInt = 262_144
    """most REST upload slots one tenant may hold open (one per missing block of each
    `POST /v1/store`); a store past it is refused whole with 429, and no tenant's store ever
    closes another's slots"""
    tenant_stream_connections: PositiveInt = 32
    """most authenticated block-stream (and same-host) connections of one tenant at once"""
    tenant_namespaces: PositiveInt = 1024
    """most namespaces (distinct roots) one tenant may use"""
    tenant_sessions: PositiveInt = 65_536
    """most sessions one tenant may hold open at once"""
    tenant_pin_share: Share = 0.5
    """largest share of each tier one tenant's pinned blocks (leases, session pins, same-host
    stagings together) may hold: a lease, a session pin or a staging past it takes the prefix that
    fits (a lease of which no block fits: 429); `pin_share` still bounds every tenant's session
    pins together"""
    tenant_limits: dict[str, dict[str, int | float]] = Field(default_factory=dict)
    """JSON per tenant, any of its bounds: `{"<tenant>": {"upload_slots": n,
    "stream_connections": n, "inflight_bytes": n, "engines": n, "namespaces": n}}`; the others
    keep their `tenant_*` defaults"""
    tenant_inflight_bytes: PositiveInt = 1 * GiB
    """most bytes of request bodies one tenant's requests may hold in the node's receive buffers at
    once, over all its connections (REST uploads, stream stores); past it a request is refused with
    429 `QuotaExceeded`"""
    max_json_bytes: PositiveInt = 32 * MiB
    """largest request body of every route but block uploads (JSON): 2M tokens of a lookup
    take 22 MB"""
    max_tokens: PositiveInt = 2_000_000
    """most tokens in one request"""
    durable_uploads: bool = False
    """make every store durable: answer only once its blocks are on disk (fsync-ed), as a store
    asking `durable` does; false: a store is answered once its first tier holds it
    (`durable: false`) and its disk copy follows (write-behind)"""
    write_behind_bytes: NonNegativeInt = 4 * GiB
    """bound of the write-behind queue (blocks of the memory tiers not on disk yet; the queue holds
    no copy of them): a store that would pass it waits; a crash loses at most this much of the
    stores answered `durable: false` (it loses the memory tiers anyway: the default is the CPU
    tier's); 0 turns write-behind off (blocks reach disk when evicted from memory)"""
    tenant_write_behind_share: PositiveShare = 0.5
    """largest share of `write_behind_bytes` one tenant's blocks may take: a tenant's flood stalls
    that tenant (the default of each tenant's `write_behind_share`, which `tenant_limits` may
    set)"""
    upload_ttl_s: PositiveFloat = 600.0
    """how long the upload slots of a store stay open"""
    store_room_wait_s: NonNegativeFloat = 30.0
    """longest a store waits for room in a full memory tier whose victims are waiting for the
    write-behind (queued, or being written to disk); past it the store copies a queued victim to
    disk itself or, with nothing evictable, answers the block `dropped`"""

    # -- admin dashboard (`/admin`)
    admin_token: SecretStr | None = None
    """token of the `/admin` dashboard and of admin operations such as `POST /v1/gc` (separate
    from API keys); unset: both only when the service runs open"""
    metrics_token: SecretStr | None = None
    """bearer token that opens the per-tenant and per-namespace series of `/metrics` (the admin
    token does too); without either, a node with API keys serves only the node-wide series
    (docs/metrics.md)"""
    metrics_top_namespaces: NonNegativeInt = 20
    """namespaces `/metrics` lists one by one, the most active (hit and miss tokens); the others
    are summed into one `namespace="other"` row"""
    prefill_tokens_per_s: PositiveFloat = 10000.0
    """an engine's prefill rate, to turn hit tokens into GPU-seconds saved"""
    history_interval_s: PositiveFloat = 5.0
    """period of the in-memory stats history behind the dashboard"""
    history_span_s: PositiveFloat = 3600.0
    """how far back the in-memory stats history reaches"""

    # -- data plane (docs/dataplane.md)
    stream_enabled: bool = True
    """serve the binary block stream beside the REST API"""
    stream_host: str = "127.0.0.1"
    """address the block stream binds"""
    stream_port: Port = 8081
    """port of the block stream; 0 picks a free one"""
    stream_advertise: str | None = Field(
        None, json_schema_extra={"doc_default": "the bound address"}
    )
    """`host:port` that `GET /v1/dataplane` tells clients to connect to"""
    stream_max_connections: PositiveInt = 64
    """most block-stream connections served at once"""
    stream_hello_timeout_s: PositiveFloat = 5.0
    """a block-stream connection that has not completed its HELLO this long after it opened is
    closed"""
    stream_max_unauthenticated: PositiveInt = 16
    """most block-stream connections at once that have not completed a HELLO; a new one past it, or
    past `stream_max_connections`, closes the oldest of them"""
    stream_max_ids: PositiveInt = 16384
    """most blocks in one block-stream request"""
    stream_timeout_s: PositiveFloat = 30.0
    """longest wait for the rest of a frame, or for a peer to take a block"""
    stream_idle_timeout_s: NonNegativeFloat = 0.0
    """close a block-stream connection idle this long; 0: never"""

    # -- KV-aware routing (docs/routing.md)
    engines: list[EngineSetting] = Field(default_factory=list)
    """JSON list of engines whose KV events the node follows from the start:
    `{"engine_id", "namespace": {...}, "endpoint", "replay_endpoint", "topic", "tenant"}` (no
    tenant: shared by every tenant)"""
    max_engines_per_tenant: PositiveInt = 16
    """most engines one tenant may register through `POST /v1/engines` (each is a socket the node
    keeps dialling, backing off to `engine_redial_max_s` while the endpoint is dead)"""
    engine_endpoint_prefixes: list[str] | None = None
    """JSON list of the endpoint prefixes (`tcp://10.0.0.`, `ipc:///run/engines/`) at which a
    tenant may register engines when API keys are set; unset: `tcp://` at an IP address off this
    host only (docs/routing.md)"""
    # secrets: a tenant knowing another's salt could plant prefixes in its name
    tenant_cache_salts: dict[str, str] = Field(default_factory=dict, repr=False)
    """JSON `{"<tenant>": "<cache_salt>"}`: the vLLM `cache_salt` of each tenant's requests; with
    API keys, a chain a shared engine caches routes only for the tenant whose salt it carries
    (docs/routing.md)"""
    engine_stale_s: PositiveFloat = 300.0
    """an engine silent this long (no KV event) is stale and scores nothing; so is one the node is
    behind on (a replay pending, messages queued)"""
    engine_replay_timeout_s: PositiveFloat = 2.0
    """longest wait for an engine's replay socket to answer"""
    engine_replay_buffer: PositiveInt = 10_000
    """messages an engine's replay socket holds (vLLM's `buffer_steps`): a wider gap is not asked
    for, the engine's view starts afresh past it; also the most messages of one engine kept waiting
    while its replay is in flight"""
    engine_redial_max_s: PositiveFloat = 2.0
    """longest wait between two dials of a dead engine endpoint; each (re)connect asks the engine's
    replay socket for what it missed"""
    route_medium_weights: dict[str, float] = Field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25}
    )
    """JSON medium -> worth of one token an engine holds there, for `/v1/route`"""
    route_cache_weight: NonNegativeFloat = 0.25
    """worth of one token held in sessioncache's own tiers, for `/v1/route`"""

    @field_validator("cpu_preallocate", mode="before")
    @classmethod
    def _preallocate_as_bool(cls, value: object) -> object:
        """The earlier boolean setting: true waits for the tier, false makes it as needed."""
        if isinstance(value, bool):
            return "wait" if value else "off"
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            return "wait"
        if isinstance(value, str) and value.strip().lower() in ("false", "0", "no"):
            return "off"
        return value

    def kind_ttls(self) -> dict[str, float]:
        return {"agent": self.agent_ttl_s, "chat": self.chat_ttl_s, **self.session_kinds}

    def shm_socket_path(self) -> Path:
        """Absolute: it is advertised to clients, whose working directory is their own."""
        return (self.shm_socket or self.data_dir / "sessioncache.sock").absolute()

    def catalog_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'catalog.db').resolve()}"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = os.environ.get("SESSIONCACHE_CONFIG")
        if toml_path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(toml_path)))
        return tuple(sources)


# -- the configuration table of README.md ---------------------------------------------------

TABLE_BEGIN = (
    "<!-- settings table: generated by `python -m sessioncache.config --write README.md` -->"
)
TABLE_END = "<!-- end of settings table -->"


def _unit_note(name: str, value: object) -> str:
    """A readable size or duration beside a large raw default: "4 GiB", "3 days"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    if name.endswith("_bytes"):
        for unit, size in (("GiB", GiB), ("MiB", MiB)):
            if value >= size and value % size == 0:
                return f"{int(value // size)} {unit}"
    if name.endswith("_s") and value >= DAY_S and value % DAY_S == 0:
        days = int(value // DAY_S)
        return f"{days} day" if days == 1 else f"{days} days"
    return ""


def _default_text(name: str, field: FieldInfo) -> str:
    """The default as the table states it: ``doc_default`` in the field's
    ``json_schema_extra`` where the value says little (``None`` resolved at run time, a
    ``default_factory`` such as the host name), else the value itself."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "doc_default" in extra:
        return str(extra["doc_default"])
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict | list):
        text = json.dumps(value)
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = str(value)
    note = _unit_note(name, value)
    return f"`{text}` ({note})" if note else f"`{text}`"


def settings_table() -> str:
    """The markdown table of every setting: variable, default, meaning (its description, the
    field's docstring, on one line)."""
    prefix = Settings.model_config.get("env_prefix", "")
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{prefix}{name.upper()}` | {_default_text(name, field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def _table_span(text: str) -> tuple[int, int]:
    """Where the table sits in README's ``text``: between the two marker lines."""
    begin = text.find(TABLE_BEGIN + "\n")
    end = text.find(TABLE_END, max(begin, 0))
    if begin < 0 or end < 0:
        raise ValueError(f"no {TABLE_BEGIN!r} ... {TABLE_END!r} section")
    return begin + len(TABLE_BEGIN) + 1, end


def readme_table(text: str) -> str:
    """The configuration table as README's ``text`` has it."""
    begin, end = _table_span(text)
    return text[begin:end]


def with_table(text: str) -> str:
    """README's ``text`` with its configuration table rendered afresh from ``Settings``."""
    begin, end = _table_span(text)
    return text[:begin] + settings_table() + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sessioncache.config",
        description="Render README.md's configuration table from the Settings fields.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print the table")
    action.add_argument(
        "--write", type=Path, metavar="README", help="replace the table in this file"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_table())
        return 0
    path: Path = args.write
    text = path.read_text()
    path.write_text(with_table(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
