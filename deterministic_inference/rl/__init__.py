"""On-policy RL with the engine: a trainable policy whose logprobs equal the sampler's, bit for bit.

`Policy` (policy.py) is a `torch.nn.Module` over the engine's own decoder and kernels (backend.py,
functions.py: the kernels as forward, plain torch math as backward); `Engine.update_weights` takes its
weights back (`Policy.engine_weights`, or `Policy.save_weights` + POST /update_weights).
"""

from deterministic_inference.rl.policy import Policy

__all__ = ["Policy"]
