"""GPU engines a manifest can name (``runtime.execution.backend: vllm | sglang``) and the settings that
make each one deterministic. Untested on GPU: this module only builds the container's command line and
environment (see `gpu_serve`), from the manifest, refusing what would undo the pinned settings.

vLLM:   ``VLLM_BATCH_INVARIANT=1``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, an attention backend from
        `VLLM_ATTENTION_BACKENDS` (default FLASH_ATTN), ``--seed`` from ``engine.seed``.
SGLang: ``--enable-deterministic-inference``, ``--attention-backend`` from `SGLANG_ATTENTION_BACKENDS`
        (default fa3), ``--random-seed`` from ``engine.seed``.
Both:   the model's Hugging Face id and revision (``--revision``), ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
        ``PYTHONHASHSEED=0``, the manifest's batching limits and dtype; ``enforce_eager: true`` turns
        CUDA graphs off (vLLM ``--enforce-eager``, SGLang ``--disable-cuda-graph``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deterministic_inference.errors import WorkflowError

VLLM_ATTENTION_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
SGLANG_ATTENTION_BACKENDS = ("fa3", "flashinfer", "triton")
COMMON_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "0"}


@dataclass(frozen=True)
class GpuEngine:
    """How one GPU engine is started in its container."""

    name: str  # the manifest's backend value
    image_env: str  # environment variable naming the image (third in the resolution order)
    image_field: str  # runtime.execution field naming the image (second)
    port: int  # port the engine listens on inside the container
    attention: tuple[str, ...]  # attention backends that keep it deterministic (first = default)
    pinned_env: dict[str, str]  # environment the determinism settings need
    launcher: tuple[str, ...]  # command before the flags (the image's entrypoint runs it)
    flags: dict[str, str]  # manifest setting -> this engine's flag


VLLM = GpuEngine(
    name="vllm",
    image_env="VLLM_IMAGE",
    image_field="vllm_image",
    port=8000,
    attention=VLLM_ATTENTION_BACKENDS,
    pinned_env={"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    launcher=(),  # the vllm/vllm-openai image's entrypoint is the OpenAI server
    flags={"model": "--model", "served_name": "--served-model-name", "seed": "--seed",
           "attention": "--attention-backend", "max_num_seqs": "--max-num-seqs",
           "max_tokens": "--max-num-batched-tokens", "max_model_len": "--max-model-len",
           "eager": "--enforce-eager", "no_prefix_cache": "--no-enable-prefix-caching"},
)
SGLANG = GpuEngine(
    name="sglang",
    image_env="SGLANG_IMAGE",
    image_field="sglang_image",
    port=30000,
    attention=SGLANG_ATTENTION_BACKENDS,
    pinned_env={},
    launcher=("python3", "-m", "sglang.launch_server", "--enable-deterministic-inference"),
    flags={"model": "--model-path", "served_name": "--served-model-name", "seed": "--random-seed",
           "attention": "--attention-backend", "max_num_seqs": "--max-running-requests",
           "max_tokens": "--chunked-prefill-size", "max_model_len": "--context-length",
           "eager": "--disable-cuda-graph", "no_prefix_cache": "--disable-radix-cache"},
)
ENGINES = {engine.name: engine for engine in (VLLM, SGLANG)}
_PINNED_ARGS = ("model", "model-path", "revision", "served-model-name", "host", "port", "seed", "random-seed",
                "attention-backend", "enable-deterministic-inference", "dtype")


def engine_command(engine: GpuEngine, data: dict[str, Any], served_name: str) -> list[str]:
    """The container command: the launcher, then the pinned flags, then `runtime.execution.engine_args`."""
    source, execution = data["model"]["source"], data["runtime"]["execution"]
    batching, settings = data["inference"]["batching"], data["engine"]
    attention = execution.get("attention_backend") or engine.attention[0]
    if attention not in engine.attention:
        raise WorkflowError(f"$.runtime.execution.attention_backend: {attention!r} is not one {engine.name} "
                            f"keeps deterministic; use one of {', '.join(engine.attention)}")
    flags = engine.flags
    command = [*engine.launcher, flags["model"], source["repo"], "--revision", source["revision"],
               flags["served_name"], served_name, "--host", "0.0.0.0", "--port", str(engine.port),
               flags["seed"], str(settings["seed"]), flags["attention"], attention,
               "--dtype", "auto" if settings["dtype"] == "auto" else settings["dtype"],
               flags["max_num_seqs"], str(batching["max_num_seqs"]),
               flags["max_tokens"], str(batching["max_num_batched_tokens"])]
    if settings["max_model_len"] is not None:
        command += [flags["max_model_len"], str(settings["max_model_len"])]
    if execution.get("enforce_eager"):
        command.append(flags["eager"])
    if not batching["enable_prefix_caching"]:
        command.append(flags["no_prefix_cache"])
    return command + extra_args(execution.get("engine_args") or {})


def extra_args(engine_args: dict[str, Any]) -> list[str]:
    """Flags from `runtime.execution.engine_args` (sorted by name; true = a bare flag, false = left out);
    a flag the determinism settings pin is refused."""
    args: list[str] = []
    for key in sorted(engine_args):
        flag = key.replace("_", "-")
        if flag in _PINNED_ARGS:
            raise WorkflowError(f"$.runtime.execution.engine_args.{key}: pinned by detinf serve (from the "
                                "manifest's model, engine and runtime sections); remove it")
        value = engine_args[key]
        if value is True:
            args.append(f"--{flag}")
        elif value is not False:
            args += [f"--{flag}", str(value)]
    return args


def engine_env(engine: GpuEngine, data: dict[str, Any], offline: bool) -> dict[str, str]:
    """The container environment: the manifest's runtime.env, then the pinned settings (a runtime.env
    value that contradicts one is refused), then the offline switches."""
    env = dict(data["runtime"]["env"])
    for key, value in {**COMMON_ENV, **engine.pinned_env}.items():
        if key in env and env[key] != value:
            raise WorkflowError(f"$.runtime.env.{key}: {env[key]!r} would undo the {engine.name} determinism "
                                f"setting {key}={value}; remove it")
        env[key] = value
    if offline:
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return dict(sorted(env.items()))
