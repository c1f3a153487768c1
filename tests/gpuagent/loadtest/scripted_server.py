"""An OpenAI-style streaming server with scripted timings, for the load tester's
tests: `python -m tests.gpuagent.loadtest.scripted_server --port P [--ttft-ms 100]
[--itl-ms 20] [--tokens 8] [--tokens-per-chunk 1] [--fail-every N]
[--cut-every N] [--error-event-every N] [--max-concurrent N]`.

Each chat request gets a role-only chunk at once, its first content chunk
`ttft-ms` after the request arrived, then one chunk every `itl-ms`, each chunk
carrying `tokens-per-chunk` tokens, then a usage chunk (`tokens` completion tokens)
and [DONE]. With --max-concurrent N it serves at most N streams at once: the rest
wait (their time to first token grows) until one ends, as a server throttled to a
known capacity. Every Nth request fails instead: a 500, a stream cut after its first
content chunk, or an in-band error event.

/metrics has the engine's per-step histogram of running sequences
(`engine_iteration_num_requests_running`, one bucket per count up to MAX_RUNNING),
observed here each time a stream opens: the moments the count rises, so its highest
grown bucket is the exact peak, as the engine's is. It also has the engine's TTFT
and per-token ITL histograms, observed as scripted when each chunk is sent (a chunk
of k tokens after a gap g: k observations of g / k).
"""

import argparse
import asyncio
import itertools
import json

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest

MAX_RUNNING = 512


def sse(data) -> bytes:
    return (
        f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()
    )


def running_per_step_histogram(
    registry: CollectorRegistry, max_running: int
) -> Histogram:
    """The engine's histogram of running sequences, one bucket per count."""
    return Histogram(
        "engine_iteration_num_requests_running",
        "Sequences in the running batch, observed once per engine step",
        buckets=range(max_running + 1),
        registry=registry,
    )


def build_app(args: argparse.Namespace) -> web.Application:
    counter = itertools.count(1)
    running = 0
    slots = asyncio.Semaphore(args.max_concurrent) if args.max_concurrent else None
    registry = CollectorRegistry()
    running_per_step = running_per_step_histogram(registry, MAX_RUNNING)
    ttft_s = Histogram(
        "engine_time_to_first_token_seconds",
        "Arrival -> first token",
        registry=registry,
    )
    itl_s = Histogram(
        "engine_inter_token_latency_seconds", "Between tokens", registry=registry
    )

    async def models(request: web.Request) -> web.Response:
        card = {"id": "scripted", "object": "model", "max_model_len": 100000}
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        text = "".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text.encode()) // 4 + 3})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def chat(request: web.Request) -> web.StreamResponse:
        if slots is None:
            return await serve_chat(request)
        async with slots:
            return await serve_chat(request)

    async def serve_chat(request: web.Request) -> web.StreamResponse:
        nonlocal running
        arrived = asyncio.get_running_loop().time()
        number = next(counter)
        await request.json()
        if args.fail_every and number % args.fail_every == 0:
            return web.json_response({"error": {"message": "scripted"}}, status=500)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        running += 1
        running_per_step.observe(running)
        try:
            role = {
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
            }
            await resp.write(sse(role))
            chunks = -(-args.tokens // args.tokens_per_chunk)
            for i in range(chunks):
                due = arrived + (args.ttft_ms + i * args.itl_ms) / 1e3
                await asyncio.sleep(max(0.0, due - asyncio.get_running_loop().time()))
                if i == 0:
                    ttft_s.observe(args.ttft_ms / 1e3)
                else:
                    for _ in range(args.tokens_per_chunk):
                        itl_s.observe(args.itl_ms / 1e3 / args.tokens_per_chunk)
                text = "tok " * args.tokens_per_chunk
                await resp.write(
                    sse({"choices": [{"index": 0, "delta": {"content": text}}]})
                )
                if args.cut_every and number % args.cut_every == 0:
                    request.transport.close()  # the connection drops mid-stream
                    return resp
                if args.error_event_every and number % args.error_event_every == 0:
                    await resp.write(sse({"error": {"message": "scripted failure"}}))
                    return resp
            usage = {"prompt_tokens": 12, "completion_tokens": args.tokens}
            await resp.write(sse({"choices": [], "usage": usage}))
            await resp.write(sse("[DONE]"))
        finally:
            running -= 1
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--cut-every", type=int, default=0)
    parser.add_argument("--error-event-every", type=int, default=0)
    parser.add_argument("--max-concurrent", type=int, default=0)
    args = parser.parse_args()
    web.run_app(build_app(args), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
