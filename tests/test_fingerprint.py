"""The determinism fingerprint: hardware class, software closure, engine fingerprint."""

from __future__ import annotations

from deterministic_inference import fingerprint
from deterministic_inference.workflow.canonical import is_digest

CPUINFO_A = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 2000.000
cpu cores\t: 56
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
cpu MHz\t\t: 3800.000
flags\t\t: fpu
"""


def test_hardware_fingerprint_reads_class_not_counts() -> None:
    fp = fingerprint.hardware_fingerprint(CPUINFO_A)
    assert fp["vendor"] == "GenuineIntel"
    assert fp["model_name"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert fp["isa"]["avx512_bf16"] is True and fp["isa"]["amx_bf16"] is True
    assert fp["isa"]["avx512_fp16"] is False
    faster = CPUINFO_A.replace("2000.000", "3100.000").replace("56", "8")
    assert fingerprint.hardware_fingerprint(faster) == fp


def test_hardware_fingerprint_changes_with_isa() -> None:
    without_amx = CPUINFO_A.replace(" amx_tile amx_bf16", "")
    assert fingerprint.digest(fingerprint.hardware_fingerprint(without_amx)) != fingerprint.digest(
        fingerprint.hardware_fingerprint(CPUINFO_A)
    )


def test_this_machine_has_a_hardware_class() -> None:
    fp = fingerprint.hardware_fingerprint()
    assert fp["arch"] and fp["vendor"] and fp["model_name"]
    assert fingerprint.hardware_fingerprint() == fp


def test_software_closure_is_stable() -> None:
    base = fingerprint.software_closure()
    assert base == fingerprint.software_closure()
    assert base["torch"]["version"].startswith("2.")
    names = [name for name, _ in base["distributions"]]
    assert names == sorted(names) and "torch" in names
    assert is_digest(base["torch"]["build_config_digest"])
    assert "env" not in base and "cpu_capability" not in base["torch"]  # ISA selection: informational


def test_isa_selection_records_kernel_env_not_threads() -> None:
    changed = fingerprint.isa_selection({"ATEN_CPU_CAPABILITY": "avx2", "DETINF_KERNEL_MARCH": "x86-64"})
    assert changed["env"] == {"ATEN_CPU_CAPABILITY": "avx2"} and changed["kernel_march"] == "x86-64"
    assert fingerprint.isa_selection({"OMP_NUM_THREADS": "3"}) == fingerprint.isa_selection({})


def test_engine_and_system_fingerprint() -> None:
    model = "sha256:" + "ab" * 32
    fp = fingerprint.engine_fingerprint(model, {"dtype": "float32", "batch_invariant": True}, portable=True)
    assert set(fp) == {"model", "numerics", "software", "hardware", "informational"}
    assert fp["numerics"]["portable"] is True and "isa" not in fp["numerics"]
    assert is_digest(fp["software"]) and is_digest(fp["hardware"])
    assert set(fp["informational"]) == {"hardware", "isa_selection"}
    short = fingerprint.system_fingerprint(fp)
    assert short.startswith("detinf-") and len(short) == len("detinf-") + 16
    assert fingerprint.system_fingerprint(dict(fp, numerics={"dtype": "bfloat16"})) != short
    assert fingerprint.system_fingerprint(fp) == short


def test_portable_fingerprint_leaves_the_cpu_out() -> None:
    """Portable numerics: another CPU (hardware digest, informational details) keeps the system
    fingerprint; a non-portable path puts the ISA into the numerics and the hardware into the bits."""
    model = "sha256:" + "cd" * 32
    portable = fingerprint.engine_fingerprint(model, {"dtype": "bfloat16"}, portable=True)
    other_cpu = dict(portable, hardware="sha256:" + "0" * 64, informational={})
    assert fingerprint.system_fingerprint(other_cpu) == fingerprint.system_fingerprint(portable)
    plain = fingerprint.engine_fingerprint(model, {"dtype": "bfloat16"}, portable=False)
    assert plain["numerics"]["portable"] is False and set(plain["numerics"]["isa"]) == {"cpu", "selection"}
    moved = dict(plain, hardware="sha256:" + "0" * 64)
    assert fingerprint.system_fingerprint(moved) != fingerprint.system_fingerprint(plain)
