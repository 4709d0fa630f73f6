"""Numerics of the decoder against transformers: tiny random Llama/Qwen2/Qwen3 (fp32) and SmolLM2."""

from __future__ import annotations

import pytest
import torch

from deterministic_inference.engine.model_runner import ModelRunner
from deterministic_inference.engine.plan import ScheduledChunk, StepPlan
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import load_model
from tests.tiny_models import TinyModel, transformers_llama


def prefill_logits(model: DecoderModel, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every position of `token_ids` from one prefill through the paged cache."""
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks + 2, block_size)
    blocks = tuple(range(1, num_blocks + 1))
    plan = StepPlan(0, (ScheduledChunk("r", tuple(token_ids), 0, blocks, True, True),))
    logits = runner.execute(plan)[0]
    assert logits is not None
    return logits


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logits_match_transformers(
    fixture: str, batch_invariant: bool, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(fixture)
    loaded = load_model(str(tiny.path))
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, batch_invariant, 8), 512)
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, loaded.spec.vocab_size, (70,), generator=generator).tolist()
    ours = prefill_logits(model, token_ids)
    with torch.no_grad():
        reference = tiny.model(torch.tensor([token_ids])).logits[0].float()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=2e-5)


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers() -> None:
    """64 greedy steps on the real default model: same tokens as transformers fed the same weights
    (dequantised: --quantization none, so both compute with the same dense fp32 weights)."""
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    loaded = load_model(None)
    # eos handling is off on both sides (ours: ignore_eos); min_new_tokens would instead suppress
    # the eos logit in transformers and change its argmax.
    reference = transformers_llama(loaded)
    engine = Engine(EngineConfig(dtype="float32", quantization="none", selfcheck=False), loaded=loaded)
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for output in outputs:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=64, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
