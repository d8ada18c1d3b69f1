"""`tandem serve --replicas 2`: two replicas of the default model behind Ray Serve's HTTP proxy, on a local Ray
cluster, answering the `openai` client on loopback, streamed and not, from both replicas. Skipped where Ray is
not installed (the `cluster` extra, which `.[all]` leaves out)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx2 = pytest.importorskip("httpx2")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    command = [sys.executable, "-m", "tandem.cli", "serve", "--replicas", "2", "--port", str(port),
               "--policy", "quest", "--window-tokens", "64", "--sink-tokens", "16", "--cpu-threads", "1"]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx2.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_two_replicas_answer_the_openai_client_streamed_and_not(replicas):
    client = openai.OpenAI(base_url=f"{replicas}/v1", api_key="none")
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, seed=1)
    assert answer.choices[0].text and answer.usage.completion_tokens >= 1
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces)
    pids = {httpx2.get(f"{replicas}/health", timeout=10).json()["pid"] for _ in range(40)}
    assert len(pids) == 2, pids  # Ray's proxy spreads requests over both replicas
