"""`tandem serve --replicas N`: N copies of the server behind Ray Serve's HTTP proxy.

Each replica is a Ray actor that builds its own server (model, caches, scheduler) from the command line's
arguments and answers the requests Ray's proxy routes to it by running the same ASGI app as `tandem serve`,
responses streamed through. A local Ray cluster is started unless `--ray-address` names one (`ray start
--head` on the head host, then `--ray-address auto` on it, or the cluster's address elsewhere), so replicas
spread over the cluster's hosts as Ray places them. Needs the `cluster` extra (`pip install -e ".[cluster]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise ValueError(
            '--replicas needs Ray Serve, which the base install leaves out: pip install -e ".[cluster]" '
            "(or drop --replicas to serve from this process)"
        ) from err
    return ray, serve


async def forward(app, request):
    """Run the ASGI `app` on a Starlette `request` and stream its response back (Ray Serve returns it)."""
    from starlette.responses import StreamingResponse

    body = await request.body()
    chunks: asyncio.Queue = asyncio.Queue()
    started = asyncio.get_running_loop().create_future()
    sent = asyncio.Event()

    async def receive():
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client's disconnect reaches Ray's proxy, not this app

    async def send(message):
        if message["type"] == "http.response.start":
            started.set_result(message)
        elif message["type"] == "http.response.body":
            await chunks.put(message.get("body", b""))
            if not message.get("more_body"):
                await chunks.put(None)

    task = asyncio.ensure_future(app(dict(request.scope), receive, send))
    done, _ = await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    if started not in done:
        task.result()  # the app ended without a response: raise its error
    head = started.result()

    async def body_chunks():
        while (chunk := await chunks.get()) is not None:
            yield chunk
        await task

    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.get("headers", [])}
    headers.pop("content-length", None)  # the stream sets its own framing
    return StreamingResponse(body_chunks(), status_code=head["status"], headers=headers)


class Replica:
    """One server, built in the Ray actor by `build` (the CLI's `build_server`, which Ray ships by reference) from
    the command line's arguments (a dict of `tandem serve`'s)."""

    def __init__(self, build, settings: dict) -> None:
        from .app import create_app

        self.server = build(argparse.Namespace(**settings))
        self.server.scheduler.start()
        self.app = create_app(self.server)
        self.pid = os.getpid()

    async def __call__(self, request):
        return await forward(self.app, request)


def run_replicas(args, build) -> int:
    """Serve with `args.replicas` replicas on args.host:args.port until interrupted; `build(args)` makes one
    replica's server."""
    ray, serve = _ray()
    # each replica builds one server from the same arguments, itself with no replicas
    settings = {**{k: v for k, v in vars(args).items() if k != "func"}, "replicas": None}
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployment = serve.deployment(Replica, name="tandem").options(
            num_replicas=args.replicas, ray_actor_options={"num_cpus": args.replica_cpus}
        )
        serve.run(deployment.bind(build, settings), name="tandem", route_prefix="/", blocking=False)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 130
    finally:
        serve.shutdown()
        ray.shutdown()
