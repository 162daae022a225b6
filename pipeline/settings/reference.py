"""docs/settings.md, made from the settings themselves (a test keeps the
file equal to what this renders): ``python -m pipeline.settings.reference``."""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.settings.kinds import KINDS
from pipeline.settings.leaves import Leaf, leaves

HEADER = """# Settings

Every setting is a flag, an environment variable and a key of a TOML file
given with `--config FILE` (or `MMPIPE_CONFIG`); the key is the flag's name,
with dashes or underscores (`max-inflight = 32`). Flags beat variables beat
the file beat the defaults. A list takes repeated flags or commas (paths:
one a flag, `:` between them in a variable); `--vllm-arg KEY=VALUE` repeats,
and in a file is a table (`[vllm-arg]`). One file may serve every process of
a deployment: each skips the keys it does not take, and refuses a key that
no process takes. `mmpipe up` hands every process it starts its resolved
settings (in `MMPIPE_SETTINGS_JSON`), so what `up` is given reaches each
process that uses it.

Generated from the code by `python -m pipeline.settings.reference`; the
column "of" says which commands take a setting.
"""


def render() -> str:
    groups: dict[str, dict[str, tuple[Leaf, list[str]]]] = {}
    for name, kind in KINDS.items():
        for leaf in leaves(kind):
            rows = groups.setdefault(leaf.group, {})
            if leaf.flag in rows:
                rows[leaf.flag][1].append(name)
            else:
                rows[leaf.flag] = (leaf, [name])
    out = [HEADER]
    for group, rows in groups.items():
        out += [
            f"## {group[0].upper()}{group[1:]}",
            "",
            "| flag | variable | default | of | what |",
            "|---|---|---|---|---|",
        ]
        for flag, (leaf, kinds) in rows.items():
            text = leaf.info.help.replace("|", "\\|")
            if leaf.info.choices:
                text += f" ({', '.join(leaf.info.choices)})"
            default = leaf.shown(leaf.default).replace("|", "\\|")
            out.append(f"| `--{flag}` | `{leaf.env}` | `{default}` | {', '.join(kinds)} | {text} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    target.write_text(render())
    print(target)
