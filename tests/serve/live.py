"""A `tandem serve` app on a free local port, served by uvicorn in a background thread, for the tests that talk
HTTP to it; and its /metrics read back as numbers."""

import contextlib
import socket
import threading
import time

import httpx2
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tandem.attention import TaskPool
from tandem.config import TandemConfig
from tandem.serve.app import Server, create_app
from tandem.serve.scheduler import Limits, Scheduler

NAME = "smollm"  # the served model name the tests ask for


def build(model, tokenizer, config: TandemConfig, limits: Limits, prefix=None) -> Server:
    """A `Server` put together as `tandem.cli.serve.build_server` does, one CPU attention thread; `prefix`: its
    `PrefixCache`, or None (none)."""
    scheduler = Scheduler(model, tokenizer, limits, TaskPool(1), prefix=prefix)
    return Server(model, tokenizer, NAME, config, scheduler)


@contextlib.contextmanager
def running(server: Server, timeout: float = 30.0):
    """Serve `server` until the block ends; yields its base URL, `http://127.0.0.1:PORT`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx2.get(f"{base}/health").status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the test server at {base} did not come up")
            time.sleep(0.02)
        yield base
    finally:
        uv.should_exit = True
        thread.join(timeout)
        sock.close()


def metrics(base: str) -> dict[str, float]:
    """The server's /metrics as {'name{label="value"}': value} ({'name': value} for a sample without labels)."""
    text = httpx2.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for(condition, timeout: float, interval: float = 0.05):
    """Poll `condition()` until it returns something truthy (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(interval)
