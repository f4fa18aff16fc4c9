"""Path parameters, declared with the patterns the server enforces.

A block id in a path is matched by the router itself (the ``blockid`` convertor), not only
validated after routing: ``/v1/blocks/batch`` is then never a block id, so a request for a
method the batch path lacks is a 405 naming the batch path's methods (``Allow: POST``), and
the id's pattern is part of the OpenAPI description.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path
from starlette.convertors import Convertor, register_url_convertor

from sessioncache.sessions.manager import MAX_SESSION_ID_LEN, SESSION_ID_PATTERN

HEX_PATTERN = r"^[0-9a-f]{32}$"


class BlockIdConvertor(Convertor[str]):
    regex = "[0-9a-f]{32}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("blockid", BlockIdConvertor())

BlockIdPath = Annotated[
    str,
    Path(
        pattern=HEX_PATTERN,
        description="A block id: 32 lowercase hex digits.",
        examples=["978094f41daae8306d3c953a61392c71"],
    ),
]
SessionIdPath = Annotated[
    str, Path(min_length=1, max_length=MAX_SESSION_ID_LEN, pattern=SESSION_ID_PATTERN)
]
LeaseIdPath = Annotated[
    str, Path(pattern=HEX_PATTERN, description="A lease id from a lookup: 32 hex digits.")
]
