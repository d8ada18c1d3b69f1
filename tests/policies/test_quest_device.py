"""Quest scored on the compute device (digest mirror + matmul bound + top-k inside the decode step) selects
the same blocks as the compiled CPU scoring of the host digests."""

import pytest
import torch

from tandem.cache.host import HostTier
from tandem.config import QuestConfig, TandemConfig
from tandem.kernels import reference
from tandem.policies.quest import QuestPolicy
from tests.tolerances import assert_close


def _digests(gen, batch, heads, blocks, dim, dtype):
    keys = torch.randn(batch, heads, blocks * 16, dim, generator=gen).to(dtype)
    kmin = keys.view(batch, heads, blocks, 16, dim).amin(dim=3)
    kmax = keys.view(batch, heads, blocks, 16, dim).amax(dim=3)
    return kmin, kmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_matmul_bound_equals_reference_bound(dtype, group):
    gen = torch.Generator().manual_seed(0)
    kmin, kmax = _digests(gen, 2, 2, 27, 64, dtype)
    q = torch.randn(2, 2 * group, 64, generator=gen).to(dtype)
    block_valid = torch.ones(2, 27, dtype=torch.bool)
    block_valid[1, :5] = False
    expected = reference.block_scores(q[:, :, None], kmin, kmax).masked_fill(
        ~block_valid[:, None], float("-inf")
    )
    actual = reference.block_scores_matmul(q, kmin, kmax, block_valid)
    assert_close(actual, expected, dtype)


def _host(mirror: bool, batch=2, rows=61 * 16):
    host = HostTier(
        batch, 2, 8, 64, torch.float32, 16, pin=False, keep_digest=True, keep_maw=False,
        mirror_device=torch.device("cpu") if mirror else None,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(batch, 2, rows, 64, generator=gen)
    valid = torch.ones(batch, rows, dtype=torch.bool)
    if batch > 1:
        valid[1, :40] = False  # left padding: two whole blocks and part of a third
    host.append(keys, keys.clone(), valid)
    return host


class _Layer:
    def __init__(self, host):
        self.host = host
        self.hot = None  # the policy reads only the host tier here


@pytest.mark.parametrize("budget", [0.05, 0.3, 1.0])
def test_device_ranked_selection_equals_cpu_selection(budget):
    policy = QuestPolicy(TandemConfig(policy="quest", quest=QuestConfig(budget=budget)))
    mirrored, plain = _Layer(_host(True)), _Layer(_host(False))
    assert plain.host.key_min_dev is None and mirrored.host.key_min_dev is not None
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    from_device = policy.device_select(mirrored, q)
    capacity_blocks = mirrored.host.capacity // 16
    assert from_device.shape == (2, 2, min(capacity_blocks, -(-int(budget * capacity_blocks * 1000) // 1000)))
    ours = policy.select(mirrored, q[:, :, None], from_device)
    theirs = policy.select(plain, q[:, :, None], None)
    assert torch.equal(ours.lengths, theirs.lengths)
    for b in range(2):
        for h in range(2):
            n = int(theirs.lengths[b, h])
            # same set of blocks (the all-padding blocks of request 1 are never picked)
            assert set(ours.indices[b, h, :n].tolist()) == set(theirs.indices[b, h, :n].tolist())
    assert not ({0, 1} & set(ours.indices[1].flatten()[: int(ours.lengths[1, 0])].tolist()))


def test_mirror_follows_growth():
    host = _host(True, batch=1, rows=64 * 16)
    generation = host.generation
    before = host.key_min_dev[:, :, :64].clone()
    more = torch.randn(1, 2, 64 * 16, 64)
    host.append(more, more.clone(), torch.ones(1, 64 * 16, dtype=torch.bool))
    assert host.generation > generation
    assert torch.equal(host.key_min_dev[:, :, :64], before)
    assert bool(host.block_valid_dev[0, :128].all()) and not bool(host.block_valid_dev[0, 128:].any())
