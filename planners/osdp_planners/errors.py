"""The one user-facing error: what is wrong (field, value, problem) and how to fix it.

Raised by recipe validation, the planner and the platform alike; the CLI prints it as one message
and exits 2. Its constructor arguments are its `args`, so it survives pickling: an error raised in
the planner actor or a Ray Train worker reaches the driver as the same type with the same message.
"""


class UserError(Exception):
    """A mistake the user can fix (bad recipe, missing file, a budget no plan fits, a pool the cluster lacks)."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(field, value, problem, fix)
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.problem}\n  fix: {self.fix}"


class NoPlanFits(UserError):
    """No plan of the planner fits the budget; `advised_gb` is the least budget one of its plans fits.

    A type of its own, so that callers (a sweep, an elastic restart) ask what happened instead of
    comparing field names.
    """

    def __init__(self, field: str, value: object, problem: str, fix: str, advised_gb: float) -> None:
        super().__init__(field, value, problem, fix)
        self.args = (field, value, problem, fix, advised_gb)
        self.advised_gb = advised_gb


class UserErrors(Exception):
    """Several user mistakes found at once (all of a recipe's validation errors)."""

    def __init__(self, source: str, errors: list[UserError]) -> None:
        super().__init__(source, errors)
        self.source = source
        self.errors = errors

    def __str__(self) -> str:
        lines = [f"{self.source}: {len(self.errors)} problem(s)"]
        lines += [f"- {e}" for e in self.errors]
        return "\n".join(lines)
