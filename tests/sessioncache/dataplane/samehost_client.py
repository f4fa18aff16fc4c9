"""A same-host client that stops in the middle of a transfer, to be killed there with
``kill -9`` by tests/sessioncache/dataplane/test_samehost_kill.py.

    python samehost_client.py load  SOCKET SEED BLOCKS
        stores the chain of SEED's tokens, locates it with a long lease, copies half of it
        out of shared memory, then stalls (holding the lease)
    python samehost_client.py stage SOCKET SEED BLOCKS
        stages the chain of SEED's tokens (slots reserved), fills half of the slots, commits
        nothing, then stalls
    python samehost_client.py commit-half SOCKET SEED BLOCKS
        stages the chain, fills and commits its first half (published), then writes the
        second half's slots only half way (torn blocks) and stalls before their COMMIT
    python samehost_client.py stage-keyed SOCKET SEED BLOCKS
        the same as ``stage`` for keyed blocks (one key per block, from SEED)

Prints ``stalled`` once it stalls; payloads are ``conftest.pattern`` of each id.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import xxhash

from sessioncache.connector.payloads import key_bytes
from sessioncache.connector.samehost import SameHostClient
from sessioncache.dataplane import frames
from sessioncache.dataplane.frames import Op, StoreHead
from sessioncache.hashing import block_key, tokens_to_le_bytes
from sessioncache.status import BlockStatus
from tests.sessioncache.dataplane.conftest import BLOCK, NS, pattern, tokens


def main() -> None:
    mode, path, seed, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = SameHostClient.connect(path)
    root = client.resolve(NS)
    toks = tokens(seed, blocks)
    ids = client.block_hashes(root, toks)
    if mode == "load":
        ack = client.store(root, toks, [pattern(h) for h in ids])
        assert ack.stored + ack.tally("present") == blocks, ack
        found = client.locate(root, ids, lease_ms=600_000)
        assert found.located == blocks
        out = np.empty((blocks, BLOCK), np.uint8)
        for i in range(blocks // 2):
            np.copyto(out[i], client._maps.view(found.slots[i]))
    else:
        if mode == "stage-keyed":
            keys = [block_key(f"killed-{seed}-{i}") for i in range(blocks)]
            ids = client.key_ids(root, keys)
            head = StoreHead(root, None, frames.KEY_WORDS, blocks, BLOCK, 0, True, False)
            section = key_bytes(keys)
        else:
            head = StoreHead(root, None, NS.block_tokens, blocks, BLOCK)
            section = tokens_to_le_bytes(toks)
        body = client._c.call(Op.STAGE, lambda rid: frames.encode_stage(rid, head, section))
        staged = frames.decode_stage_ok(body, BLOCK)
        assert staged.status == [BlockStatus.STORED] * blocks, staged.status
        assert staged.ids == ids
        client._maps.ensure(s.segment for s in staged.slots if s is not None)
        half = blocks // 2
        for block_id, slot in list(zip(ids, staged.slots, strict=True))[:half]:
            assert slot is not None
            np.copyto(client._maps.view(slot), pattern(block_id))
        if mode == "commit-half":
            sums = [xxhash.xxh3_64_intdigest(pattern(h)) for h in ids[:half]]
            commit = frames.Commit(staged.staging, 0, [BLOCK] * half, sums)
            body = client._c.call(Op.COMMIT, lambda rid: frames.encode_commit(rid, commit))
            assert frames.decode_commit_ok(body).status == [BlockStatus.STORED] * half
            for block_id, slot in list(zip(ids, staged.slots, strict=True))[half:]:
                assert slot is not None
                client._maps.view(slot)[: BLOCK // 2] = pattern(block_id)[: BLOCK // 2]
    print("stalled", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
