"""lm-eval-harness through `local-completions` against a real detinf server: a local jsonl task shipped in
tests/data/lm_eval (generate_until, loglikelihood, multiple_choice) gives per-sample identical results at
num_concurrent 1 and 8; with batch-invariant ops off, some sample differs (negative control). Both servers
take at most 16 tokens per engine step, so at concurrency 8 prompts are prefilled in other chunks than
alone (plain ops then compute other bits; at this model's size batching alone does not change them).

lm-eval is not in requirements.lock (its closure is ~45 packages, pyarrow / pandas / scipy among them,
and does not install offline-fast); install the pinned set with
`.venv/bin/pip install -r tests/requirements-lm-eval.txt`. Without it this test skips, saying so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TASKS = ["detinf_local_gen", "detinf_local_ll", "detinf_local_mc"]
STEP_TOKENS = 16  # max_num_batched_tokens of the test servers
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lm_eval") is None,
        reason="lm-eval is not installed: .venv/bin/pip install -r tests/requirements-lm-eval.txt",
    ),
]


def evaluate(server: RunningServer, tokenizer: Path, concurrent: int) -> dict[str, list[Any]]:
    """Per task, the per-sample (doc_id, arguments, raw responses) of one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = (f"model={TINY_NAME},base_url={server.v1}/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tokenizer},num_concurrent={concurrent},max_retries=1,max_length=400,"
                  "tokenized_requests=True")
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=TASKS,
        task_manager=TaskManager(include_path=str(TASK_DIR)), log_samples=True, batch_size=1,
    )
    assert results is not None
    return {
        task: sorted((s["doc_id"], repr(s["arguments"]), repr(s["resps"])) for s in results["samples"][task])
        for task in TASKS
    }


@pytest.fixture()
def offline_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task's jsonl is read from tests/data/lm_eval (relative data_files), never from a hub."""
    monkeypatch.chdir(TASK_DIR)
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "datasets"))):
        monkeypatch.setenv(name, value)


def test_per_sample_identical_at_concurrency_1_and_8(
    tiny_llama_dir: TinyModel, offline_datasets: None
) -> None:
    config = tiny_config(tiny_llama_dir, max_num_batched_tokens=STEP_TOKENS)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        one = evaluate(server, tiny_llama_dir.path, 1)
        eight = evaluate(server, tiny_llama_dir.path, 8)
    assert [len(one[task]) for task in TASKS] == [8, 8, 8]
    assert one == eight


def test_negative_control_plain_ops_differ(tiny_llama_dir: TinyModel, offline_datasets: None) -> None:
    config = tiny_config(tiny_llama_dir, batch_invariant=False, max_num_batched_tokens=STEP_TOKENS)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        one = evaluate(server, tiny_llama_dir.path, 1)
        eight = evaluate(server, tiny_llama_dir.path, 8)
    assert one != eight, "plain ops gave identical samples: the test above cannot fail"
