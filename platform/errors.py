"""User-facing errors: the CLI turns these into one message and exit code 2, never a traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad recipe, missing file, a pool the cluster lacks)."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        return f"{self.field} = {self.value!r}: {self.problem}\n  fix: {self.fix}"


class UserErrors(Exception):
    """Several user mistakes found at once (all of a recipe's validation errors)."""

    def __init__(self, source: str, errors: list[UserError]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.errors)} problem(s)"]
        lines += [f"- {e.render()}" for e in self.errors]
        return "\n".join(lines)
