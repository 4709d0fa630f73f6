"""The benchmark model maker (bench/make_gguf.py) and its K-quant writers (bench/kquants.py).

K-quants: the `gguf` package's dequantizer (the oracle) decodes our packed bytes to exactly the values
the fields describe, bit for bit, and those values are close to the input. Files: the same arguments give
the same bytes (another seed changes them), every format reads back with the planned tensor types, and
small shapes load in our engine and generate. llama.cpp loading is checked only where llama-cpp-python
happens to be installed (the bench venv); it is never a test dependency.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.kquants import affine_fields, pack_q4_k, pack_q5_k, pack_q6_k, quantize_k, symmetric_fields
from bench.make_gguf import QTYPES, LlamaShape, main, write_llama_gguf

SMALL = LlamaShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, context=512)
SMALL_MOE = LlamaShape(
    hidden=256, layers=2, heads=4, kv_heads=2, ffn=256, context=512, experts=8, experts_used=2
)


def field_values(kind: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes, values from the fields in float32, in the dequantizer's order of operations)."""
    if kind == "Q6_K":
        s = symmetric_fields(x)
        scale = (s.d.astype(np.float32)[:, None] * s.sc.astype(np.float32))[..., None]  # [n, 16, 1]
        return pack_q6_k(s), (scale * (s.q.astype(np.float32) - 32)).reshape(-1, 256)
    f = affine_fields(x, 15 if kind == "Q4_K" else 31)
    scale = (f.d.astype(np.float32)[:, None] * f.sc.astype(np.float32))[..., None]  # [n, 8, 1]
    shift = (f.dmin.astype(np.float32)[:, None] * f.m.astype(np.float32))[..., None]
    packed = pack_q4_k(f) if kind == "Q4_K" else pack_q5_k(f)
    return packed, (scale * f.q.astype(np.float32) - shift).reshape(-1, 256)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_bytes_decode_to_their_fields(kind: str) -> None:
    import gguf

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((48, 256)) * 0.02).astype(np.float32)
    x[0] = 0.0  # an all-zero block
    x[1] = np.abs(x[1])  # a block with no negative values (min offset 0)
    packed, expected = field_values(kind, x)
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[kind]).reshape(-1, 256)
    assert np.array_equal(decoded.view(np.int32), expected.view(np.int32))
    # the fit itself: error within about one quantization step of the block's range
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[kind]
    span = (x.max(axis=1) - np.minimum(x.min(axis=1), 0))[:, None]
    assert np.all(np.abs(decoded - x) <= 1.01 * span / levels + 1e-7)
    assert np.array_equal(quantize_k(x, kind), packed)


def test_k_quant_negative_control_a_swapped_layout_is_detected() -> None:
    """The oracle comparison catches a packing mistake: sub-blocks 0 and 1 swapped."""
    import gguf

    x = (np.random.default_rng(4).standard_normal((4, 256)) * 0.02).astype(np.float32)
    f = affine_fields(x, 15)
    swapped = f._replace(q=f.q[:, [1, 0, 2, 3, 4, 5, 6, 7], :])
    _, expected = field_values("Q4_K", x)
    decoded = gguf.quants.dequantize(pack_q4_k(swapped), gguf.GGMLQuantizationType.Q4_K).reshape(-1, 256)
    assert not np.array_equal(decoded.view(np.int32), expected.view(np.int32))


def test_k_quant_rejects_rows_not_a_multiple_of_256() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 128), dtype=np.float32), "Q4_K")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_arguments_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    one = write_llama_gguf(tmp_path / "a.gguf", SMALL, "Q4_K_M", seed=5)
    two = write_llama_gguf(tmp_path / "b.gguf", SMALL, "Q4_K_M", seed=5)
    other = write_llama_gguf(tmp_path / "c.gguf", SMALL, "Q4_K_M", seed=6)
    assert digest(one) == digest(two)
    assert digest(one) != digest(other)


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_format_reads_back_with_its_tensor_types(tmp_path: Path, qtype: str) -> None:
    import gguf

    path = write_llama_gguf(tmp_path / f"m.{qtype}.gguf", SMALL, qtype)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert len(types) == 2 + 9 * SMALL.layers  # tied: no output.weight
    assert types["blk.0.attn_norm.weight"] == "F32"
    if qtype.endswith("_M"):  # layer 1 of 2 is a "more bits" layer; the tied embedding is the head
        assert (types["token_embd.weight"], types["blk.1.ffn_down.weight"]) == ("Q6_K", "Q6_K")
        assert types["blk.0.ffn_down.weight"] == types["blk.0.attn_q.weight"] == qtype[:4]
    else:
        assert types["blk.1.ffn_up.weight"] == types["token_embd.weight"] == qtype
    assert reader.fields["llama.embedding_length"].contents() == SMALL.hidden


def test_tokenizer_metadata_is_the_default_models(tmp_path: Path) -> None:
    from deterministic_inference.model.default_model import default_model_path
    from deterministic_inference.model.gguf_file import read_gguf

    path = write_llama_gguf(tmp_path / "m.gguf", SMALL, "Q8_0")
    ours, source = read_gguf(path).metadata, read_gguf(default_model_path()).metadata
    keys = [key for key in source if key.startswith("tokenizer.")]
    assert len(keys) >= 10 and "tokenizer.chat_template" in keys
    assert {key: ours[key] for key in keys} == {key: source[key] for key in keys}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K_M", "BF16"])
