"""An option is the planner's view of a UnitPlan: the plan carries every choice, and reads back as the option."""

from dataclasses import fields

from osdp_planners.options import Option, unit_options
from osdp_planners.plan import UnitPlan

# what a UnitPlan says about its unit rather than about the planner's choice for it
UNIT_OWN = {"name", "modules", "param_count", "predicted_memory_bytes", "predicted_time_s"}


def test_a_unit_plan_is_an_option_and_the_unit_it_is_for() -> None:
    choices = {f.name for f in fields(Option)}
    assert choices.isdisjoint(UNIT_OWN)
    assert set(UnitPlan.model_fields) == choices | UNIT_OWN


def test_every_option_reads_back_from_the_plan_it_is_written_to() -> None:
    options = unit_options(8, 4, 2, splittable=True, checkpointable=True)
    assert len(set(options)) == len(options) > 1
    for opt in options:
        unit = UnitPlan(name="blocks.0", modules=["blocks.0"], param_count=10, **opt.unit_fields())
        assert Option.of(unit) == opt
