"""Settings, read from ``SESSIONCACHE_*`` environment variables and an optional TOML file
(``SESSIONCACHE_CONFIG=/etc/sessioncache.toml``; the environment wins over the file).

README.md's configuration table is rendered from the fields below (their descriptions and
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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
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


class Settings(BaseSettings):
    """The service's configuration; embedded defaults need no external service."""

    model_config = SettingsConfigDict(env_prefix="SESSIONCACHE_", extra="ignore")

    # -- tiers
    data_dir: Path = Field(
        Path(".sessioncache"),
        description="disk tier (`blocks/`) and the SQLite catalog (`catalog.db`)",
    )
    gpu_bytes: int = Field(0, ge=0, description="GPU tier capacity in bytes; 0 leaves the tier out")
    gpu_device: str | None = Field(
        None,
        description="torch device of the GPU tier",
        json_schema_extra={"doc_default": "current CUDA device, else `cpu`"},
    )
    cpu_bytes: int = Field(4 * GiB, ge=0, description="CPU tier capacity; 0 leaves it out")
    cpu_spare_chunks: int = Field(
        2,
        ge=0,
        description="with `cpu_preallocate=off`: 64 MiB chunks of the CPU tier made (and "
        "faulted in) ahead of need by a background thread from the node's start, within its "
        "capacity; 0: made by the store that needs it, at the kernel's rate",
    )
    cpu_preallocate: Literal["background", "wait", "off"] = Field(
        "background",
        description="make the whole CPU tier ahead of need: `background` (a thread makes it "
        "64 MiB at a time from the node's start, while it serves; a store that comes first "
        "waits for the chunk being made), `wait` (the node serves once it is made), `off` "
        "(made as stores need it, `cpu_spare_chunks` ahead). `background` and `wait` hold "
        "`cpu_bytes` of memory from start, never more; `true` and `false` mean `wait` and `off`",
    )
    shm: bool = Field(
        default_factory=lambda: sys.platform == "linux",
        description="the CPU tier in shared memory (memfd segments), which engines on this "
        "host map through the same-host socket (`docs/dataplane.md`); engines on a CUDA host "
        "register their mappings of it with CUDA, and a node with a GPU tier its own",
        json_schema_extra={"doc_default": "`true` on Linux"},
    )
    shm_socket: Path | None = Field(
        None,
        description="the same-host Unix socket (mode 0600)",
        json_schema_extra={"doc_default": "`sessioncache.sock` in the data dir"},
    )
    shm_trusted_tenants: list[str] = Field(
        default_factory=list,
        description="JSON list of the tenants served on the same-host socket: they map the "
        "whole CPU tier, every tenant's blocks (without API keys the one tenant is trusted)",
    )
    disk_bytes: int = Field(64 * GiB, ge=0, description="disk tier capacity; 0 leaves it out")
    disk_codec: Literal["raw", "lossless"] = Field(
        "raw",
        description="how the disk tier stores blocks: `raw`, or `lossless` (bit shuffle + LZ4, "
        "byte-exact; docs/codecs.md); a namespace's own `kv_codec` (an engine's choice, lossy "
        "ones included) comes first",
    )
    tenant_codecs: dict[str, Literal["raw", "lossless"]] = Field(
        default_factory=dict,
        description='JSON per tenant, its disk codec (`{"<tenant>": "lossless"}`), before '
        "`disk_codec`",
    )
    default_ttl_s: float = Field(
        3 * DAY_S, gt=0, description="TTL of blocks stored outside a session"
    )
    hash_seed: int = Field(
        0,
        ge=0,
        lt=1 << 64,
        description="the seed of every block id (the same on every node and client)",
    )
    promote_on_get: bool = Field(True, description="copy a lower-tier hit up into the first tier")
    max_lease_s: float = Field(3600.0, gt=0, description="the longest lease a lookup may take")

    # -- sessions
    agent_ttl_s: float = Field(3 * DAY_S, gt=0, description="sliding TTL of `agent` sessions")
    chat_ttl_s: float = Field(7 * DAY_S, gt=0, description="sliding TTL of `chat` sessions")
    session_kinds: dict[str, float] = Field(
        default_factory=dict, description="more session kinds, JSON name -> TTL seconds"
    )
    idle_timeout_s: float = Field(
        300.0, gt=0, description="idle time after which a session's pins are released"
    )
    pin_share: float = Field(
        0.5, ge=0, le=1, description="largest share of a tier's capacity that pins may hold"
    )
    sweep_interval_s: float = Field(60.0, gt=0, description="period of the background sweep")
    eviction_policy: Literal["forecast", "lru"] = Field(
        "forecast",
        description="`forecast`: the tail predicted to be read again last leaves first "
        "(sessions' finish reasons and rhythm, docs/sessions.md); `lru`: least recently used "
        "tail first (the policy before forecasts, for comparison and fallback)",
    )
    attribution_ring_blocks: int = Field(
        65_536,
        gt=0,
        description="miss attribution: ids remembered per tier after their last copy left",
    )
    attribution_sessions: int = Field(
        10_000, gt=0, description="miss attribution: sessions whose previous prompt is kept"
    )

    # -- catalog
    database_url: str | None = Field(
        None,
        description="catalog URL, e.g. `postgresql+psycopg://user@host/db`",
        json_schema_extra={"doc_default": "SQLite under the data dir"},
    )
    database_schema: str | None = Field(None, description="PostgreSQL schema of the catalog")
    migrate_on_start: bool = Field(
        True, description="run catalog migrations when the service starts"
    )
    catalog_flush_interval_s: float = Field(
        0.2, gt=0, description="period of the catalog's write-behind flush"
    )
    reconcile_verify: bool = Field(
        True, description="on start, read back disk files the catalog lacks"
    )

    # -- shared tier and fleet (Redis)
    redis_url: str | None = Field(
        None,
        description="shared tier and fleet index: `redis://host:port/db` or "
        "`redis+cluster://host:port`; unset: neither",
    )
    redis_bytes: int = Field(64 * GiB, gt=0, description="this node's budget in the shared tier")
    redis_prefix: str = Field(
        "sc:", min_length=1, description="prefix of every Redis key (one per deployment)"
    )
    redis_write_policy: Literal["write_through", "write_back"] = Field(
        "write_through",
        description="`write_through`: every stored block also goes to Redis; `write_back`: "
        "only blocks demoted from the last local tier do",
    )
    node_id: str = Field(
        default_factory=socket.gethostname,
        description="this node's name in the fleet index",
        json_schema_extra={"doc_default": "the host name"},
    )
    node_url: str | None = Field(
        None,
        description="where other nodes reach this one (advertised in the fleet index)",
        json_schema_extra={"doc_default": "`http://{host}:{port}`"},
    )
    fleet_ttl_s: float = Field(
        15.0, gt=0, description="heartbeat expiry of a node's fleet index entry"
    )

    # -- service
    host: str = Field("127.0.0.1", description="address `sessioncache serve` binds")
    port: int = Field(8080, ge=0, lt=65536, description="port `sessioncache serve` binds")
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description='JSON `{"<key>": "<tenant>"}`; empty runs open, loopback only',
        repr=False,  # secrets: never in a printed or logged Settings
    )
    http_max_connections: int = Field(
        4096,
        gt=0,
        description="most REST connections open at once, lowered to stay below the process's "
        "descriptor limit; at the cap a new connection evicts the one stalled longest (waiting "
        "for a request head or body), or is answered 503 when every one is busy",
    )
    http_tenant_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="share of `http_max_connections` one tenant's REST connections may hold, "
        "counted from their first request head (those without a known key count together); "
        "past it a request is answered 429 and its connection closed; `http_connections` in "
        "`tenant_limits` sets a tenant's count instead; unused without API keys",
    )
    http_head_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a REST connection that has not sent a whole request head this long after "
        "it opened, or after its previous response, is closed",
    )
    http_body_floor_s: float = Field(
        10.0,
        gt=0,
        description="grace a REST request body gets after its head before "
        "`http_body_min_bytes_per_s` applies; a body behind it is answered 408 and its "
        "connection closed",
    )
    http_body_min_bytes_per_s: int = Field(
        65_536,
        gt=0,
        description="least rate of a REST request body: t seconds after its head, at least "
        "(t - `http_body_floor_s`) times this many bytes of it have arrived",
    )
    http_keepalive_s: float = Field(
        5.0, gt=0, description="an idle REST connection is closed after this long"
    )
    max_body_bytes: int = Field(256 * MiB, gt=0, description="largest request body")
    tenant_upload_slots: int = Field(
        262_144,
        gt=0,
        description="most REST upload slots one tenant may hold open (one per missing block of "
        "each `POST /v1/store`); a store past it is refused whole with 429, and no tenant's "
        "store ever closes another's slots",
    )
    tenant_stream_connections: int = Field(
        32,
        gt=0,
        description="most authenticated block-stream (and same-host) connections of one tenant "
        "at once",
    )
    tenant_namespaces: int = Field(
        1024, gt=0, description="most namespaces (distinct roots) one tenant may use"
    )
    tenant_sessions: int = Field(
        65_536, gt=0, description="most sessions one tenant may hold open at once"
    )
    tenant_pin_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="largest share of each tier one tenant's pinned blocks (leases, session "
        "pins, same-host stagings together) may hold: a lease, a session pin or a staging "
        "past it takes the prefix that fits (a lease of which no block fits: 429); "
        "`pin_share` still bounds every tenant's session pins together",
    )
    tenant_limits: dict[str, dict[str, int | float]] = Field(
        default_factory=dict,
        description='JSON per tenant, any of its bounds: `{"<tenant>": {"upload_slots": n, '
        '"stream_connections": n, "inflight_bytes": n, "engines": n, "namespaces": n}}`; the '
        "others keep their `tenant_*` defaults",
    )
    tenant_inflight_bytes: int = Field(
        1 * GiB,
        gt=0,
        description="most bytes of request bodies one tenant's requests may hold in the node's "
        "receive buffers at once, over all its connections (REST uploads, stream stores); "
        "past it a request is refused with 429 `QuotaExceeded`",
    )
    max_json_bytes: int = Field(
        32 * MiB,
        gt=0,
        description="largest request body of every route but block uploads (JSON): 2M tokens "
        "of a lookup take 22 MB",
    )
    max_tokens: int = Field(2_000_000, gt=0, description="most tokens in one request")
    durable_uploads: bool = Field(
        False,
        description="make every store durable: answer only once its blocks are on disk "
        "(fsync-ed), as a store asking `durable` does; false: a store is answered once its "
        "first tier holds it (`durable: false`) and its disk copy follows (write-behind)",
    )
    write_behind_bytes: int = Field(
        4 * GiB,
        ge=0,
        description="bound of the write-behind queue (blocks of the memory tiers not on disk "
        "yet; the queue holds no copy of them): a store that would pass it waits; a crash "
        "loses at most this much of the stores answered `durable: false` (it loses the memory "
        "tiers anyway: the default is the CPU tier's); 0 turns write-behind off (blocks reach "
        "disk when evicted from memory)",
    )
    tenant_write_behind_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="largest share of `write_behind_bytes` one tenant's blocks may take: a "
        "tenant's flood stalls that tenant (the default of each tenant's "
        "`write_behind_share`, which `tenant_limits` may set)",
    )
    upload_ttl_s: float = Field(
        600.0, gt=0, description="how long the upload slots of a store stay open"
    )
    store_room_wait_s: float = Field(
        30.0,
        ge=0,
        description="longest a store waits for room in a full memory tier whose victims are "
        "waiting for the write-behind (queued, or being written to disk); past it the store "
        "copies a queued victim to disk itself or, with nothing evictable, answers the block "
        "`dropped`",
    )

    # -- admin dashboard (`/admin`)
    admin_token: SecretStr | None = Field(
        None,
        description="token of the `/admin` dashboard and of admin operations such as `POST "
        "/v1/gc` (separate from API keys); unset: both only when the service runs open",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="bearer token that opens the per-tenant and per-namespace series of "
        "`/metrics` (the admin token does too); without either, a node with API keys serves "
        "only the node-wide series (docs/metrics.md)",
    )
    metrics_top_namespaces: int = Field(
        20,
        ge=0,
        description="namespaces `/metrics` lists one by one, the most active (hit and miss "
        'tokens); the others are summed into one `namespace="other"` row',
    )
    prefill_tokens_per_s: float = Field(
        10000.0,
        gt=0,
        description="an engine's prefill rate, to turn hit tokens into GPU-seconds saved",
    )
    history_interval_s: float = Field(
        5.0, gt=0, description="period of the in-memory stats history behind the dashboard"
    )
    history_span_s: float = Field(
        3600.0, gt=0, description="how far back the in-memory stats history reaches"
    )

    # -- data plane (docs/dataplane.md)
    stream_enabled: bool = Field(
        True, description="serve the binary block stream beside the REST API"
    )
    stream_host: str = Field("127.0.0.1", description="address the block stream binds")
    stream_port: int = Field(
        8081, ge=0, lt=65536, description="port of the block stream; 0 picks a free one"
    )
    stream_advertise: str | None = Field(
        None,
        description="`host:port` that `GET /v1/dataplane` tells clients to connect to",
        json_schema_extra={"doc_default": "the bound address"},
    )
    stream_max_connections: int = Field(
        64, gt=0, description="most block-stream connections served at once"
    )
    stream_hello_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a block-stream connection that has not completed its HELLO this long after "
        "it opened is closed",
    )
    stream_max_unauthenticated: int = Field(
        16,
        gt=0,
        description="most block-stream connections at once that have not completed a HELLO; a "
        "new one past it, or past `stream_max_connections`, closes the oldest of them",
    )
    stream_max_ids: int = Field(16384, gt=0, description="most blocks in one block-stream request")
    stream_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest wait for the rest of a frame, or for a peer to take a block",
    )
    stream_idle_timeout_s: float = Field(
        0.0, ge=0, description="close a block-stream connection idle this long; 0: never"
    )

    # -- KV-aware routing (docs/routing.md)
    engines: list[EngineSetting] = Field(
        default_factory=list,
        description="JSON list of engines whose KV events the node follows from the start: "
        '`{"engine_id", "namespace": {...}, "endpoint", "replay_endpoint", "topic", '
        '"tenant"}` (no tenant: shared by every tenant)',
    )
    max_engines_per_tenant: int = Field(
        16,
        gt=0,
        description="most engines one tenant may register through `POST /v1/engines` (each is a "
        "socket the node keeps dialling, backing off to `engine_redial_max_s` while the "
        "endpoint is dead)",
    )
    engine_endpoint_prefixes: list[str] | None = Field(
        None,
        description="JSON list of the endpoint prefixes (`tcp://10.0.0.`, "
        "`ipc:///run/engines/`) at which a tenant may register engines when API keys are "
        "set; unset: `tcp://` at an IP address off this host only (docs/routing.md)",
    )
    tenant_cache_salts: dict[str, str] = Field(
        default_factory=dict,
        description='JSON `{"<tenant>": "<cache_salt>"}`: the vLLM `cache_salt` of each '
        "tenant's requests; with API keys, a chain a shared engine caches routes only for "
        "the tenant whose salt it carries (docs/routing.md)",
        repr=False,  # secrets: a tenant knowing another's salt could plant prefixes in its name
    )
    engine_stale_s: float = Field(
        300.0,
        gt=0,
        description="an engine silent this long (no KV event) is stale and scores nothing; so "
        "is one the node is behind on (a replay pending, messages queued)",
    )
    engine_replay_timeout_s: float = Field(
        2.0, gt=0, description="longest wait for an engine's replay socket to answer"
    )
    engine_replay_buffer: int = Field(
        10_000,
        gt=0,
        description="messages an engine's replay socket holds (vLLM's `buffer_steps`): a wider "
        "gap is not asked for, the engine's view starts afresh past it; also the most messages "
        "of one engine kept waiting while its replay is in flight",
    )
    engine_redial_max_s: float = Field(
        2.0,
        gt=0,
        description="longest wait between two dials of a dead engine endpoint; each (re)connect "
        "asks the engine's replay socket for what it missed",
    )
    route_medium_weights: dict[str, float] = Field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.25},
        description="JSON medium -> worth of one token an engine holds there, for `/v1/route`",
    )
    route_cache_weight: float = Field(
        0.25,
        ge=0,
        description="worth of one token held in sessioncache's own tiers, for `/v1/route`",
    )

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
    """The markdown table of every setting: variable, default, meaning (the description)."""
    prefix = Settings.model_config.get("env_prefix", "")
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
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
