"""Reading policy documents: the shipped presets, files, and strict YAML parsing.

The presets are YAML files in ``kvpolicy/policies/``; they are listed here rather
than in ``load.py`` because a missing file's message offers the closest preset name, and
``ModelPolicy.from_yaml`` (schema.py, which ``load.py`` builds on) reads files too.
YAML is parsed by a SafeLoader that refuses duplicate keys, and a parse error quotes the
line it stopped at.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..errors import PolicyError


def presets_dir():
    """The folder of the shipped presets (a ``Traversable``)."""
    return resources.files("kvpolicy.policies")


def list_presets() -> tuple[str, ...]:
    """Names of the presets shipped in ``kvpolicy/policies/``."""
    return tuple(
        sorted(
            p.name[: -len(".yaml")] for p in presets_dir().iterdir() if p.name.endswith(".yaml")
        )
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML would keep the last one silently."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key: construct_mapping reports it properly
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first set on line {first + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def parse_yaml(text: str, source: str) -> Any:
    """The document in ``text``; ``PolicyError`` naming ``source`` if it is empty or does
    not parse."""
    if not text.strip():
        raise PolicyError(f"{source}: empty policy file")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        raise PolicyError(f"{source}: cannot parse YAML {_yaml_problem(exc, text)}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: cannot parse YAML: {exc}") from None
    if data is None:  # only comments
        raise PolicyError(f"{source}: empty policy file (nothing but comments)")
    return data


def _yaml_problem(exc: yaml.MarkedYAMLError, text: str) -> str:
    """Where the parser stopped and why, quoting the line (and the line of the construct it
    was reading, e.g. an unclosed bracket, when that is elsewhere)."""
    lines = text.splitlines()

    def quote(mark: Any) -> str:
        shown = lines[mark.line].strip() if mark.line < len(lines) else ""
        return f"line {mark.line + 1}, column {mark.column + 1}" + (f": {shown!r}" if shown else "")

    mark = exc.problem_mark or exc.context_mark
    if mark is None:
        return f": {exc.problem or exc.context or exc}"
    message = f"at {quote(mark)}: {exc.problem or exc.context}"
    if exc.context and exc.context_mark is not None and exc.context_mark.line != mark.line:
        message += f" ({exc.context} started at {quote(exc.context_mark)})"
    return message


def read_file(path: Path) -> str:
    """The text of a policy file; ``PolicyError`` (offering a close preset name) if it
    cannot be read."""
    if not path.exists():
        presets = list_presets()
        close = difflib.get_close_matches(path.name, presets, n=1)
        hint = f"did you mean the preset '{close[0]}'? " if close else ""
        raise PolicyError(
            f"{path}: policy file not found; {hint}give a path to a YAML file or a preset "
            f"name ({', '.join(presets)})"
        )
    if path.is_dir():
        raise PolicyError(f"{path}: is a directory, not a policy file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read the policy file: {exc}") from None


def text_or_file(text_or_path: str | Path, label: str) -> tuple[str, str]:
    """Text itself, or the contents of a file. A ``str`` on one line that does not start
    a flow mapping is a path; serialized policies span many lines."""
    if isinstance(text_or_path, Path):
        return read_file(text_or_path), str(text_or_path)
    if not isinstance(text_or_path, str):
        raise PolicyError(f"expected YAML/JSON text or a path, got {type(text_or_path).__name__}")
    one_line = "\n" not in text_or_path.strip()
    if one_line and text_or_path.strip() and not text_or_path.lstrip().startswith("{"):
        return read_file(Path(text_or_path)), text_or_path
    return text_or_path, label
