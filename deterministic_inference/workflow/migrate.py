"""Read manifests of the seed's vLLM-based tool (``kind: vllm.deterministic_inference_manifest``).

Such a manifest (after its own ``x_base_manifest`` chain is merged) describes a run against an
OpenAI-compatible endpoint. `from_seed_manifest` maps every field that has a meaning here to a detinf
manifest and returns one warning line for each field it does not use, so nothing is dropped silently.

Mapped: metadata; ``runtime.execution.{base_url,timeout_seconds}`` (backend becomes
``openai_compatible``); ``runtime.env`` and ``runtime.network_policy``; the served model name from
``vllm.engine_args.model`` (or ``model.weights.source.repo``); ``inference.n_prompts``, the request
template (kind, sampling, stop); ``inference.batching.concurrency``; ``capture.tokens`` and
``capture.logits.enabled``; the ``determinism.compare`` rules (``absrel`` with zero tolerances is
``exact``); ``hardware.constraints.cpu_arch``; ``outputs.directory`` and ``outputs.golden.enabled``.
Everything else (GPU constraints, CUDA / vLLM stacks, wheel digests, server-side engine arguments) is
about a server this tool does not control and gets a warning. The seed's prompts are not shipped, so
the run uses the built-in reference prompts (also a warning).
"""

from __future__ import annotations

import re
from typing import Any

SEED_MANIFEST_KIND = "vllm.deterministic_inference_manifest"
SEED_LOCK_KIND = "vllm.deterministic_inference_lock"
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "n", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "ignore_eos")
_REASONS = {
    "artifacts": "the seed's artifact store and lock are not used; run `detinf lock` to make a detinf lock",
    "software_stack": "the endpoint's software is recorded from its responses, not pinned here",
    "cuda_stack": "CUDA settings belong to the GPU server, not to this client",
    "vllm": "vLLM server settings belong to the endpoint, not to this client",
    "hardware": "GPU hardware constraints do not apply; the endpoint's fingerprint is recorded",
    "model": "model files live on the endpoint and are not hashed locally",
    "runtime.threads": "thread settings belong to the endpoint",
    "runtime.locale": "locale is not used by the client",
    "runtime.execution": "not used by the detinf client",
    "inference.batching": "server-side scheduling belongs to the endpoint; requests go in dataset order",
    "capture": "not available from an OpenAI-compatible endpoint",
    "determinism": "not used by detinf verify",
    "outputs": "not used by detinf",
}


