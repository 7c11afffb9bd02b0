"""A plain pass-through proxy: the reference `bench_peers.py` measures a gateway against.

What the least a Python OpenAI proxy can do costs: Starlette, one shared httpx.AsyncClient (pooled
keep-alive connections), the request body forwarded as it came, the answer sent back unchanged;
a streamed answer is streamed back as its bytes arrive. No auth, no parsing, no accounting.
Served by uvicorn in one process with uvloop and httptools, as our services are.

    .venv/bin/python bench/plain_proxy.py --port 8100 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

#: request headers passed on to the upstream (the rest describe the client's own connection)
FORWARDED = ("authorization", "content-type", "accept")
#: response headers passed back (uvicorn writes its own framing and connection headers)
RETURNED = ("content-type",)


def build_app(upstream: str) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(60.0), limits=limits) as client:
            app.state.client = client
            yield

    async def forward(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED}
        upstream_req = client.build_request(request.method, request.url.path, content=await request.body(),
                                            headers=headers)
        resp = await client.send(upstream_req, stream=True)
        out_headers = {k: v for k, v in resp.headers.items() if k in RETURNED}
        if "content-length" in resp.headers:  # a whole answer: read it and send it in one piece
            body = await resp.aread()
            await resp.aclose()
            return Response(body, status_code=resp.status_code, headers=out_headers)
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out_headers,
                                 background=BackgroundTask(resp.aclose))

    routes = [Route("/v1/{rest:path}", forward, methods=["GET", "POST"]),
              Route("/health", lambda _req: Response(b""), methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--upstream", required=True, help="base URL of the OpenAI-compatible server behind it")
    args = ap.parse_args(argv)
    uvicorn.run(build_app(args.upstream.rstrip("/")), host=args.host, port=args.port, workers=1, loop="uvloop",
                http="httptools", log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
