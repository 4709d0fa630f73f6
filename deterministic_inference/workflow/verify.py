"""``detinf verify``: grade two runs (directories or bundles) against each other.

Grades, checked in this order (the first that applies wins):

1. ``non_conformant_hardware``: the hardware digests of the fingerprints differ and a run used a
   non-portable path (its numerics are not ``portable``, or the two runs' numerics differ). When both
   runs computed in portable numerics (every rounding operation in kernels whose bits are fixed by their
   source) with equal numerics, other hardware cannot change a bit: the check passes, and the report
   says so in ``reasons`` and ``hardware.portable_numerics``.
2. ``non_conformant_software``: the software closure digest, the model digest or the engine numerics
   differ.
3. ``mismatch_outputs``: tokens, text or finish reasons differ, or logits / activations / engine trace
   differ under the comparison rules of run A's manifest (``determinism.compare``).
4. ``conformant``: none of the above.

Output comparisons run for every grade, so a report always says where outputs diverge. Both runs must
be complete and intact (`rundir.load_run_dir`); anything else is an error, never a grade.
``verify_report.json`` holds everything; ``verify_summary.txt`` is the human summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deterministic_inference import fingerprint
from deterministic_inference.workflow import compare
from deterministic_inference.workflow.closure import closure_differences
from deterministic_inference.workflow.rundir import RunDir, json_bytes, open_run

GRADES = ("conformant", "non_conformant_hardware", "non_conformant_software", "mismatch_outputs")


def verify_paths(path_a: Path, path_b: Path) -> dict[str, Any]:
    """The verify report of two run dirs or bundles."""
    with open_run(path_a) as run_a, open_run(path_b) as run_b:
        report = verify_runs(run_a, run_b)
    report["a"]["path"], report["b"]["path"] = str(path_a), str(path_b)
    return report


def verify_runs(a: RunDir, b: RunDir) -> dict[str, Any]:
    """Compare two loaded runs and grade them."""
    hardware = _hardware_check(a, b)
    software = _software_check(a, b)
    outputs = _output_checks(a, b)
    reasons: list[str] = []
    noted = hardware["differences"] + hardware["informational_differences"]
    if noted and hardware["portable_numerics"]:
        reasons.append(
            "hardware or ISA selection differs (" + "; ".join(noted[:3]) + ") but both runs computed in "
            "portable numerics with equal numerics: their bits do not depend on the CPU"
        )
    if not hardware["equal"] and not hardware["portable_numerics"]:
        grade = "non_conformant_hardware"
        reasons.append(
            "hardware fingerprints differ and a non-portable path was used: "
            + "; ".join(hardware["differences"][:3])
        )
    elif not software["equal"]:
        grade = "non_conformant_software"
        reasons.append("software differs: " + "; ".join(software["differences"][:3]))
    elif failing := [name for name, check in outputs.items() if check.get("graded") and not check["equal"]]:
        grade = "mismatch_outputs"
        reasons.append("outputs differ in: " + ", ".join(failing))
    else:
        grade = "conformant"
    return {
        "schema_version": 1,
        "kind": "detinf.verify_report",
        "grade": grade,
        "reasons": reasons,
        "a": _summary(a),
        "b": _summary(b),
        "requests_equal": a.bundle["requests_digest"] == b.bundle["requests_digest"],
        "hardware": hardware,
        "software": software,
        "outputs": outputs,
    }


def _summary(run: RunDir) -> dict[str, Any]:
    keys = ("run_id", "manifest_id", "lock_id", "requests_digest", "backend", "system_fingerprint")
    return {key: run.bundle.get(key) for key in keys}


def _hardware_check(a: RunDir, b: RunDir) -> dict[str, Any]:
    digest_a, digest_b = a.bundle["fingerprint"]["hardware"], b.bundle["fingerprint"]["hardware"]
    differences: list[str] = []
    if digest_a != digest_b:
        hw_a, hw_b = a.bundle.get("hardware"), b.bundle.get("hardware")
        if isinstance(hw_a, dict) and isinstance(hw_b, dict):
            differences = closure_differences(hw_a, hw_b)
        differences = differences or [f"hardware digest {digest_a} vs {digest_b}"]
    fp_a, fp_b = a.bundle["fingerprint"], b.bundle["fingerprint"]
    portable = fingerprint.is_portable(fp_a) and fingerprint.is_portable(fp_b)
    informational = closure_differences(
        {"isa_selection": fp_a.get("informational", {}).get("isa_selection")},
        {"isa_selection": fp_b.get("informational", {}).get("isa_selection")},
    )  # the hardware class is in `differences` already
    return {
        "equal": digest_a == digest_b, "a": digest_a, "b": digest_b, "differences": differences,
        "informational_differences": informational,
        "portable_numerics": portable and fp_a.get("numerics") == fp_b.get("numerics"),
    }  # fmt: skip


def _software_check(a: RunDir, b: RunDir) -> dict[str, Any]:
    fp_a, fp_b = a.bundle["fingerprint"], b.bundle["fingerprint"]
    differences = []
    for part in ("software", "model", "numerics"):
        if fp_a.get(part) != fp_b.get(part):
            differences.append(f"{part}: {fp_a.get(part)} vs {fp_b.get(part)}")
    closure_a = (a.read_json("run_log.json") or {}).get("runtime_closure")
    closure_b = (b.read_json("run_log.json") or {}).get("runtime_closure")
    details: list[str] = []
    if isinstance(closure_a, dict) and isinstance(closure_b, dict):
        details = closure_differences(closure_a.get("software", {}), closure_b.get("software", {}))
    if differences and details:
        differences[0] += f" ({details[0]})"
    return {"equal": not differences, "differences": differences, "closure_differences": details}


def _output_checks(a: RunDir, b: RunDir) -> dict[str, Any]:
    rules = a.manifest["determinism"]["compare"]
    tokens_a, tokens_b = a.tokens["sequences"], b.tokens["sequences"]
    trace_a, trace_b = a.read_json("captures/engine_trace.json"), b.read_json("captures/engine_trace.json")
    checks: dict[str, Any] = {"tokens": compare.compare_tokens(tokens_a, tokens_b, trace_a, trace_b)}
    checks["tokens"]["graded"] = True
    logits_a, logits_b = a.read_json("captures/logits.json"), b.read_json("captures/logits.json")
    checks["logits"] = _optional(rules["logits"]["rule"], logits_a, logits_b,
                                 lambda: compare.compare_logits(tokens_a, tokens_b, logits_a, logits_b,
                                                                rules["logits"]))
    acts_a, acts_b = a.read_json("captures/activations.json"), b.read_json("captures/activations.json")
    checks["activations"] = _optional(rules["activations"]["rule"], acts_a, acts_b,
                                      lambda: compare.compare_activations(acts_a, acts_b))
    checks["engine_trace"] = _optional(rules["engine_trace"]["rule"], trace_a, trace_b,
                                       lambda: compare.compare_traces(trace_a, trace_b))
    return checks


def _optional(rule: str, a: Any, b: Any, run: Any) -> dict[str, Any]:
    if rule == "ignore":
        return {"equal": True, "graded": False, "rule": rule, "status": "ignored by the compare rule"}
    if a is None or b is None:
        missing = "both runs" if a is None and b is None else ("run A" if a is None else "run B")
        return {"equal": True, "graded": False, "rule": rule, "status": f"not captured in {missing}"}
    result: dict[str, Any] = run()
    result["rule"] = rule
    result["graded"] = rule != "report"
    return result


def summary_text(report: dict[str, Any]) -> str:
    """verify_summary.txt: the grade, the reasons and the first divergences, one line each."""
    lines = [f"grade: {report['grade']}", f"A: {report['a'].get('path', '')} run {report['a']['run_id']}",
             f"B: {report['b'].get('path', '')} run {report['b']['run_id']}"]
    lines += [f"reason: {reason}" for reason in report["reasons"]]
    if not report["requests_equal"]:
        lines.append("note: the runs sent different requests (requests_digest differs)")
    outputs = report["outputs"]
    first = outputs["tokens"]["first_divergence"]
    if first:
        lines.append(
            f"first divergence: request {first['request_id']} choice {first['index']} step {first['step']}"
            f" token {first.get('token_a')} vs {first.get('token_b')}"
            f" (engine step {first.get('engine_step_a')} vs {first.get('engine_step_b')}): {first['reason']}"
        )
    logits = outputs["logits"]
    if "compared" in logits:
        lines.append(f"logits: {logits['bit_equal']}/{logits['compared']} bit-equal, max "
                     f"{logits['max_ulp']} ULP, "
                     f"mean {logits['mean_ulp']:.3g} ULP")
    activations = outputs["activations"]
    if activations.get("first_divergence"):
        where = activations["first_divergence"]
        lines.append(f"activations: first divergent layer {where['layer']} at {where['sequence_id']} "
                     f"position {where['position']} ({activations['differing_rows']} rows differ)")
    trace = outputs["engine_trace"]
    if trace.get("first_difference"):
        lines.append(f"engine trace: first difference at step index {trace['first_difference']['index']} "
                     f"({trace['steps_a']} vs {trace['steps_b']} steps)")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], output_dir: Path) -> tuple[Path, Path]:
    """Write verify_report.json and verify_summary.txt into `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    report_path, summary_path = output_dir / "verify_report.json", output_dir / "verify_summary.txt"
    report_path.write_bytes(json_bytes(report))
    summary_path.write_text(summary_text(report), encoding="utf-8")
    return report_path, summary_path
