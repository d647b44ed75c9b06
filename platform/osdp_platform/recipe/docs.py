"""The recipe reference, rendered from the schema (recipe/schema.py), so the README cannot drift from what the loader
accepts: every key with its type, bounds, default and the field's own description.

`make docs` (`python -m osdp_platform.recipe.docs --write README.md`) rewrites the README's block between
the markers; tests/platform/recipe/test_docs.py fails while that block is stale; `osdp-platform validate --explain`
prints the same reference in the terminal.
"""

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from osdp_platform.recipe.schema import Recipe
from osdp_platform.recipe.typetext import type_text

START = "<!-- recipe-reference:start -->"
END = "<!-- recipe-reference:end -->"
REGENERATE = "make docs"
_NOTE = (
    "<!-- generated from platform/osdp_platform/recipe/{schema,inputs,pool}.py: "
    f"edit the Field descriptions there, then run `{REGENERATE}` -->"
)


@dataclass(frozen=True)
class Key:
    path: str  # dotted, as an override names it: train.steps
    type: str
    default: str
    meaning: str


@dataclass(frozen=True)
class Section:
    name: str  # "" for the recipe's own keys
    meaning: str
    keys: list[Key]


def _yaml(value: Any) -> str:
    """A value as a recipe would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def _key(path: str, info: FieldInfo) -> Key:
    default = "required" if info.is_required() else f"`{_yaml(info.get_default(call_default_factory=True))}`"
    return Key(path, type_text(info.annotation, info.metadata), default, info.description or "")


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    ann = info.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def sections() -> list[Section]:
    """The recipe's own keys, then one section per sub-model, in schema order."""
    own: list[Key] = []
    nested: list[Section] = []
    for name, info in Recipe.model_fields.items():
        model = _section_model(info)
        if model is None:
            own.append(_key(name, info))
        else:
            keys = [_key(f"{name}.{key}", sub) for key, sub in model.model_fields.items()]
            nested.append(Section(name, info.description or "", keys))
    return [Section("", "keys beside the sections", own), *nested]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(values: Mapping[str, Any] | None = None) -> str:
    """The reference as markdown tables; with `values` (a recipe's model_dump), a column of that recipe's values."""
    lines: list[str] = []
    for section in sections():
        title = f"**`{section.name}`**" if section.name else "**top level**"
        header = ["key", "type", "default", *(["this recipe"] if values is not None else []), "meaning"]
        lines += [f"{title}: {section.meaning}", "", f"| {' | '.join(header)} |", "|---" * len(header) + "|"]
        for key in section.keys:
            cells = [f"`{key.path}`", key.type, key.default]
            if values is not None:
                cells.append(f"`{_yaml(_lookup(values, key.path))}`")
            cells.append(key.meaning)
            lines.append(f"| {' | '.join(_cell(c) for c in cells)} |")
        lines.append("")
    return "\n".join(lines)


def _lookup(values: Mapping[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return node


def readme_block() -> str:
    """What belongs between the markers, markers included."""
    return f"{START}\n{_NOTE}\n\n{render_markdown()}{END}"


def _span(text: str, path: Path) -> tuple[int, int]:
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no recipe reference block: put the lines {START} and {END} where it goes")
    return start, end + len(END)


def current_block(path: Path) -> str:
    text = path.read_text()
    start, end = _span(text, path)
    return text[start:end]


def write_readme(path: Path) -> bool:
    """Replace the block in `path` by the schema's; True if that changed the file."""
    text = path.read_text()
    start, end = _span(text, path)
    updated = text[:start] + readme_block() + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osdp_platform.recipe.docs", description=__doc__)
    parser.add_argument(
        "--write",
        metavar="README",
        type=Path,
        help=f"rewrite the block between {START} and {END} in this file (default: print the tables)",
    )
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(render_markdown())
        return 0
    changed = write_readme(args.write)
    print(f"{args.write}: recipe reference {'updated' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
