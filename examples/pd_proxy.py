"""A prefill/decode proxy for two vLLM OpenAI servers sharing a sessioncache node
(docs/vllm.md, "Prefill/decode disaggregation"), as vLLM's own P/D examples route:

    python -m examples.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Each completion or chat completion is sent to the prefill server (``kv_producer``) with one
output token, which computes the prompt and saves its blocks to the node when it answers;
then, unchanged, to the decode server (``kv_consumer``), which loads them from the node and
decodes. Its answer is the client's. No KV goes through the proxy, and no handle either: the
request's tokens find the blocks (and ``kv_transfer_params``, a session's id, goes to both).
Streaming answers are passed through as the decode server sends them.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def make_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None)

    async def route(request: Request, path: str) -> Response:
        body: dict[str, Any] = await request.json()
        first = {**body, "max_tokens": 1, "stream": False}
        first.pop("max_completion_tokens", None)
        first.pop("stream_options", None)
        answer = await client.post(f"{prefill}{path}", json=first)
        if answer.status_code != 200:  # the prefill's refusal is the client's answer
            return JSONResponse(answer.json(), status_code=answer.status_code)
        if not body.get("stream"):
            done = await client.post(f"{decode}{path}", json=body)
            return JSONResponse(done.json(), status_code=done.status_code)

        async def chunks() -> AsyncIterator[bytes]:
            async with client.stream("POST", f"{decode}{path}", json=body) as decoding:
                async for chunk in decoding.aiter_bytes():
                    yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        for server in (prefill, decode):
            if (await client.get(f"{server}/health")).status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", required=True, help="the kv_producer server's URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer server's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(make_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