def test_small_files_load_in_the_engine_and_generate(tmp_path: Path, qtype: str) -> None:
    from deterministic_inference.config import EngineConfig
    from deterministic_inference.engine.engine import Engine
    from deterministic_inference.engine.sampling_params import SamplingParams

    path = write_llama_gguf(tmp_path / f"m.{qtype}.gguf", SMALL, qtype, seed=1)
    engine = Engine(EngineConfig(model=str(path), kv_cache_memory=64 * 2**20))
    assert (engine.spec.hidden_size, engine.spec.num_kv_heads, engine.spec.tie_word_embeddings) == (
        256,
        2,
        True,
    )
    out = engine.generate(["The river"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert all(np.isfinite(v) for v in out.outputs[0].logprobs)


def test_llama_cpp_loads_a_small_file(tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")  # only in the bench venv, never a test dependency
    path = write_llama_gguf(tmp_path / "m.gguf", SMALL, "Q4_K_M")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    assert llm.n_vocab() == 49152
    assert len(llm.tokenize(b"The river")) >= 2


def test_bad_arguments_fail_with_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.gguf"
    assert main(["--out", str(out), "--qtype", "Q3_K"]) == 2
    assert "--qtype must be one of" in capsys.readouterr().err
    # K-quants need rows of 256 values: hidden 128 cannot be Q4_K
    assert main(["--out", str(out), "--qtype", "Q4_K", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                 "--ffn", "256", "--layers", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "token_embd.weight" in err and "256" in err and err.count("\n") == 1
    assert main(["--out", str(out), "--heads", "3", "--kv-heads", "2"]) == 2
    assert "--kv-heads" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_moe_option_writes_llama_cpp_expert_stacks(tmp_path: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(str(write_llama_gguf(tmp_path / "moe.gguf", SMALL_MOE, "Q4_K_M")))
    tensors = {t.name: t for t in reader.tensors}
    assert "blk.0.ffn_gate.weight" not in tensors
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert list(tensors["blk.0.ffn_up_exps.weight"].shape) == [256, 256, 8]  # GGUF order: cols, rows, experts
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q6_K"  # a "more bits" layer
    assert reader.fields["llama.expert_count"].contents() == 8
    assert reader.fields["llama.expert_used_count"].contents() == 2
    with pytest.raises(ValueError, match="--experts-used 3 must be between 1 and --experts 2"):
        LlamaShape(experts=2, experts_used=3).check()


@pytest.mark.slow
def test_moe_file_serves_end_to_end(tmp_path: Path) -> None:
    """An 8-expert top-2 Q4_0 file from the maker, served over loopback HTTP and queried with the
    official openai client: the model is an MoE, and the same seeded request gives the same tokens and
    logprob bits alone and beside other requests."""
    import concurrent.futures

    import openai

    from tests.server.harness import subprocess_server

    path = write_llama_gguf(tmp_path / "moe.Q4_0.gguf", SMALL_MOE, "Q4_0", seed=2)
    with subprocess_server(["--model", str(path), "--kv-cache-memory", "64MiB"]) as (server, _):
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(prompt: str) -> tuple[list[str], list[float]]:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0.9, seed=11, logprobs=1
            )
            logprobs = out.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
            return logprobs.tokens, [float(v) for v in logprobs.token_logprobs]

        alone = ask("The river")
        assert len(alone[0]) == 12
        prompts = ["The river", "Once upon a time", "1 2 3 4 5 6 7", "def f(x):", "The river"]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(ask, prompts))
        assert together[0] == alone and together[-1] == alone


def test_arch_flag_picks_the_preset_and_shape_flags_override_it(tmp_path: Path) -> None:
    import gguf

    from bench.gguf_families import FAMILIES
    from bench.make_gguf import parse_args, shape_from_args

    assert shape_from_args(parse_args(["--out", "x"]), FAMILIES["llama"].preset) == LlamaShape()
    args = parse_args(["--out", "x", "--arch", "gemma3", "--layers", "2", "--rope-theta", "5e5"])
    assert shape_from_args(args, FAMILIES["gemma3"].preset) == replace(
        FAMILIES["gemma3"].preset, layers=2, rope_theta=5e5
    )
    out = tmp_path / "g2.gguf"
    tiny = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
            "--head-dim", "32", "--context", "256", "--sliding-window", "8"]  # fmt: skip
    assert main(["--out", str(out), "--arch", "gemma2", "--qtype", "Q8_0", *tiny]) == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["general.architecture"].contents() == "gemma2"
    assert fields["gemma2.attention.sliding_window"].contents() == 8
    assert fields["gemma2.attention.key_length"].contents() == 32
    assert fields["gemma2.final_logit_softcapping"].contents() == 30.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "gemma5"], "--arch must be one of llama, mistral, gemma3, gemma2, phi3"),
        (["--arch", "gemma3", "--untied"], "drop --untied"),
        (["--arch", "phi3", "--experts", "2", "--experts-used", "1"], "--experts is for --arch llama"),
        (
            ["--arch", "mistral", "--context", "1024"],
            "--sliding-window 4096 must be 0 (none) or below --context",
        ),
    ],
)
def test_bad_family_arguments_fail_with_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["--out", str(tmp_path / "x.gguf"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())
