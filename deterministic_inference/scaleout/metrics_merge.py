"""/metrics of the replicated server: the router's own gauges plus every replica's exposition text,
each sample labelled `replica="<name>"` (Prometheus text format 0.0.4; plain Python, no Ray).

The replicas' texts come from the existing app's /metrics, whatever writes it; merging works on the text
(families keep their first HELP/TYPE, samples are relabelled), so it does not depend on how a replica
renders its metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "detinf"


@dataclass
class _Family:
    help_line: str | None = None
    type_line: str | None = None
    samples: list[str] = field(default_factory=list)


def relabel(sample: str, replica: str) -> str:
    """One sample line with `replica="<replica>"` as its first label."""
    label = f'replica="{_escape(replica)}"'
    head, space, rest = sample.partition(" ")
    brace = sample.find("{")
    if brace != -1 and brace < len(head):
        close = sample.rfind("}")
        inner = sample[brace + 1 : close]
        joined = f"{label},{inner}" if inner else label
        return f"{sample[:brace]}{{{joined}}}{sample[close + 1:]}"
    return f"{head}{{{label}}}{space}{rest}"


def merge_expositions(sections: Sequence[tuple[str, str]]) -> str:
    """One exposition text from (replica name, text) pairs: families in first-seen order, samples in
    section order, each labelled with its replica."""
    families: dict[str, _Family] = {}
    for replica, text in sections:
        current: _Family | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, _Family())
                if line.startswith("# HELP ") and current.help_line is None:
                    current.help_line = line
                elif line.startswith("# TYPE ") and current.type_line is None:
                    current.type_line = line
            elif not line.startswith("#"):
                if current is None:
                    current = families.setdefault(line.split("{", 1)[0].split(" ", 1)[0], _Family())
                current.samples.append(relabel(line, replica))
    lines: list[str] = []
    for family in families.values():
        lines.extend(line for line in (family.help_line, family.type_line) if line is not None)
        lines.extend(family.samples)
    return "\n".join(lines) + ("\n" if lines else "")


def gauge(name: str, help_text: str, samples: Sequence[tuple[dict[str, str], float]]) -> str:
    """One gauge family in exposition text (`detinf_` prefixed)."""
    full = f"{PREFIX}_{name}"
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} gauge"]
    for labels, value in samples:
        rendered = ",".join(f'{key}="{_escape(str(val))}"' for key, val in labels.items())
        number = str(int(value)) if float(value).is_integer() else repr(float(value))
        lines.append(f"{full}{{{rendered}}} {number}" if rendered else f"{full} {number}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
