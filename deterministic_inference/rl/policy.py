"""`Policy`: a trainable `torch.nn.Module` whose logprobs equal the engine's, bit for bit.

The policy loads the same model files as the engine (float weights: `quantization="none"`, or dense HF
safetensors) and keeps them as parameters under their Hugging Face names (fp32 master copies by default).
Each forward casts them to the engine's dtype, exactly as the engine casts what it is given, builds the
engine's own decoder (`model/decoder.py`) on `TrainableBackend` (the engine's kernels with a backward
pass), runs every sequence whole from position 0, and turns the final hidden states of the scored rows
into logprobs with the engine's logits head and the engine's one logprob function
(`ops.logprobs.log_softmax_rows`).

Why the bits equal the sampler's: every op the engine runs is row-invariant (a token's values depend on
its own sequence only, whatever the batch, the chunking or the prefix cache), and this forward runs the
same ops on the same weights, so the logits row that predicts a token is the row the engine sampled
from, and its logprob goes through the same function. The engine's logprobs are "raw" (log_softmax of
the logits before temperature, penalties and top-k/top-p), and so are these; at temperature 1 without
filters they are the sampling distribution's logprobs, otherwise they are not (see the README).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.setup import DTYPES, resolve_dtype
from deterministic_inference.errors import ConfigError, InvalidRequestError
from deterministic_inference.model.decoder import DecoderModel
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.model.quantization import apply_quantization
from deterministic_inference.ops.attention import new_kv_cache
from deterministic_inference.ops.backend import KVCache, NativeBackend, Numerics, OpsBackend, select_backend
from deterministic_inference.ops.logprobs import log_softmax_rows
from deterministic_inference.rl.backend import LayerKV, TrainableBackend, TrainableLinear
from deterministic_inference.rl.batch import PackedBatch, pack, unpad
from deterministic_inference.rl.functions import TokenLogprobsFn

if TYPE_CHECKING:
    from deterministic_inference.engine.engine import Engine

CHUNK_ROWS = 256  # logits rows computed at once by the head (bounds the [rows, vocab] temporaries)


class Policy(nn.Module):
    """Trainable policy over the engine's kernels (see the module docstring).

    `invariant=False` runs the same decoder on plain torch ops (`TorchBackend`) with ordinary autograd:
    the negative control of the parity tests and the baseline of the benchmark."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        max_model_len: int | None = None,
        master_dtype: torch.dtype = torch.float32,
        invariant: bool = True,
    ) -> None:
        super().__init__()
        self.spec = loaded.spec
        if self.spec.is_moe:
            raise ConfigError("model: the policy trains dense models only, not mixture-of-experts")
        self.block_size = config.kv_block_size
        dtype = DTYPES[resolve_dtype(config.dtype)]
        self.numerics = Numerics(dtype=dtype, batch_invariant=invariant, tile_rows=config.linear_tile_rows)
        # the engine's rotary table has max_model_len positions; the same length gives the same table
        limit = self.spec.max_position_embeddings
        self.max_model_len = min(max_model_len or config.max_model_len or limit, limit)
        backend = select_backend(self.numerics)  # the engine's choice of kernels for these numerics
        self._trainable = isinstance(backend, NativeBackend)
        # the kernels with a backward pass; plain torch ops are differentiable as they are
        self._ops: OpsBackend = backend
        if isinstance(backend, NativeBackend):
            self._ops = TrainableBackend(backend)
        for name, weight in apply_quantization(loaded.weights, config.quantization, dtype).items():
            if not isinstance(weight, torch.Tensor):
                raise ConfigError(
                    f"quantization: {name} is {config.quantization!r}-quantized; the policy trains float "
                    "weights, so load (and run the engine) with quantization='none'"
                )
            # as the engine computes it (its dtype), held in master_dtype
            _register(self, name, nn.Parameter(weight.to(dtype).to(master_dtype).clone()))

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, master_dtype: torch.dtype = torch.float32, invariant: bool = True
    ) -> Policy:
        """Load the model `config` names (its quantization must leave float weights)."""
        loaded = load_model(config.model, config.quantization)
        return cls(loaded, config, master_dtype=master_dtype, invariant=invariant)

    @classmethod
    def for_engine(
        cls, engine: Engine, *, master_dtype: torch.dtype = torch.float32, invariant: bool = True
    ) -> Policy:
        """A policy over the engine's current weights and numerics (copies: training never touches them)."""
        if not engine.config.batch_invariant:
            raise ConfigError("batch_invariant: the engine runs plain torch ops; parity needs invariant mode")
        return cls(
            engine.loaded, engine.config, max_model_len=engine.max_model_len, master_dtype=master_dtype,
            invariant=invariant,
        )  # fmt: skip

    # -- scoring -----------------------------------------------------------------------------------

    def score(
        self, sequences: Sequence[Sequence[int]], first: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Per sequence, the logprobs [len - first[i]] fp32 of its tokens first[i].. given their prefixes
        (first defaults to 1: every token but the first). Differentiable in the parameters. Each value
        equals the engine's logprob of that token bitwise, whatever else is in `sequences`."""
        firsts = [1] * len(sequences) if first is None else list(first)
        if len(firsts) != len(sequences):
            raise InvalidRequestError("first: need one entry per sequence", param="first")
        batch = pack(sequences, self.block_size, self.spec.vocab_size)
        rows: list[int] = []
        for index, (start, length, begin) in enumerate(zip(batch.starts, batch.lengths, firsts, strict=True)):
            if not 1 <= begin < length:
                raise InvalidRequestError(f"first[{index}]: {begin} is not in [1, {length})", param="first")
            if length > self.max_model_len:
                raise InvalidRequestError(
                    f"sequences[{index}]: {length} tokens exceed max_model_len {self.max_model_len}",
                    "sequences",
                )
            rows.extend(range(start + begin - 1, start + length - 1))  # row p predicts token p + 1
        flat_rows = torch.tensor(rows, dtype=torch.int64)
        values = self._token_logprobs(batch, flat_rows, batch.input_ids[flat_rows + 1])  # [R]
        return list(
            values.split([length - begin for length, begin in zip(batch.lengths, firsts, strict=True)])
        )

    def completion_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Logprobs [len(completion)] of each completion's tokens after its prompt (what the engine
        reports as a completion's `logprobs`)."""
        if len(prompts) != len(completions):
            raise InvalidRequestError("completions: need one per prompt", param="completions")
        sequences = [[*prompt, *completion] for prompt, completion in zip(prompts, completions, strict=True)]
        return self.score(sequences, [len(prompt) for prompt in prompts])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, L] (padding marked 0 in attention_mask [B, L], left or right) -> [B, L] fp32:
        logprob of each token given the tokens before it in its row; 0.0 at each row's first token and
        at padding. Padding never enters the model (rows are unpadded first)."""
        rows, firsts = unpad(input_ids, attention_mask)
        scored = self.score(rows)
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for index, (values, column) in enumerate(zip(scored, firsts, strict=True)):
            out[index, column + 1 : column + 1 + values.shape[0]] = values
        return out

    def _token_logprobs(self, batch: PackedBatch, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Logprobs [R] of targets[r] from flat row rows[r]'s logits."""
        dtype = self.numerics.dtype
        weights = {name: parameter.to(dtype) for name, parameter in self.named_parameters()}
        model = DecoderModel(self.spec, weights, self.numerics, self.max_model_len, ops=self._ops)
        spec = self.spec
        caches: list[KVCache] = []
        for _ in range(spec.num_layers):
            cache = new_kv_cache(batch.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim, dtype)
            caches.append(LayerKV(cache) if self._trainable else cache)
        hidden = model.forward(batch.input_ids, batch.positions, batch.meta, caches)[rows]  # [R, hidden]
        head = model.lm_head
        if isinstance(head, TrainableLinear):
            values: torch.Tensor = TokenLogprobsFn.apply(
                head.kernel(), CHUNK_ROWS, hidden, targets, head.weight_parts[0]
            )
            return values
        return log_softmax_rows(model.logits(hidden)).gather(1, targets[:, None]).squeeze(1)

    # -- weights for the engine --------------------------------------------------------------------

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> the weight as the engine computes it (its dtype), detached copies, for
        `Engine.update_weights`."""
        dtype = self.numerics.dtype
        return {name: p.detach().to(dtype).clone() for name, p in self.named_parameters()}

    def save_weights(self, directory: str | os.PathLike[str]) -> Path:
        """Write `engine_weights()` to `directory`/model.safetensors (for POST /update_weights); the
        file appears whole or not at all (written under a temporary name, then renamed)."""
        from safetensors.torch import save_file

        target_dir = Path(directory)
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / "model.safetensors"
        with tempfile.TemporaryDirectory(dir=target_dir) as work:
            partial = Path(work) / target.name
            save_file(self.engine_weights(), str(partial))
            os.replace(partial, target)
        return target


def _register(root: nn.Module, name: str, parameter: nn.Parameter) -> None:
    """Register `parameter` under its dotted HF name (nested modules), so state_dict keys are HF names."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, parameter)
