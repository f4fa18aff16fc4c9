"""No client changes a published block: alice, trusted on the same-host socket (she maps the
whole CPU tier), tries every way into its segments, over bob's block and over her own after
COMMIT; every reader then gets the stored bytes. Nor can she reach bob's staging memory."""

from __future__ import annotations

import ctypes
import mmap
import os

import httpx
import numpy as np

from sessioncache.connector import SameHostClient, StreamClient
from sessioncache.dataplane.staging import STAGING_SEGMENT_BASE
from sessioncache.hashing import Namespace
from tests.security.conftest import ALICE, BOB, NodeFactory, client

SIZE = 64 * 1024
NS = Namespace("published", 16, "u8", "x")
_libc = ctypes.CDLL(None, use_errno=True)


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def scribble(alice: SameHostClient, segments: list[int]) -> list[str]:
    """Every way alice has to write into ``segments``; what got through."""
    through: list[str] = []
    ok, fds = alice._maps._call(segments)
    try:
        for segment, fd in zip(ok.sent, fds, strict=True):
            size = os.fstat(fd).st_size
            try:
                mmap.mmap(fd, size)[:16] = b"\xff" * 16  # shared, writable
                through.append(f"mmap {segment}")
            except PermissionError:
                pass
            try:
                os.pwrite(fd, b"\xff" * 16, 0)
                through.append(f"pwrite {segment}")
            except PermissionError:
                pass
            reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                mmap.mmap(reopened, size)[:16] = b"\xff" * 16
                through.append(f"reopen {segment}")
            except PermissionError:
                pass
            finally:
                os.close(reopened)
            ro = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), np.uint8)
            if _libc.mprotect(ctypes.c_void_p(ro.ctypes.data), ctypes.c_size_t(size), 3) == 0:
                through.append(f"mprotect {segment}")
    finally:
        for fd in fds:
            os.close(fd)
    for segment in segments:  # the client's own mappings
        view = alice._maps._segments.get(segment)
        if view is None:
            continue
        try:
            view[:] = 0xFF
            through.append(f"client map {segment}")
        except ValueError:
            pass
    return through


def test_no_client_changes_a_published_block(guarded_node: NodeFactory) -> None:
    node = guarded_node()
    bob_tokens, alice_tokens = list(range(16)), list(range(100, 116))
    with (
        StreamClient.discover(node.url, api_key="key-bob", timeout=30) as bob,
        SameHostClient.discover(node.url, api_key="key-alice", timeout=30) as alice,
        client(node, BOB) as bob_rest,
        client(node, ALICE) as alice_rest,
    ):
        bob_root = bob.resolve(NS)
        assert bob.store(bob_root, bob_tokens, [payload(1)]).kept == 1
        [bob_id] = bob.block_hashes(bob_root, bob_tokens)
        alice_root = alice.resolve(NS)
        assert alice.store(alice_root, alice_tokens, [payload(2)]).kept == 1  # staged, COMMIT
        [alice_id] = alice.block_hashes(alice_root, alice_tokens)
        found = alice.locate(alice_root, [alice_id], lease_ms=5000)
        assert found.located == 1
        alice.release(found.lease)

        live, _ = alice._maps._call([])
        published = sorted(s for s in set(live.live) if s < STAGING_SEGMENT_BASE)
        assert published
        through = scribble(alice, published)
        assert through == [], f"alice wrote into published memory: {through}"

        # every reader gets the stored bytes
        assert bob_rest.get(f"/v1/blocks/{bob_id.hex()}").content == payload(1).tobytes()
        got = alice_rest.get(f"/v1/blocks/{alice_id.hex()}").content
        assert got == payload(2).tobytes()
        batch = bob_rest.post("/v1/blocks/batch", json={"hashes": [bob_id.hex()]})
        assert batch.status_code == 200 and payload(1).tobytes() in batch.content
        out = [np.empty(SIZE, np.uint8)]
        assert bob.load_into([bob_id], out) == [True]
        assert bytes(out[0]) == payload(1).tobytes()
        again = alice.locate(alice_root, [alice_id], lease_ms=5000)
        alice.load_into(again, out, verify=True)
        assert bytes(out[0]) == payload(2).tobytes()
        metrics = httpx.get(node.url + "/metrics", headers=BOB).text
        assert "sessioncache_corrupt_reads_total 0.0" in metrics


def test_a_connection_never_gets_another_connections_staging_memory(
    guarded_node: NodeFactory,
) -> None:
    node = guarded_node()
    with (
        SameHostClient.discover(node.url, api_key="key-alice", timeout=30) as first,
        SameHostClient.discover(node.url, api_key="key-alice", timeout=30) as second,
    ):
        root = first.resolve(NS)
        assert first.store(root, list(range(16)), [payload(3)]).kept == 1
        own = [s for s in first.mapped_segments if s >= STAGING_SEGMENT_BASE]
        assert own, "the first connection staged in memory of its own"
        ok, fds = second._maps._call(own)
        for fd in fds:
            os.close(fd)
        assert ok.sent == [] and not set(own) & set(ok.live)
