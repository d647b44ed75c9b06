"""What every recipe section shares: unknown keys refused, no boolean read as a number, and the error a
validator raises to name one key (see schema.py)."""

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from osdp_platform.recipe.typetext import takes_number, type_text


class FieldProblem(ValueError):
    """A validator's finding about one key, with its fix: the loader reports it as that key's error,
    not as the whole section's (pydantic names the section a model validator belongs to)."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.field, self.value, self.problem, self.fix = field, value, problem, fix


class Section(BaseModel):
    """A recipe section: unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """pydantic takes true as the int 1: `steps: true` would train one step instead of being refused."""
        field = cls.model_fields[str(info.field_name)]
        if isinstance(value, bool) and takes_number(field.annotation):
            raise PydanticCustomError(
                "number_type",
                "Input should be {expected}, not true or false",
                {"expected": type_text(field.annotation, field.metadata).replace("`", "")},
            )
        return value
