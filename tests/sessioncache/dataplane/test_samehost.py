"""The same-host path against a real node process: payloads through shared memory, byte for
byte; the lease rule that keeps torn blocks out; checksums at commit; concurrent writers and
readers; the socket's access rules (credentials, trusted tenants, tenant isolation, uid)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from sessioncache.connector.samehost import SameHostClient, reading
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op, StoreHead
from sessioncache.errors import AuthRefused, ChecksumMismatch, InvalidInput, LeaseLost
from sessioncache.hashing import tokens_to_le_bytes
from sessioncache.status import BlockStatus
from tests.sessioncache.dataplane.conftest import (
    BLOCK,
    NS,
    pattern,
    raw_connect,
    raw_hello,
    read_frame,
    rest,
    tokens,
    wait_until,
)
from tests.support.servers import Server, start_server

KEYS = {"key-acme": "acme", "key-globex": "globex", "key-umbrella": "umbrella"}
TRUSTED = ["acme", "globex"]


@pytest.fixture(scope="module")
def shm_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("samehost-auth") / "data",
        {
            "SESSIONCACHE_API_KEYS": json.dumps(KEYS),
            "SESSIONCACHE_SHM_TRUSTED_TENANTS": json.dumps(TRUSTED),
        },
    )
    yield server
    server.stop()


def socket_path(server: Server, key: str | None = None) -> str:
    path = rest(server, "/v1/dataplane", key)["same_host"]
    assert isinstance(path, str)
    return path


def connect(server: Server, key: str | None = None) -> SameHostClient:
    return SameHostClient.connect(socket_path(server, key), api_key=key, timeout=30)


def cpu_used(server: Server, key: str | None = None) -> int:
    tiers = rest(server, "/v1/stats", key)["tiers"]
    return int(next(t["used_bytes"] for t in tiers if t["name"] == "cpu"))


def test_the_socket_is_private_to_the_nodes_user(open_server: Server):
    path = socket_path(open_server)
    assert path == str(open_server.data_dir / "sessioncache.sock")
    info = os.stat(path)
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()


def test_store_and_load_are_byte_exact_through_shared_memory(open_server: Server):
    with connect(open_server) as client:
        root = client.resolve(NS)
        toks = tokens(1, 6)
        ids = client.block_hashes(root, toks)
        data = [pattern(h) for h in ids]
        payloads = [
            data[0],
            torch.from_numpy(data[1].copy()).view(torch.float16),  # any dtype: its bytes
            bytearray(data[2].tobytes()),
            memoryview(data[3].tobytes()),
            data[4].tobytes(),
            torch.from_numpy(data[5].copy()),
        ]
        ack = client.store(root, toks, payloads, durable=True)  # answered once on disk
        assert ack.status == ["stored"] * 6 and ack.hashes == ids and ack.durable
        assert client.store(root, toks, data).status == ["present"] * 6

        found = client.locate(root, [*ids, b"\x00" * 16], lease_ms=10_000)
        assert found.matched == 6 and found.located == 6 and found.hashes == ids
        assert rest(open_server, "/v1/stats")["leases"] == 1
        for slot, block in zip(found.slots, data, strict=True):
            assert slot.nbytes == BLOCK and slot.checksum == xxhash.xxh3_64_intdigest(block)
        out: list[object] = [
            np.zeros(BLOCK, np.uint8),
            torch.zeros(BLOCK // 2, dtype=torch.float16),
            bytearray(BLOCK),
            np.zeros(BLOCK // 4, np.float32),
            torch.zeros(BLOCK, dtype=torch.uint8).pin_memory()
            if torch.cuda.is_available()
            else torch.zeros(BLOCK, dtype=torch.uint8),
            np.zeros(BLOCK, np.uint8),
            np.zeros(BLOCK, np.uint8),  # past the located run: untouched
        ]
        assert client.load_into(found, out, verify=True) == [True] * 6 + [False]
        for buf, block in zip(out[:6], data, strict=True):
            raw = buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else bytes(buf)  # type: ignore[arg-type]
            assert raw == block.tobytes()
        assert rest(open_server, "/v1/stats")["leases"] == 0  # released by the load

        # published in the node: the REST API and the TCP stream read the same bytes
        reply = rest(open_server, "/v1/whoami")
        assert reply["tenant"] == "default"
        assert client.load(client.locate(root, ids[:2])) == [d.tobytes() for d in data[:2]]


def test_reading_in_place_gives_the_slots_and_releases_the_lease(open_server: Server):
    with connect(open_server) as client:
        root = client.resolve(NS)
        toks = tokens(31, 3)
        ids = client.block_hashes(root, toks)
        client.store(root, toks, [pattern(h) for h in ids])
        found = client.locate(root, ids, lease_ms=10_000)
        with reading(client, found) as views:
            assert [v.tobytes() for v in views] == [pattern(h).tobytes() for h in ids]
            assert not views[0].flags.writeable  # the node's published memory: read-only
        assert rest(open_server, "/v1/stats")["leases"] == 0  # released on exit
        found = client.locate(root, ids, lease_ms=150)
        with pytest.raises(LeaseLost), reading(client, found):
            time.sleep(0.4)  # the copies "took" longer than the lease: they may be torn


def test_a_load_whose_lease_ran_out_is_discarded(open_server: Server):
    with connect(open_server) as client:
        root = client.resolve(NS)
        toks = tokens(2, 3)
        ids = client.block_hashes(root, toks)
        client.store(root, toks, [pattern(h) for h in ids])
        out = [np.zeros(BLOCK, np.uint8) for _ in ids]
        found = client.locate(root, ids, lease_ms=150)
        time.sleep(0.4)  # the copy "took" longer than the lease: its slots may be reused
        with pytest.raises(LeaseLost):
            client.load_into(found, out)
        found = client.locate(root, ids, lease_ms=150)
        time.sleep(0.4)
        with pytest.raises(LeaseLost):  # kept lease: judged by the client's clock
            client.load_into(found, out, release=False)
        assert not client.release_checked(found)  # and the node agrees
        found = client.locate(root, ids, lease_ms=10_000)
        assert client.load_into(found, out, verify=True) == [True] * 3
    wait_until(lambda: rest(open_server, "/v1/stats")["leases"] == 0)


def test_a_slot_that_does_not_hold_its_checksum_is_rejected(open_server: Server):
    used = cpu_used(open_server)
    with connect(open_server) as client:
        root = client.resolve(NS)
        toks = tokens(3, 3)
        ids = client.block_hashes(root, toks)
        head = StoreHead(root, None, NS.block_tokens, 3, BLOCK)
        body = client._c.call(
            Op.STAGE, lambda rid: frames.encode_stage(rid, head, tokens_to_le_bytes(toks))
        )
        staged = frames.decode_stage_ok(body, BLOCK)
        assert staged.ids == ids and staged.status == [BlockStatus.STORED] * 3
        assert cpu_used(open_server) == used + 3 * BLOCK  # reserved
        client._maps.ensure(s.segment for s in staged.slots if s is not None)
        sums = []
        for i, (block_id, slot) in enumerate(zip(ids, staged.slots, strict=True)):
            assert slot is not None
            np.copyto(client._maps.view(slot), pattern(block_id))
            sums.append(xxhash.xxh3_64_intdigest(pattern(block_id)))
            if i == 1:
                client._maps.view(slot)[100] ^= 0xFF  # a torn write
        # nothing is visible before the commit
        assert client.locate(root, ids).matched == 0
        commit = frames.Commit(staged.staging, 0, [BLOCK] * 3, sums)
        body = client._c.call(Op.COMMIT, lambda rid: frames.encode_commit(rid, commit))
        ok = frames.decode_commit_ok(body)
        assert ok.status == [BlockStatus.STORED, BlockStatus.REJECTED, BlockStatus.DROPPED]
        assert client.locate(root, ids).matched == 1
        assert cpu_used(open_server) == used + BLOCK
        with pytest.raises(Exception, match="no open staging"):
            client._c.call(Op.COMMIT, lambda rid: frames.encode_commit(rid, commit))


def test_the_tcp_stream_refuses_the_same_host_ops(open_server: Server):
    sock = raw_connect(open_server)
    with sock:
        raw_hello(sock)
        sock.sendall(frames.encode_segments(7, [1]))
        header, body = read_frame(sock)
        assert header.opcode == Op.ERROR
        error = frames.decode_error(body, header.flags)
        assert "same-host Unix socket only" in error.message and not error.closing
        sock.sendall(frames.encode_resolve(8, NS))  # the connection goes on
        assert read_frame(sock)[0].opcode == Op.RESOLVE_OK


def test_concurrent_stores_and_loads_never_use_a_torn_block(open_server: Server):
    """Writers store the same chains at once and churn the CPU tier (64 MiB: slots are
    evicted and reused); readers load with short leases and verify every block. A load either
    gets the exact bytes or is discarded (``LeaseLost``); never a torn block."""
    chains = [(100 + c, 8) for c in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"loaded": 0, "lost": 0, "stored": 0}
    lock = threading.Lock()

    def writer(w: int) -> None:
        try:
            with connect(open_server) as client:
                root = client.resolve(NS)
                round_ = 0
                while not stop.is_set():
                    for seed, blocks in chains:  # the shared chains, by every writer
                        toks = tokens(seed, blocks)
                        ids = client.block_hashes(root, toks)
                        client.store(root, toks, [pattern(h) for h in ids])
                    # fresh chains that push others out of the CPU tier
                    toks = tokens(10_000 + 1000 * w + round_, 64)
                    ids = client.block_hashes(root, toks)
                    ack = client.store(root, toks, [pattern(h) for h in ids])
                    with lock:
                        counts["stored"] += ack.stored
                    round_ += 1
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            with connect(open_server) as client:
                root = client.resolve(NS)
                out = np.zeros((8, BLOCK), np.uint8)
                while not stop.is_set():
                    for seed, blocks in chains:
                        ids = client.block_hashes(root, tokens(seed, blocks))
                        found = client.locate(root, ids, lease_ms=20)
                        try:
                            client.load_into(found, list(out[: found.located]), verify=True)
                        except LeaseLost:
                            with lock:
                                counts["lost"] += 1
                            continue
                        for h, row in zip(found.hashes, out, strict=False):
                            assert np.array_equal(row, pattern(h)), "a torn block was used"
                        with lock:
                            counts["loaded"] += found.located
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    assert not [e for e in errors if isinstance(e, ChecksumMismatch)], errors
    assert not errors, errors
    assert counts["loaded"] > 0 and counts["stored"] > 64
    wait_until(lambda: rest(open_server, "/v1/stats")["leases"] == 0)


# -- access ------------------------------------------------------------------------------


def test_wrong_credentials_are_refused(shm_auth_server: Server):
    path = socket_path(shm_auth_server, "key-acme")
    for key in (None, "key-wrong"):
        with pytest.raises(AuthRefused):
            SameHostClient.connect(path, api_key=key)


def test_an_untrusted_tenant_is_refused(shm_auth_server: Server):
    path = socket_path(shm_auth_server, "key-umbrella")
    with pytest.raises(AuthRefused, match="not trusted"):
        SameHostClient.connect(path, api_key="key-umbrella")


def test_a_tenant_cannot_read_another_tenants_blocks(shm_auth_server: Server):
    with (
        connect(shm_auth_server, "key-acme") as acme,
        connect(shm_auth_server, "key-globex") as globex,
    ):
        root = acme.resolve(NS)
        toks = tokens(5, 4)
        ids = acme.block_hashes(root, toks)
        assert acme.store(root, toks, [pattern(h) for h in ids]).stored == 4
        assert acme.locate(root, ids).located == 4
        theirs = globex.resolve(NS)
        assert theirs != root  # the tenant salt
        found = globex.locate(theirs, ids)  # acme's ids under globex's root: plain misses
        assert found.matched == 0 and found.located == 0 and found.lease is None
        with pytest.raises(InvalidInput):
            globex.locate(root, ids)  # a root globex never resolved
    wait_until(lambda: rest(shm_auth_server, "/v1/stats", "key-acme")["leases"] == 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_open_mode_serves_the_nodes_own_user_only(open_server: Server):
    path = socket_path(open_server)
    code = (
        "import os, socket, sys\n"
        "from sessioncache.dataplane import frames\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    print('denied'); sys.exit(0)\n"
        "try:\n"
        "    s.sendall(frames.encode_hello(1, frames.Hello(None, 'x')))\n"
        "except BrokenPipeError:\n"
        "    pass  # refused before it spoke: the ERROR frame is there to read\n"
        "head = frames.decode_header(s.recv(24, socket.MSG_WAITALL), requests=False)\n"
        "body = s.recv(head.body_len, socket.MSG_WAITALL)\n"
        "print(head.opcode.name, frames.decode_error(body, head.flags).message)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}

    def as_nobody(where: str) -> str:
        out = subprocess.run(
            [sys.executable, "-c", code, where], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    # a hard link where another user can reach it (the data dir is private)
    public = Path("/tmp") / f"sessioncache-test-{os.getpid()}.sock"
    os.link(path, public)
    try:
        assert as_nobody(str(public)) == "denied"  # mode 0600: another user cannot connect
        os.chmod(public, 0o666)
        # and when it can, SO_PEERCRED says it is not the node's user
        answer = as_nobody(str(public))
    finally:
        os.chmod(path, 0o600)
        public.unlink()
    assert answer.startswith("ERROR") and "own uid" in answer


def test_the_same_host_client_needs_a_unix_socket(open_server: Server):
    address = rest(open_server, "/v1/dataplane")["stream"]
    host, _, port = address.rpartition(":")
    from sessioncache.dataplane.transport import SocketTransport

    transport = SocketTransport(socket.create_connection((host, int(port))))
    with pytest.raises(InvalidInput, match="Unix socket"):
        SameHostClient(transport)
