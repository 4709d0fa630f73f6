"""bench_engine's bookkeeping: the best of repeated runs, the ratio cells, the impl list."""

from __future__ import annotations

import argparse

from bench.bench_engine import best_of, impls_to_run, make_prompts, ratio_cell


def test_best_of_keeps_the_fastest_run_and_lists_every_run() -> None:
    best = best_of([(512, 1.0), (512, 0.8), (500, 0.79)])
    assert (best["tokens"], best["seconds"]) == (512, 0.8)  # 640 tok/s beats 632.9
    assert best["runs_seconds"] == [1.0, 0.8, 0.79]


def test_ratio_cell_gives_best_over_best_then_the_round_by_round_range() -> None:
    assert ratio_cell([600.0], [300.0]) == "2.00x"
    # Best over best is 660 / 330; round by round 600 / 330 and 660 / 300.
    assert ratio_cell([600.0, 660.0], [330.0, 300.0]) == "2.00x (1.82-2.20x)"


def test_each_impl_runs_once_per_round_even_when_named_twice() -> None:
    args = argparse.Namespace(
        impls=["native", "vllm"], temperature=0.0, no_hf=False, vllm_python="/venv/bin/python"
    )
    assert impls_to_run(args) == ["native", "vllm"]
    args.impls = None
    assert impls_to_run(args) == ["inv", "plain", "hf", "vllm"]


def test_each_repeat_gets_prompts_new_to_the_prefix_cache() -> None:
    sets = [make_prompts(4, 16, 1000, 100 * r) for r in range(3)]
    assert sets[0] == make_prompts(4, 16, 1000)  # set 0 is a run without --repeats
    firsts = {tuple(prompts[0][:16]) for prompts in sets}
    assert len(firsts) == 3
