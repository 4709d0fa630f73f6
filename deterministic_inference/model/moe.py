"""The MLP of a decoder layer: the gated MLP, and the mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral).

Mixture of experts, per layer, for activations x [T, hidden]:

1. router logits in fp32 through the backend's fp32-output linear (the logits head's invariant GEMM);
2. `ops.moe_route`: each token's top-k experts (ties to the lower expert index) and weights, computed
   from that token's logits alone, listed in ascending expert index;
3. tokens grouped by expert: each routed expert runs its gated MLP once on the rows sent to it (the
   backend's row-invariant linears: a row's result does not depend on how many rows share the call, so
   the expert's load cannot change a token's bits);
4. `ops.moe_combine`: each token's weighted expert rows summed in ascending expert index (then the
   shared expert, gated by a sigmoid, where the model has one), in fp32, rounded once.

Expert weights stay as stored (a GGUF file's quantized experts are views on the memory map) and are
read only when a token is routed to them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.backend import OpsBackend, SharedExpert
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.weights import StoredWeight


class GatedMLP:
    """down(act(gate(x)) * up(x)), act SiLU or (Gemma's GeGLU) GELU-tanh; gate and up fused in one linear
    (stored fused as gate_up_proj: Phi-3)."""

    def __init__(
        self, ops: OpsBackend, weights: Mapping[str, StoredWeight], prefix: str, gelu_tanh: bool = False
    ) -> None:
        self.ops = ops
        self.activation = ops.gelu_tanh_mul if gelu_tanh else ops.silu_mul  # [T, 2I] -> [T, I]
        fused = f"{prefix}gate_up_proj.weight"
        gate_up = (fused,) if fused in weights else (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight")
        self.names = (*gate_up, f"{prefix}down_proj.weight")
        self.gate_up = ops.linear([weights[name] for name in gate_up])  # [2 * inter, hidden]
        self.down = ops.linear(weights[self.names[-1]])  # [hidden, inter]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down(self.activation(self.gate_up(x)))

    def weight_formats(self) -> dict[str, str]:
        """tensor name -> the format it is computed in."""
        formats = (*self.gate_up.formats, *self.down.formats)
        return dict(zip(self.names, formats, strict=True))

    def probe_linears(self, role: str = "") -> list[tuple[str, Linear]]:
        """(role, linear) of the fused gate/up and the down projection, roles prefixed by `role`."""
        return [(f"{role}gate_up", self.gate_up), (f"{role}down", self.down)]


class MoEBlock:
    """A mixture-of-experts MLP (see the module docstring for the order of operations)."""

    def __init__(
        self, spec: ModelSpec, weights: Mapping[str, StoredWeight], prefix: str, ops: OpsBackend
    ) -> None:
        self.ops = ops
        self.k = spec.num_experts_per_tok
        self.normalize = spec.norm_topk_prob
        self.router_name = f"{prefix}gate.weight"
        self.router = ops.logits_head(weights[self.router_name])  # [E, hidden] -> fp32 logits
        self.experts = [GatedMLP(ops, weights, f"{prefix}experts.{e}.") for e in range(spec.num_experts)]
        self.shared: GatedMLP | None = None
        self.shared_gate: Linear | None = None
        if spec.shared_expert_intermediate_size:
            self.shared = GatedMLP(ops, weights, f"{prefix}shared_expert.")
            self.shared_gate = ops.logits_head(weights[f"{prefix}shared_expert_gate.weight"])  # [1, hidden]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. A token's bits depend only on its own row: see the module doc."""
        tokens, k = x.shape[0], self.k
        ids, weights = self.summation_order(*self.ops.moe_route(self.router(x), k, self.normalize))
        flat = ids.reshape(-1)  # [T * k]: slot s = (token s // k, rank s % k)
        by_expert = torch.argsort(flat, stable=True)  # [T * k] slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        grouped = x[by_expert // k]  # [T * k, hidden]: each slot's token row, grouped by expert
        y = torch.empty_like(grouped)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                y[start : start + count] = expert(grouped[start : start + count])
                start += count
        rows = torch.empty_like(flat)
        rows[by_expert] = torch.arange(flat.numel())  # slot -> its row of y
        shared: SharedExpert | None = None
        if self.shared is not None and self.shared_gate is not None:
            shared = (self.shared(x), self.shared_gate(x)[:, 0])
        return self.ops.moe_combine(y, rows.view(tokens, k), weights, shared)

    def summation_order(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The order each token's expert outputs are summed in: as routed, ascending expert index. (One
        place to change it; the tests' negative control replaces it with a load-dependent order.)"""
        return ids, weights

    def weight_formats(self) -> dict[str, str]:
        """tensor name -> the format it is computed in (router and shared gate: their fp32-output GEMM's)."""
        formats = {self.router_name: self.router.formats[0]}
        for expert in self.experts:
            formats.update(expert.weight_formats())
        if self.shared is not None and self.shared_gate is not None:
            formats.update(self.shared.weight_formats())
            formats[self.router_name.replace("gate.weight", "shared_expert_gate.weight")] = (
                self.shared_gate.formats[0]
            )
        return formats

    def probe_linears(self) -> list[tuple[str, Linear]]:
        """(role, linear): the router, every expert's projections (the caller keeps one per format mix)
        and the shared expert's."""
        found = [("router", self.router)]
        for expert in self.experts:
            found += expert.probe_linears("expert_")
        if self.shared is not None and self.shared_gate is not None:
            found += [*self.shared.probe_linears("shared_"), ("shared_gate", self.shared_gate)]
        return found
