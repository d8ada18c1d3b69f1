"""Token choice inside the engine's step (`tandem.engine.sampling`): the draws follow softmax(logits / T) over the
top-p set, depend only on (seed, step, token), and the runner decodes with them, eagerly and in CUDA graphs,
the same tokens for a request alone or batched."""

import math

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import Sampler, SamplingParams, TandemRunner
from tandem.engine.sampling import sample, uniform
from tests.tiny import tiny_model

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]


def _draw(logits, temperature, top_p, seed, steps, nucleus=True):
    """[steps] draws of one row at steps 0 .. steps - 1, as one batch of `steps` rows."""
    n = len(steps)
    return sample(
        logits.expand(n, -1), torch.full((n,), float(temperature)), torch.full((n,), float(top_p)),
        torch.full((n,), seed, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64), nucleus,
    )  # fmt: skip


def test_uniform_is_open_unit_interval_and_uncorrelated():
    u = uniform(torch.tensor([0, 1, -5]), torch.tensor([0, 0, 3]), 200_000)
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.002 and abs(float(u.var()) - 1 / 12) < 0.001
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.01  # two seeds
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.01  # neighbouring tokens


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_softmax_of_the_tempered_logits(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    n = 40_000
    counts = torch.bincount(_draw(logits, temperature, 1.0, 3, list(range(n)), nucleus=False), minlength=5)
    want = torch.softmax(logits[0] / temperature, 0)
    # within 4 standard errors of a binomial count
    assert torch.all((counts / n - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-9), (
        counts / n,
        want,
    )


def test_top_p_keeps_the_smallest_set_reaching_the_mass_and_renormalises():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    n = 20_000
    counts = torch.bincount(_draw(logits, 1.0, 0.75, 9, list(range(n))), minlength=4) / n
    assert counts[3] == 0  # 0.4 + 0.3 < 0.75 <= 0.4 + 0.3 + 0.2: three kept
    assert torch.allclose(counts[:3], torch.tensor([4 / 9, 3 / 9, 2 / 9]), atol=0.015)
    assert set(_draw(logits, 1.0, 0.01, 9, list(range(200))).tolist()) == {0}  # the top token is always kept


def test_temperature_zero_rows_are_greedy_beside_sampled_rows():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.5])
    tokens = sample(
        logits,
        temperature,
        torch.tensor([1.0, 0.9, 0.5, 1.0]),
        torch.arange(4),
        torch.zeros(4, dtype=torch.long),
    )
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_a_draw_depends_on_seed_and_step_only():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    first = _draw(logits, 0.9, 0.95, 7, list(range(30)))
    assert torch.equal(first, _draw(logits, 0.9, 0.95, 7, list(range(30))))
    assert not torch.equal(first, _draw(logits, 0.9, 0.95, 8, list(range(30))))
    assert torch.equal(first[10:], _draw(logits, 0.9, 0.95, 7, list(range(10, 30))))  # a resumed row


def test_sampler_moves_each_row_one_step_per_call_and_greedy_is_argmax():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    sampler = Sampler([SamplingParams(1.0, 1.0, 5), SamplingParams(0.7, 0.9, 6)], 2, "cpu", first_step=[0, 4])
    first, second = sampler(logits), sampler(logits)
    assert sampler.step.tolist() == [2, 6]
    assert (
        first[0] == _draw(logits[:1], 1.0, 1.0, 5, [0])[0]
        and second[1] == _draw(logits[1:], 0.7, 0.9, 6, [5])[0]
    )
    greedy = Sampler(SamplingParams(), 2, "cpu")
    assert greedy.greedy and torch.equal(greedy(logits), logits.argmax(-1))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
        (dict(temperature=True), "temperature must be a number >= 0"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(seed=2**64), "seed must fit in 64 bits"),
        (dict(seed=1.5), "seed must be an int or None"),
    ],
)
def test_bad_sampling_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_sampler_refuses_a_wrong_row_count():
    with pytest.raises(ValueError, match="params must be one SamplingParams or 3 of them"):
        Sampler([SamplingParams()] * 2, 3, "cpu")


# ---- the runner ---------------------------------------------------------------------------------------------------
def _model(device="cpu"):
    model = tiny_model("Llama", num_key_value_heads=2).to(device)
    model.generation_config.eos_token_id = None
    return model


def _sampled(model, ids, params, new_tokens=12, use_graphs="auto"):
    """The runner's tokens [B, new_tokens] with `params` (every entry kept: policy full)."""
    cache = TandemCache.for_model(
        model, TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    )
    runner = TandemRunner(model, cache, use_graphs=use_graphs)
    sampler = Sampler(params, ids.shape[0], runner.device)
    first = sampler(runner.prefill(ids, chunk_tokens=16, max_new_tokens=new_tokens))
    tokens, _ = runner.decode(first, new_tokens - 1, sampler=sampler)
    return torch.cat([first.cpu()[:, None], tokens], dim=1), runner


def test_runner_samples_reproducibly_and_temperature_zero_is_greedy():
    model = _model()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    hot = SamplingParams(temperature=1.5, top_p=0.95, seed=11)
    a, _ = _sampled(model, ids, hot)
    b, _ = _sampled(model, ids, hot)
    c, _ = _sampled(model, ids, SamplingParams(temperature=1.5, top_p=0.95, seed=12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy, _ = _sampled(model, ids, SamplingParams())
    cache = TandemCache.for_model(
        model, TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    )
    plain = TandemRunner(model, cache)
    first = plain.prefill(ids, chunk_tokens=16, max_new_tokens=12).argmax(-1)
    rest, _ = plain.decode(first, 11)
    assert torch.equal(greedy, torch.cat([first[:, None], rest], dim=1))


def test_a_request_samples_the_same_tokens_alone_and_batched():
    model = _model()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(1.2, 0.9, 21), SamplingParams(0.8, 1.0, 22)]
    batched, _ = _sampled(model, ids, params)
    for row in range(2):
        alone, _ = _sampled(model, ids[row : row + 1], params[row])
        assert torch.equal(alone[0], batched[row])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_runner_refuses_a_sampler_of_another_batch(device):
    model = _model(device)
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="full")))
    logits = runner.prefill(torch.randint(0, 128, (2, 20), device=device), max_new_tokens=4)
    with pytest.raises(ValueError, match="sampler must hold 2 rows"):
        runner.decode(logits.argmax(-1), 3, sampler=Sampler(SamplingParams(1.0), 1, device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_graph_recorded_draws_equal_eager_draws_and_the_cpu_draws():
    model = _model("cuda")
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(1.0, 0.9, 31), SamplingParams(1.3, 1.0, 32)]
    graphs, runner = _sampled(model, ids.cuda(), params, new_tokens=16)
    assert runner.use_graphs
    eager, _ = _sampled(model, ids.cuda(), params, new_tokens=16, use_graphs=False)
    assert torch.equal(graphs, eager)
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(6))
    on_cpu = Sampler(params, 2, "cpu")(logits)
    assert torch.equal(
        Sampler(params, 2, "cuda")(logits.cuda()).cpu(), on_cpu
    )  # the hash is exact integer math
