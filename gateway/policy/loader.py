"""Load a policy file into typed objects, or say exactly what is wrong and where.

Every failure is a `PolicyError` whose lines read `FILE: PATH: what was expected`, with PATH in
the user's own terms (`pools.long.backends[1].url`), so `gateway check` and a failed reload can
print it as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.policy.model import Policy
from gateway.wire.openai import loc_path


class PolicyError(Exception):
    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(f"{self.source}: {path}: {msg}" if path else f"{self.source}: {msg}"
                         for path, msg in self.problems)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate keys: YAML would silently keep the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1})", mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_mapping)


def load_policy(path: str | Path) -> Policy:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(source, [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    return parse_policy(text, source)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}: "
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(source, [("", f"not valid YAML: {where}{problem}")]) from None
    if not isinstance(data, dict):
        raise PolicyError(source, [("", "expected a mapping at the top level "
                                        "(models:, pools:, ...)")])
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, [_describe(e) for e in exc.errors(include_url=False)]) from None
    problems = policy.rule_errors()
    if problems:
        raise PolicyError(source, problems)
    return policy


def _describe(err: Any) -> tuple[str, str]:
    path = loc_path(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return path, "unknown key (a typo?); see docs/policy.md for the keys allowed here"
    if kind == "missing":
        return path, "required key is missing"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if path.endswith("architecture") and msg.startswith("architecture."):
        # ProfileError names the field inside the architecture; fold it into the path.
        field, _, msg = msg.removeprefix("architecture.").partition(": ")
        path = f"{path}.{field}"
    got = err.get("input")
    if kind not in ("value_error",) and not isinstance(got, dict | list):
        msg += f" (got {got!r})"
    return path, msg
