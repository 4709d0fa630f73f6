"""Manifests: schema errors (one line: file, JSON path, fix), inheritance, YAML, defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.manifest import load_manifest
from tests.workflow.helpers import detinf, write_json

UNSET = "sha256:unset"


def minimal(**overrides: Any) -> dict[str, Any]:
    """The smallest valid manifest (default model, digest left unset)."""
    document: dict[str, Any] = {
        "schema_version": 1,
        "kind": "detinf.manifest",
        "metadata": {"name": "minimal"},
        "model": {"source": {"type": "default"},
                  "files": [{"path": "model.gguf", "digest": UNSET, "role": "weights"}]},
        "inference": {"n_prompts": 2},
    }
    document.update(overrides)
    return document


BAD_MANIFESTS = [
    ("wrong type", {"inference": {"n_prompts": "3"}}, "$.inference.n_prompts: '3' is not of type integer"),
    ("n_prompts zero", {"inference": {"n_prompts": 0}}, "$.inference.n_prompts: 0 is below the minimum 1"),
    ("n_prompts above dataset", {"inference": {"n_prompts": 101}}, "$.inference.n_prompts: 101 is more than"),
    ("unknown kind", {"kind": "vllm.other"}, "$.kind: 'vllm.other' is not an accepted value"),
    ("unknown field", {"engine": {"dtyp": "float32"}}, "$.engine.dtyp: unknown field"),
    ("bad enum", {"engine": {"dtype": "fp16"}}, "$.engine.dtype: 'fp16' is not an accepted value"),
    ("bad digest", {"model": {"source": {"type": "default"}, "files": [{"path": "m", "digest": "md5:1"}]}},
     "$.model.files[0].digest"),
    ("bad source", {"model": {"source": {"type": "path"}}}, "$.model.source: {'type': 'path'} matches none"),
    ("missing name", {"metadata": {}}, "$.metadata.name: required field is missing"),
    ("tile rows zero", {"engine": {"linear_tile_rows": 0}}, "$.engine.linear_tile_rows"),
    ("bad quantization", {"engine": {"quantization": "q4_0"}}, "$.engine.quantization: 'q4_0' is not"),
    ("bad kv cache dtype", {"engine": {"kv_cache_dtype": "q4_0"}}, "$.engine.kv_cache_dtype: 'q4_0' is not"),
    ("bad numerics", {"engine": {"numerics": "fast"}}, "$.engine.numerics: 'fast' is not"),
    ("bad kv size", {"engine": {"kv_cache_memory": "2 parsecs"}}, "$.engine.kv_cache_memory"),
    ("two kv sizes", {"engine": {"kv_cache_memory": "1GiB", "num_kv_blocks": 8}}, "set only one"),
]


@pytest.mark.parametrize(("label", "change", "expected"), BAD_MANIFESTS, ids=[b[0] for b in BAD_MANIFESTS])
def test_bad_manifest_is_one_clear_line(
    tmp_path: Path, label: str, change: dict[str, Any], expected: str
) -> None:
    path = write_json(tmp_path / "bad.json", minimal(**change))
    result = detinf("lock", "--config", path)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert str(path) in lines[0] and expected in lines[0] and "fix:" in lines[0], lines[0]
    assert result.out == ""


def test_old_attention_kv_tile_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """Manifests from before ops revision 3 name a key tile; they still load, with one warning line."""
    path = write_json(tmp_path / "old.json", minimal(engine={"attention_kv_tile": 64}))
    manifest = load_manifest(path)
    assert "attention_kv_tile" not in manifest.data["engine"]
    assert [w for w in manifest.warnings if "$.engine.attention_kv_tile is ignored" in w]


def test_inheritance_cycle_is_one_line(tmp_path: Path) -> None:
    write_json(tmp_path / "a.json", {"x_base_manifest": "b.json", **minimal()})
    write_json(tmp_path / "b.json", {"x_base_manifest": "c.json"})
    write_json(tmp_path / "c.json", {"x_base_manifest": "a.json"})
    result = detinf("run", "--config", tmp_path / "a.json")
    assert result.code == 2
    line = result.err.strip()
    assert "\n" not in line and "inheritance cycle" in line
    assert all(name in line for name in ("a.json", "b.json", "c.json"))


def test_invalid_json_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"schema_version": 1,,}')
    result = detinf("lock", "--config", tmp_path / "broken.json")
    assert result.code == 2 and "invalid JSON at line 1" in result.err and result.err.count("\n") == 1
    missing = detinf("lock", "--config", tmp_path / "absent.json")
    assert missing.code == 2 and "no such manifest file" in missing.err


def test_deep_merge_inheritance(tmp_path: Path) -> None:
    sampling = {"temperature": 0.7, "seed": 3}
    base = minimal(inference={"n_prompts": 5, "request_template": {"sampling": sampling}})
    (tmp_path / "base").mkdir()
    write_json(tmp_path / "base" / "base.json", base)
    child = {"x_base_manifest": "base/base.json", "metadata": {"name": "child"},
             "inference": {"request_template": {"sampling": {"seed": 9}}}}
    manifest = load_manifest(write_json(tmp_path / "child.json", child))
    sampling = manifest.data["inference"]["request_template"]["sampling"]
    assert (sampling["temperature"], sampling["seed"]) == (0.7, 9)  # merged, not replaced
    assert manifest.data["inference"]["n_prompts"] == 5 and manifest.name == "child"
    assert [path.name for path in manifest.chain] == ["child.json", "base.json"]
    assert "x_base_manifest" not in manifest.data


def test_lists_replace_instead_of_merging(tmp_path: Path) -> None:
    write_json(tmp_path / "base.json", minimal(inference={"n_prompts": 2, "request_template": {
        "stop": {"sequences": ["a", "b"]}}}))
    write_json(tmp_path / "child.json", {"x_base_manifest": "base.json",
                                         "inference": {"request_template": {"stop": {"sequences": ["c"]}}}})
    data = load_manifest(tmp_path / "child.json").data
    assert data["inference"]["request_template"]["stop"]["sequences"] == ["c"]


def test_yaml_is_accepted_and_ids_ignore_spelled_out_defaults(tmp_path: Path) -> None:
    yaml_text = """
