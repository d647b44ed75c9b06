"""Load a recipe: YAML (OmegaConf: interpolation, `extends`, key=value overrides) -> validated Recipe."""

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from osdp_planners.errors import UserError, UserErrors
from osdp_platform.recipe.schema import FieldProblem, Recipe
from osdp_platform.recipe.typetext import type_text

MAX_EXTENDS_DEPTH = 8


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's finding as `line L, column C: problem` (its own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else str(problem)


def _load_yaml(path: Path, depth: int = 0, extended_by: Path | None = None) -> DictConfig:
    """Read one recipe file, merged over the base recipe it `extends` (a path relative to it)."""
    if not path.is_file():
        what = "is a folder, not a recipe file" if path.is_dir() else "does not exist"
        if extended_by is not None:
            raise UserError(
                "extends", str(path), f"{what} (named by {extended_by})", f"fix `extends:` in {extended_by}"
            )
        raise UserError("recipe", str(path), what, "pass the path of a recipe YAML file")
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        raise UserError("recipe", str(path), f"is not valid YAML: {_yaml_problem(exc)}", "fix the YAML there") from None
    except (OmegaConfBaseException, ValueError, OSError) as exc:
        text = " ".join(str(exc).split())[:200]
        raise UserError("recipe", str(path), f"cannot be read as YAML ({text})", "pass a recipe YAML file") from None
    if not isinstance(cfg, DictConfig):
        raise UserError("recipe", str(path), "must be a mapping of sections", "start with `model:` etc.")
    base = cfg.pop("extends", None)
    if base is None:
        return cfg
    if depth >= MAX_EXTENDS_DEPTH:
        raise UserError("extends", base, f"chain is too deep (a cycle?) at {path}", "extend at most 8 levels")
    base_cfg = _load_yaml((path.parent / str(base)).resolve(), depth + 1, path)
    return OmegaConf.merge(base_cfg, cfg)  # type: ignore[return-value]


def _apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UserError("override", item, "is not key=value", "write it as section.key=value, e.g. train.steps=5")
    for item in overrides:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))  # type: ignore[assignment]
        except yaml.YAMLError as exc:
            problem = f"its value is not valid YAML ({_yaml_problem(exc)})"
            raise UserError("override", item, problem, "quote the value, or close its brackets") from None
        except OmegaConfBaseException as exc:
            problem = str(exc).splitlines()[0]
            raise UserError("override", item, problem, "check the key=value syntax") from None
    return cfg


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section that `loc` points into, for 'did you mean' style fixes."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _fix_for(err: ErrorDetails) -> str:
    kind = err["type"]
    loc = tuple(err["loc"])
    if kind == "extra_forbidden":
        return f"remove it; valid keys here: {', '.join(_fields_at(loc))}"
    if kind == "missing":
        return f"add {'.'.join(str(p) for p in loc)} to the recipe (`osdp-platform validate --explain` lists the keys)"
    if kind in ("literal_error", "enum"):
        return "use one of the values listed above"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        return "give a value of the type named above"
    if kind.startswith(("greater_than", "less_than")):
        return "give a value within the bound named above"
    return "see `osdp-platform validate --explain` for what the key takes"


def _union_key(loc: tuple[str, ...]) -> tuple[str, FieldInfo] | None:
    """The key an error's loc goes past: pydantic tags each member of a union (`constrained-int`,
    `literal['auto']`) and reports every member's error, for the one value the user wrote."""
    model: type[BaseModel] = Recipe
    for i, part in enumerate(loc):
        info = model.model_fields.get(part)
        if info is None:
            return None
        ann = info.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return (".".join(loc[: i + 1]), info) if i + 1 < len(loc) else None
        model = ann
    return None


def _to_user_errors(source: str, exc: ValidationError) -> UserErrors:
    errors = []
    unions: set[str] = set()
    for err in exc.errors():
        found = err.get("ctx", {}).get("error")
        if isinstance(found, FieldProblem):  # a validator named the key itself
            errors.append(UserError(found.field, found.value, found.problem, found.fix))
            continue
        loc = tuple(str(p) for p in err["loc"])
        union = _union_key(loc)
        if union is not None:  # one message for the key, whichever members refused its value
            key, info = union
            if key not in unions:
                unions.add(key)
                expected = type_text(info.annotation, info.metadata).replace("`", "")
                errors.append(UserError(key, err.get("input"), f"Input should be {expected}", f"give {expected}"))
            continue
        msg = err["msg"].removeprefix("Value error, ")
        value = None if err["type"] == "missing" else err.get("input")  # its input is the section around it
        errors.append(UserError(".".join(loc) or "recipe", value, msg, _fix_for(err)))
    return UserErrors(source, errors)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load, merge, resolve and validate; every user mistake becomes a UserError/UserErrors."""
    path = Path(path)
    cfg = _apply_overrides(_load_yaml(path), overrides or [])
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise UserError(
            "recipe", str(path), f"interpolation failed: {str(exc).splitlines()[0]}", "point ${...} at an existing key"
        ) from None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise _to_user_errors(str(path), exc) from None
    from osdp_platform.runtime.data import check_vocab  # reads the tokenizer: only for a recipe that is valid so far

    check_vocab(recipe)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(recipe.model_dump(mode="json")))


def flatten(recipe: Recipe) -> dict[str, str]:
    """Dotted key -> value, for MLflow params (which are flat strings)."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)

    walk("", recipe.model_dump(mode="json"))
    return out
