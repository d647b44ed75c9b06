"""What a recipe key takes, in words (`int > 0 or auto`): the reference's type column (docs.py) and the
loader's messages say it the same way, so an error names the type the README lists."""

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

# pydantic's constraint metadata (annotated-types objects): attribute -> comparison, read as `type > bound`
_LOWER = {"gt": ">", "ge": ">="}
_UPPER = {"lt": "<", "le": "<="}
_MIRROR = {">": "<", ">=": "<="}


def _bounded(name: str, metadata: Sequence[Any]) -> str:
    """`int > 0`, `0 <= float < 0.5`."""

    def found(signs: dict[str, str]) -> tuple[str, Any] | None:
        return next(
            (
                (sign, getattr(m, attr))
                for m in metadata
                for attr, sign in signs.items()
                if getattr(m, attr, None) is not None
            ),
            None,
        )

    lower, upper = found(_LOWER), found(_UPPER)
    if lower and upper:
        return f"{lower[1]} {_MIRROR[lower[0]]} {name} {upper[0]} {upper[1]}"
    bound = lower or upper
    return f"{name} {bound[0]} {bound[1]}" if bound else name


def type_text(annotation: Any, metadata: Sequence[Any] = ()) -> str:
    """`int > 0 or null`, `mapping or str`, `` `fp32` or `bf16-mixed` ``: what YAML value a key takes."""
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *meta = get_args(annotation)
        return type_text(base, meta)
    if origin in (Union, types.UnionType):  # a field's own bounds (Field(gt=0)) hold for each member
        return " or ".join(type_text(arg, metadata) for arg in get_args(annotation))
    if origin is Literal:
        return " or ".join(f"`{value}`" for value in get_args(annotation))
    if annotation is type(None):
        return "null"
    return _bounded("mapping" if origin is dict else getattr(annotation, "__name__", str(annotation)), metadata)


def takes_number(annotation: Any) -> bool:
    """Whether a key takes an int or a float (alone or in a union), and not a bool: pydantic would read
    YAML's true as the number 1."""
    if annotation in (int, float):
        return True
    args = get_args(annotation)
    return bool not in args and get_origin(annotation) is not Literal and any(takes_number(a) for a in args)