schema_version: 1
kind: detinf.manifest
metadata: {name: minimal, created_at: 2026-02-21}
model:
  source: {type: default}
  files:
    - {path: model.gguf, digest: "sha256:unset", role: weights}
inference:
  n_prompts: 2
"""
    (tmp_path / "m.yaml").write_text(yaml_text)
    from_yaml = load_manifest(tmp_path / "m.yaml")
    assert from_yaml.data["metadata"]["created_at"] == "2026-02-21"
    json_doc = minimal(metadata={"name": "minimal", "created_at": "2026-02-21"})
    json_doc["engine"] = {"dtype": "auto", "batch_invariant": True}  # defaults written out
    json_doc["runtime"] = {"network_policy": "offline_required"}
    assert load_manifest(write_json(tmp_path / "m.json", json_doc)).manifest_id == from_yaml.manifest_id
    assert from_yaml.default_lock_path().name == "m.lock.json"


def test_later_engine_fields_keep_old_ids_at_their_defaults(tmp_path: Path) -> None:
    """quantization, kv_cache_memory and kv_cache_dtype came after schema version 1: a manifest without
    them (as written before) and one spelling out their defaults share the id; other values change it."""
    old = load_manifest(write_json(tmp_path / "old.json", minimal()))
    assert old.data["engine"]["quantization"] == "auto" and old.data["engine"]["kv_cache_memory"] is None
    assert old.data["engine"]["kv_cache_dtype"] == "auto" and old.data["engine"]["numerics"] == "portable"
    defaults = {
        "quantization": "auto", "kv_cache_memory": None, "kv_cache_dtype": "auto", "numerics": "portable"
    }
    spelled = minimal(engine=defaults)
    assert load_manifest(write_json(tmp_path / "spelled.json", spelled)).manifest_id == old.manifest_id
    for engine in (
        {"quantization": "none"},
        {"kv_cache_memory": "2GiB"},
        {"kv_cache_memory": 4096},
        {"kv_cache_dtype": "q8_0"},
        {"numerics": "native"},
    ):
        changed = load_manifest(write_json(tmp_path / "changed.json", minimal(engine=engine)))
        assert changed.manifest_id != old.manifest_id, engine


def test_changed_setting_changes_the_id(tmp_path: Path) -> None:
    first = load_manifest(write_json(tmp_path / "a.json", minimal()))
    changed = minimal(inference={"n_prompts": 2, "request_template": {"sampling": {"seed": 1}}})
    assert load_manifest(write_json(tmp_path / "b.json", changed)).manifest_id != first.manifest_id


def test_remote_model_needs_the_openai_backend(tmp_path: Path) -> None:
    document = minimal(model={"source": {"type": "remote", "name": "m"}})
    with pytest.raises(WorkflowError, match=r"\$\.runtime\.execution\.backend"):
        load_manifest(write_json(tmp_path / "r.json", document))


def test_example_configs_are_valid() -> None:
    configs = Path(__file__).resolve().parents[2] / "configs"
    paths = sorted(configs.glob("*.json")) + sorted(configs.glob("*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        load_manifest(path)


def test_kv_cache_dtype_reaches_the_engine_config(tmp_path: Path) -> None:
    from deterministic_inference.workflow.artifacts import ModelLocation
    from deterministic_inference.workflow.backend_engine import engine_config_for

    for value in ("auto", "q8_0"):
        document = minimal(engine={"kv_cache_dtype": value})
        manifest = load_manifest(write_json(tmp_path / f"{value}.json", document))
        config = engine_config_for(manifest.data, ModelLocation(engine_path=None, root=None))
        assert config.kv_cache_dtype == value


def test_numerics_reaches_the_engine_config(tmp_path: Path) -> None:
    from deterministic_inference.workflow.artifacts import ModelLocation
    from deterministic_inference.workflow.backend_engine import engine_config_for

    for value in ("portable", "native"):
        document = minimal(engine={"numerics": value})
        manifest = load_manifest(write_json(tmp_path / f"{value}.json", document))
        config = engine_config_for(manifest.data, ModelLocation(engine_path=None, root=None))
        assert config.numerics_mode == value
