"""Counter-based noise (engine/sampling_noise.py): rows depend only on (seed, position), pinned bits,
uniforms never 0 or 1, the exact log, gumbel_at equal to the full noise at the given ids, and the
pruned Gumbel-max search equal to the argmax over the full noise."""

from __future__ import annotations

import math

import torch

from deterministic_inference.engine import sampler, sampling_noise
from deterministic_inference.engine.sampling_params import SamplingParams


def test_gumbel_noise_rows_depend_only_on_their_seed_and_position() -> None:
    seeds, positions = torch.tensor([3, 2**62 + 5, 3, 0]), torch.tensor([0, 7, 1, 0])
    batch = sampling_noise.gumbel_noise(seeds, positions, 1001)
    for row in range(4):
        alone = sampling_noise.gumbel_noise(seeds[row : row + 1], positions[row : row + 1], 1001)
        assert torch.equal(alone.view(torch.int32), batch[row : row + 1].view(torch.int32))
    # A prefix of the vocabulary gets the same noise: noise depends on the token id, not the vocab size.
    assert torch.equal(
        sampling_noise.gumbel_noise(seeds, positions, 10).view(torch.int32), batch[:, :10].view(torch.int32)
    )
    assert not torch.equal(batch[0], batch[2])  # position matters
    mean, std = batch.mean().item(), batch.std().item()
    assert abs(mean - 0.5772) < 0.05 and abs(std - math.pi / math.sqrt(6)) < 0.05
    # pinned bits, so a change of the hash or the mapping is a visible, conscious change
    assert (
        sampling_noise.gumbel_noise(torch.tensor([0]), torch.tensor([0]), 4).view(torch.int32).tolist()
        == PINNED_NOISE
    )


PINNED_NOISE = [[1084400853, -1088738233, 1078592170, 1048838400]]


def test_uniforms_never_reach_0_or_1_and_log_is_accurate() -> None:
    extremes = (torch.tensor([0, 2**32 - 1], dtype=torch.float64) + 0.5) * 2.0**-32
    assert 0.0 < extremes[0].item() and extremes[1].item() < 1.0
    noise = sampling_noise.gumbel(extremes)
    assert torch.isfinite(noise).all()
    x = torch.cat(
        [torch.rand(10_000, dtype=torch.float64) * 30 + 1e-12, extremes, torch.tensor([1.0, 2.0, 0.5])]
    )
    assert torch.allclose(sampling_noise.log64(x), torch.log(x), rtol=1e-15, atol=1e-15)


def test_pruned_search_equals_the_full_noise_argmax() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 2000
    for scale in (0.01, 1.0, 10.0, 1000.0):
        logits = torch.randn(16, vocab, generator=gen) * scale
        logits[:, 5] = logits[:, 7]  # a value tie between two tokens
        seeds, positions = torch.arange(16) * 1_000_003, torch.arange(16)
        got = sampler.sample(
            logits, [SamplingParams()] * 16, seeds.tolist(), positions.tolist(), [[]] * 16, [[]] * 16
        )
        scores = logits + sampling_noise.gumbel_noise(seeds, positions, vocab)
        expected = [int(torch.nonzero(row == row.max())[0, 0]) for row in scores]
        assert got.token_ids == expected


def test_gumbel_at_is_gumbel_noise_at_the_given_ids() -> None:
    seeds, positions = torch.tensor([0, 7, 2**62 + 5]), torch.tensor([0, 3, 1000])
    full = sampling_noise.gumbel_noise(seeds, positions, 1000)  # [3, 1000]
    ids = torch.randint(0, 1000, (3, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(
        sampling_noise.gumbel_at(seeds, positions, ids).view(torch.int32),
        full.gather(1, ids).view(torch.int32),
    )
