"""Tables and validated configuration of the PNM-KV system model."""

import pytest

from tandem.tools.simulator.config import SystemConfig, Workload, check_scheme, format_context, parse_context
from tandem.tools.simulator.hardware import MODELS, get_gpu, get_model


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("128k", 131072),
        ("512K", 524288),
        ("1m", 1048576),
        ("1M", 1048576),
        ("4096", 4096),
        (777, 777),
        ("0.5m", 524288),
    ],
)
def test_parse_context(text, tokens):
    assert parse_context(text) == tokens


@pytest.mark.parametrize("text", ["12q", "", "k", "-5", "0", "1g"])
def test_parse_context_rejects(text):
    with pytest.raises(ValueError, match="--context"):
        parse_context(text)


def test_format_context_round_trip():
    for text in ("128K", "512K", "1M", "1000"):
        assert format_context(parse_context(text)) == text


def test_scheme_names_are_exact():
    for name in ("baseline", "pnm", "pnkv"):
        assert check_scheme(name) == name
    for bad in ("PNM", "png", "pnm-kv", "all"):
        with pytest.raises(ValueError, match=r"--scheme.*baseline.*pnm.*pnkv"):
            check_scheme(bad)


def test_unknown_model_and_gpu_name_allowed_values():
    with pytest.raises(ValueError, match=r"--model.*llama-3.1-8b.*llama-3.1-405b"):
        get_model("llama-2-7b")
    with pytest.raises(ValueError, match=r"--gpu.*a100.*h100"):
        get_gpu("v100")


def test_model_table_matches_public_counts():
    # Official parameter counts of Llama-3.1 8B / 70B / 405B; Table 1 heads, layers and GQA groups.
    assert MODELS["llama-3.1-8b"].num_params == 8_030_261_248
    assert MODELS["llama-3.1-70b"].num_params == 70_553_706_496
    assert MODELS["llama-3.1-405b"].num_params == 405_853_388_800
    assert [m.gqa_group for m in MODELS.values()] == [4, 8, 16]
    m = MODELS["llama-3.1-8b"]
    assert m.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
    assert m.digest_bytes_per_token(16) == m.kv_bytes_per_token / 16  # min+max keys per 16-token page


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"budget_fraction": 0.0}, "--budget"),
        ({"budget_fraction": 1.5}, "--budget"),
        ({"page_size": 0}, "--page-size"),
        ({"recall_rate": -0.1}, "--recall-rate"),
        ({"steady_churn": 2.0}, "--steady-churn"),
        ({"steady_ratio": 1.0}, "--steady-ratio"),
        ({"max_batch": 0}, "--batch"),
        ({"mapping": "pp"}, "--mapping"),
    ],
)
def test_workload_rejects(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Workload(context_tokens=1024, **kwargs)


def test_system_rejects_bad_counts():
    with pytest.raises(ValueError, match="--gpus"):
        SystemConfig.build("llama-3.1-8b", "128k", gpus=0, pnm=1)
    with pytest.raises(ValueError, match="--pnm"):
        SystemConfig.build("llama-3.1-8b", "128k", gpus=1, pnm=-2, scheme="baseline")
    with pytest.raises(ValueError, match="--pnm"):
        SystemConfig.build("llama-3.1-8b", "128k", gpus=1, pnm=0, scheme="pnm")


def test_budget_tokens_whole_pages():
    w = Workload(context_tokens=1000, budget_fraction=0.1, page_size=16)
    assert w.budget_tokens == 112  # 100 tokens -> 7 pages
    hot = Workload(context_tokens=32768, budget_fraction=0.05, page_size=16, hot_tokens=4096)
    assert hot.budget_tokens == 4096 + 90 * 16  # 5% of the 28672 offloaded tokens, rounded up to pages
