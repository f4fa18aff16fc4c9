"""Sessions on the data plane (SESSION, version 3): open, get, extend, finish and close over the
stream and the same-host socket answer what REST answers, a tenant reaches only its own
sessions, a connection of version 2 gets a readable refusal, and a session's turns run with no
REST API at all (the in-process node below has none)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest

from sessioncache.config import Settings
from sessioncache.connector import StreamClient, discover
from sessioncache.connector.samehost import SameHostClient
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import HEADER_SIZE, Op
from sessioncache.dataplane.samehost_server import SameHostServer, open_samehost_server
from sessioncache.dataplane.server import StreamServer
from sessioncache.dataplane.transport import TcpListener
from sessioncache.errors import (
    ErrorCode,
    FrameError,
    InvalidInput,
    ProtocolError,
    SessionNotFound,
)
from sessioncache.factory import open_node
from sessioncache.hashing import Namespace
from sessioncache.node import CacheNode
from tests.sessioncache.dataplane.conftest import (
    KEYS,
    assert_closed,
    read_exactly,
)
from tests.support.servers import Server

NS = Namespace("session-ops-model", block_tokens=4, kv_dtype="bf16", kv_layout="x")
BLOCK = 4096
API = {"key-a": "alice", "key-b": "bob"}

Connect = Callable[[str], StreamClient]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheNode]:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("session-ops") / "data",
        cpu_bytes=32 << 20,
        disk_bytes=0,
        api_keys=API,
        shm_trusted_tenants=["alice", "bob"],
    )
    node = open_node(settings, start=False)
    yield node
    node.close()


@pytest.fixture(scope="module")
def stream_server(node: CacheNode) -> Iterator[StreamServer]:
    server = StreamServer(node, TcpListener("127.0.0.1", 0)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def samehost_server(node: CacheNode) -> Iterator[SameHostServer]:
    server = open_samehost_server(node, node.settings)
    if server is None:
        pytest.skip("no shared-memory CPU tier on this platform")
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["stream", "same_host"])
def connect(request: pytest.FixtureRequest, stream_server: StreamServer) -> Iterator[Connect]:
    """Connects a client of the carrier with an API key, straight to its address."""
    clients: list[StreamClient] = []

    def make(key: str) -> StreamClient:
        if request.param == "stream":
            client = StreamClient.connect(stream_server.address, api_key=key)
        else:
            server = request.getfixturevalue("samehost_server")
            client = SameHostClient.connect(server.address, api_key=key)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_each_session_operation_answers_as_rest_does(connect: Connect):
    alice = connect("key-a")
    assert alice.version == frames.VERSION >= frames.SESSION_VERSION
    opened = alice.open_session("ops-1", kind="chat", ttl_s=120.0)
    assert (opened.id, opened.tenant, opened.kind, opened.ttl_s) == ("ops-1", "alice", "chat", 120)
    assert opened.head is None and not opened.pinned
    again = alice.open_session("ops-1")  # the open one of that id
    assert (again.id, again.kind, again.created) == ("ops-1", "chat", opened.created)
    got = alice.get_session("ops-1")
    assert got.attribution is not None and got.attribution.lookups == 0
    extended = alice.extend_session("ops-1", 600.0)
    assert extended.ttl_s == 600 and extended.expires_at >= opened.expires_at
    assert alice.finish_session("ops-1", "tool_use").id == "ops-1"
    assert alice.close_session("ops-1") is None
    with pytest.raises(SessionNotFound):
        alice.get_session("ops-1")
    fresh = alice.open_session()  # a new id of the node's
    assert fresh.kind == "agent" and len(fresh.id) == 32
    with pytest.raises(InvalidInput, match="finish_reason"):
        alice.finish_session(fresh.id, "bored")
    with pytest.raises(InvalidInput, match="kind"):
        alice.open_session(kind="nope")
    assert alice.resolve(NS)  # the connection carries on after refusals
    alice.close_session(fresh.id)


def test_a_tenant_cannot_touch_another_tenants_session(connect: Connect, node: CacheNode):
    alice, bob = connect("key-a"), connect("key-b")
    alice.open_session("mine", ttl_s=300.0)
    for call in (
        lambda: bob.get_session("mine"),
        lambda: bob.extend_session("mine", 5.0),
        lambda: bob.finish_session("mine", "stop"),
        lambda: bob.close_session("mine"),
    ):
        with pytest.raises(SessionNotFound):
            call()
    kept = alice.get_session("mine")
    assert kept.ttl_s == 300 and kept.tenant == "alice"
    # the same id is another session for bob
    assert bob.open_session("mine").tenant == "bob"
    bob.close_session("mine")
    assert alice.get_session("mine").tenant == "alice"
    alice.close_session("mine")
    assert node.sessions.count() == 0


def test_a_sessions_turns_need_no_rest_api(connect: Connect, node: CacheNode):
    # The node of this module has no REST app at all: every call below is the data plane's.
    client = connect("key-a")
    root = client.resolve(NS)
    sid = client.open_session(kind="agent").id
    rng = np.random.default_rng(int(sid, 16))  # a prompt of its own on each carrier
    first = rng.integers(0, 50_000, 3 * NS.block_tokens).astype(np.uint32)
    payloads = [np.full(BLOCK, i, np.uint8) for i in range(3)]
    ack = client.store(root, first, payloads, session_id=sid)
    assert ack.kept == 3
    session = client.get_session(sid)
    assert session.head == ack.hashes[-1] and session.pinned
    # the next turn: the prompt grew; look it up in the session, store the rest
    more = rng.integers(0, 50_000, 2 * NS.block_tokens).astype(np.uint32)
    prompt = np.concatenate([first, more])
    ids = client.block_hashes(root, prompt)
    found = client.lookup(root, ids, lease_ms=5000, session_id=sid)
    assert found.matched == 3
    client.release(found)
    extra = [np.full(BLOCK, 9, np.uint8)] * 2
    client.store(root, more, extra, parent=ids[2], session_id=sid, finish_reason="end_turn")
    after = client.get_session(sid)
    assert after.head == ids[-1] and after.pinned and after.attribution is not None
    assert after.attribution.hit_tokens == 3 * NS.block_tokens
    assert client.finish_session(sid, "stop").head == ids[-1]
    client.close_session(sid)
    with pytest.raises(SessionNotFound):
        client.get_session(sid)
    assert not node.sessions.pinned_sessions()


def test_a_client_on_a_version_2_connection_reads_that_the_node_is_too_old(
    node: CacheNode, stream_server: StreamServer
):
    old = StreamServer(node, TcpListener("127.0.0.1", 0))
    old.versions = frozenset({frames.FRAME_VERSION})  # a node of before SESSION
    old.start()
    try:
        with StreamClient.connect(old.address, api_key="key-a") as client:
            assert client.version == 2
            with pytest.raises(ProtocolError, match=r"version 2.*upgrade"):
                client.open_session("s")
            assert client.resolve(NS)  # nothing was sent: the connection is fine
    finally:
        old.stop()


def raw_v2_hello(sock: socket.socket, key: str) -> None:
    sock.sendall(frames.encode_hello(1, frames.Hello(key, "v2", (2,))))
    header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
    body = read_exactly(sock, header.body_len)
    assert header.opcode == Op.HELLO_OK and frames.decode_hello_ok(body).version == 2


def test_a_session_request_on_a_version_2_connection_is_refused_readably(
    stream_server: StreamServer,
):
    host, _, port = stream_server.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        raw_v2_hello(sock, "key-a")
        sock.sendall(frames.encode_session_call(2, frames.SessionCall("open", "s")))
        header = frames.decode_header(read_exactly(sock, HEADER_SIZE), requests=False)
        assert header.opcode == Op.ERROR
        error = frames.decode_error(read_exactly(sock, header.body_len), header.flags)
        assert error.code == ErrorCode.MALFORMED and error.closing
        assert "SESSION is a request of version 3" in error.message
        assert "speaks version 2" in error.message
        assert_closed(sock)


# -- the codec ---------------------------------------------------------------------------------


def test_session_frames_round_trip_in_version_3():
    call = frames.SessionCall("open", "s-1", "chat", 12.5, "parent-1")
    frame = frames.encode_session_call(7, call)
    assert frame[4] == frames.SESSION_VERSION
    header = frames.decode_header(frame[:HEADER_SIZE], requests=True)
    assert (header.opcode, header.request_id) == (Op.SESSION, 7)
    frames.check_body(header, frames.Limits())
    assert frames.decode_session_call(frame[HEADER_SIZE:]) == call
    ok = frames.encode_session_ok(7, {"id": "s-1", "pinned": False})
    assert ok[4] == frames.SESSION_VERSION
    assert frames.decode_session_ok(ok[HEADER_SIZE:]) == {"id": "s-1", "pinned": False}
    assert frames.decode_session_ok(frames.encode_session_ok(7, None)[HEADER_SIZE:]) == {}
    # every other frame keeps version 2's byte, which a node of version 2 reads
    assert frames.encode_hello(1, frames.Hello(None))[4] == frames.FRAME_VERSION == 2
    assert frames.Hello(None).versions == (2, 3, 4)


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        (b"not json", FrameError, "not JSON"),
        (b"[1]", FrameError, "not a JSON object"),
        (b'{"verb":"sing"}', InvalidInput, "unknown verb"),
        (b'{"verb":"get"}', InvalidInput, "session_id is required"),
        (b'{"verb":"finish","session_id":"s"}', InvalidInput, "finish_reason is required"),
        (b'{"verb":"open","ttl_s":"long"}', InvalidInput, "ttl_s must be a number"),
        (b'{"verb":"open","ttl_s":true}', InvalidInput, "ttl_s must be a number"),
        (b'{"verb":"open","kind":3}', InvalidInput, "kind must be a string"),
        (b'{"verb":"open","owner":"x"}', InvalidInput, "unknown fields"),
    ],
)
def test_bad_session_bodies_are_refused(body: bytes, error: type[Exception], match: str):
    with pytest.raises(error, match=match):
        frames.decode_session_call(body)


def test_a_session_body_past_the_json_limit_is_refused_from_its_header():
    limits = frames.Limits()
    header = frames.Header(Op.SESSION, 0, 1, limits.max_json + 1)
    with pytest.raises(FrameError, match="exceeds the limit"):
        frames.check_body(header, limits)


# -- REST and the data plane on one served node ------------------------------------------------


def rest_call(server: Server, method: str, path: str, key: str, **kw: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=10, **kw)  # type: ignore[arg-type]


def test_rest_and_the_stream_are_one_set_of_sessions(auth_server: Server):
    acme, globex = "key-acme", "key-globex"
    assert KEYS[acme] == "acme"
    opened = rest_call(auth_server, "POST", "/v1/sessions", acme, json={"session_id": "both"})
    assert opened.status_code == 201 and opened.json()["tenant"] == "acme"
    address = discover(auth_server.url, api_key=acme)
    with StreamClient.connect(address, api_key=acme) as stream:
        got = stream.get_session("both")
        body = rest_call(auth_server, "GET", "/v1/sessions/both", acme).json()
        assert (body["expires_at"], body["kind"]) == (got.expires_at, got.kind)
        assert stream.extend_session("both", 50.0).ttl_s == 50
    assert rest_call(auth_server, "GET", "/v1/sessions/both", acme).json()["ttl_s"] == 50
    # another tenant: 404 over REST, SessionNotFound over the stream
    for method, path, kw in [
        ("GET", "/v1/sessions/both", {}),
        ("POST", "/v1/sessions/both/extend", {"json": {}}),
        ("POST", "/v1/sessions/both/finish", {"json": {"finish_reason": "stop"}}),
        ("DELETE", "/v1/sessions/both", {}),
    ]:
        reply = rest_call(auth_server, method, path, globex, **kw)
        assert reply.status_code == 404, (method, path, reply.text)
    with StreamClient.connect(address, api_key=globex) as other, pytest.raises(SessionNotFound):
        other.close_session("both")
    finished = rest_call(
        auth_server, "POST", "/v1/sessions/both/finish", acme, json={"finish_reason": "stop"}
    )
    assert finished.status_code == 200 and finished.json()["last_finish"] is not None
    assert rest_call(auth_server, "DELETE", "/v1/sessions/both", acme).status_code == 204
    with StreamClient.connect(address, api_key=acme) as stream, pytest.raises(SessionNotFound):
        stream.get_session("both")