def from_seed_manifest(seed: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A detinf manifest (before defaults) and one warning line per seed field left unmapped."""
    handled: set[str] = {"schema_version", "kind"}
    result: dict[str, Any] = {"schema_version": 1, "kind": "detinf.manifest"}
    result["metadata"] = _metadata(seed, handled)
    result["model"] = {"source": {"type": "remote", "name": _served_model(seed, handled)}, "files": []}
    result["runtime"] = _runtime(seed, handled)
    result["inference"] = _inference(seed, handled)
    result["capture"] = _capture(seed, handled)
    result["determinism"] = {"compare": _compare(seed, handled)}
    result["hardware"] = _hardware(seed, handled)
    result["outputs"] = _outputs(seed, handled)
    unmapped = _unhandled(seed, handled, "")
    warnings = [f"seed manifest: {path}: not mapped ({reason})" for path, reason in unmapped]
    warnings.append("seed manifest: inference: no prompt dataset is shipped with it; using "
                    "builtin:reference_prompts")
    return result, warnings


def _take(seed: dict[str, Any], path: str, handled: set[str]) -> Any:
    value: Any = seed
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    handled.add(path)
    return value


def _metadata(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    name = _take(seed, "metadata.name", handled) or "seed-manifest"
    metadata["name"] = re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-._") or "seed-manifest"
    for key in ("description", "created_at"):
        value = _take(seed, f"metadata.{key}", handled)
        if isinstance(value, str):
            metadata[key] = value
    owners = _take(seed, "metadata.owners", handled)
    if isinstance(owners, list):
        metadata["owners"] = [str(owner) for owner in owners]
    return metadata


def _served_model(seed: dict[str, Any], handled: set[str]) -> str:
    name = _take(seed, "vllm.engine_args.model", handled)
    repo = _take(seed, "model.weights.source.repo", handled)
    return str(name or repo or "default")


def _runtime(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    execution: dict[str, Any] = {"backend": "openai_compatible"}
    _take(seed, "runtime.execution.backend", handled)
    base_url = _take(seed, "runtime.execution.base_url", handled)
    if isinstance(base_url, str):
        execution["base_url"] = base_url
    timeout = _take(seed, "runtime.execution.timeout_seconds", handled)
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        execution["timeout_seconds"] = timeout
    execution["model"] = _served_model(seed, set())
    runtime: dict[str, Any] = {"execution": execution}
    env = _take(seed, "runtime.env", handled)
    if isinstance(env, dict):
        runtime["env"] = {str(key): str(value) for key, value in env.items()}
    policy = _take(seed, "runtime.network_policy", handled)
    if policy in ("offline_required", "online_allowed"):
        runtime["network_policy"] = policy
    return runtime


def _inference(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    inference: dict[str, Any] = {"n_prompts": _take(seed, "inference.n_prompts", handled) or 1}
    template: dict[str, Any] = {}
    kind = _take(seed, "inference.request_template.kind", handled)
    if kind in ("completion", "chat"):
        template["kind"] = kind
    sampling = {}
    for key in _SAMPLING_KEYS:
        value = _take(seed, f"inference.request_template.sampling.{key}", handled)
        if value is not None:
            sampling[key] = value
    template["sampling"] = sampling
    stop = {}
    for ours, theirs in (("sequences", "sequences"), ("token_ids", "token_ids")):
        value = _take(seed, f"inference.request_template.stop.{theirs}", handled)
        if isinstance(value, list):
            stop[ours] = value
    template["stop"] = stop
    inference["request_template"] = template
    batching: dict[str, Any] = {"policy": "fixed"}
    _take(seed, "inference.batching.policy", handled)
    concurrency = _take(seed, "inference.batching.concurrency", handled)
    if isinstance(concurrency, int) and not isinstance(concurrency, bool):
        batching["concurrency"] = concurrency
    if _take(seed, "inference.batching.fixed_request_order", handled) is False:
        handled.discard("inference.batching.fixed_request_order")
    inference["batching"] = batching
    return inference


def _capture(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    _take(seed, "capture.tokens", handled)
    logits_enabled = bool(_take(seed, "capture.logits.enabled", handled))
    scope = _take(seed, "capture.logits.scope", handled)
    top_k = 0 if scope in (None, "chosen_only") else 5
    for key in ("activations.enabled", "engine_trace.enabled"):
        if _take(seed, f"capture.{key}", handled):
            handled.discard(f"capture.{key}")  # asked for but impossible: warn
    return {"tokens": True, "logits": {"enabled": logits_enabled, "top_k": top_k},
            "activations": {"enabled": False}, "engine_trace": {"enabled": False}}


def _compare(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    compare: dict[str, Any] = {}
    for name in ("tokens", "logits", "activations", "engine_trace"):
        rule = _take(seed, f"determinism.compare.{name}", handled)
        if not isinstance(rule, dict):
            continue
        if rule.get("rule") == "exact" or (
            rule.get("rule") == "absrel" and not rule.get("atol") and not rule.get("rtol")
        ):
            compare[name] = {"rule": "exact"}
        else:
            handled.discard(f"determinism.compare.{name}")
    return compare


def _hardware(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    arch = _take(seed, "hardware.constraints.cpu_arch", handled)
    return {"constraints": {"arch": [arch]}} if isinstance(arch, str) and arch else {}


def _outputs(seed: dict[str, Any], handled: set[str]) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    directory = _take(seed, "outputs.directory", handled)
    if isinstance(directory, str) and directory:
        outputs["directory"] = directory
    golden = _take(seed, "outputs.golden.enabled", handled)
    if isinstance(golden, bool):
        outputs["golden"] = {"enabled": golden}
    return outputs


def _unhandled(value: Any, handled: set[str], prefix: str) -> list[tuple[str, str]]:
    """(path, reason) for every meaningful seed field that no mapping consumed, at the shallowest level."""
    found: list[tuple[str, str]] = []
    if not isinstance(value, dict):
        return found
    for key in sorted(value):
        path = f"{prefix}.{key}" if prefix else key
        if path in handled or _empty(value[key]):
            continue
        if any(item.startswith(path + ".") for item in handled):
            found.extend(_unhandled(value[key], handled, path))
        else:
            found.append((path, _reason(path)))
    return found


def _reason(path: str) -> str:
    best = ""
    for prefix in _REASONS:
        if (path == prefix or path.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return _REASONS.get(best, "not used by detinf")


def _empty(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}
