"""Pre-flight: the mistakes in a recipe, its files and its model's forward, found in the driver before Ray starts.

`validate`, `plan`, `submit` and `sweep` run it on every recipe they load. Found later, the same
mistake costs a Ray start, a planner actor and workers (10-60 s), leaves a FAILED MLflow run and a
`runs/` folder, and arrives as a worker's traceback. Each check raises one UserError naming the
key or file the user wrote and a fix; nothing here writes anything that stays.
"""

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

from torch import nn

from osdp_planners.errors import UserError
from osdp_planners.trace import check_forward
from osdp_platform.recipe.schema import HardwareSection, ModelSection, Recipe
from osdp_platform.runtime.data import CORPUS_PATH, TokenFiles, check_text, load_tokens
from osdp_platform.runtime.models import build_model

MAX_WORKERS_PER_CORE = 4  # a local CPU pool beyond this only thrashes (the benchmarks run 4 workers on 2 cores)
TEXT_CHECKED_BYTES = 8 << 20  # a longer text holds enough tokens for any seq_len a recipe would train


class Where(Enum):
    """Where the recipe will run, which decides what can be checked from here."""

    NOWHERE = "nowhere"  # validate, plan: nothing starts
    LOCAL = "local"  # a local Ray on this machine: it is the pool
    CLUSTER = "cluster"  # a Ray cluster: the cluster checks its own pool and storage


def preflight(recipe: Recipe, where: Where) -> None:
    """Every check that needs neither Ray nor a worker."""
    check_data(recipe)
    model = meta_model(recipe.model)
    _check_forward(recipe.model, model, recipe.data.seq_len, recipe.train.precision)
    check_plan_file(recipe, model)
    if where is not Where.CLUSTER:
        check_checkpoint_dir(recipe)
    if where is Where.LOCAL:
        check_local_pool(recipe.hardware)


def check_data(recipe: Recipe) -> None:
    """Token files whole and within the vocabulary; a text long enough for one sample."""
    data = recipe.data
    if data.source == "token_files":
        TokenFiles.read(str(data.path)).check(data.seq_len)
        return
    if data.source == "synthetic":
        return
    path = CORPUS_PATH if data.source == "corpus" else Path(str(data.path))
    check_text(path, "data.path")
    if path.stat().st_size > TEXT_CHECKED_BYTES:
        return
    tokens = len(load_tokens(data, recipe.train.seed).parts[0])
    if tokens < data.seq_len + 2:
        raise UserError(
            "data.seq_len",
            data.seq_len,
            f"{path} holds {tokens} tokens, fewer than seq_len + 2 = {data.seq_len + 2} (one sample and its target)",
            "lower data.seq_len or train on a longer text",
        )


def _model_field(section: ModelSection) -> tuple[str, object]:
    if section.target is not None:
        return "model.target", section.target
    if section.hf_config is not None:
        return "model.hf_config", section.hf_config
    return "model.kwargs", section.kwargs


class _Held(logging.Handler):
    """transformers' warnings while it builds the model: on a config it refuses, they name the fields."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _transformers_warnings_held() -> Iterator[_Held]:
    """transformers' own handlers are set aside while it builds the model, so that a refused config gets one
    message; a model that builds passes what was held on to them."""
    held = _Held()
    try:  # configures its handlers, which it would otherwise add on first use, beside ours
        from transformers.utils.logging import get_logger
    except ImportError:  # build_model says what to install
        yield held
        return
    logger = get_logger("transformers")
    own, logger.handlers = logger.handlers, [held]
    try:
        yield held
    finally:
        logger.handlers = own
    for record in held.records:
        logger.handle(record)


def meta_model(section: ModelSection) -> nn.Module:
    """The model with its parameters on meta: importable, constructible, a Module (no memory, any size)."""
    if section.hf_config is None:
        return _built(section, [])
    with _transformers_warnings_held() as held:
        return _built(section, held.records)


def _built(section: ModelSection, warnings: list[logging.LogRecord]) -> nn.Module:
    try:
        return build_model(section, device="meta")
    except UserError:
        raise
    except Exception as exc:
        raise _unbuildable(section, exc, [w.getMessage() for w in warnings]) from None


def _unbuildable(section: ModelSection, exc: Exception, warnings: list[str]) -> UserError:
    field, value = _model_field(section)
    text = " ".join([f"{type(exc).__name__}: {exc}", *(f"(transformers: {w})" for w in warnings)])
    problem = f"building the model on the meta device failed: {' '.join(text.split())[:600]}"
    if section.hf_config is not None:  # transformers refused the config, not a factory's code
        return UserError(field, value, problem, "make the config's fields agree with each other (see above)")
    fix = (
        "make the factory build the model on whatever device is current (meta when planning) from its "
        "keyword arguments alone; see the README's 'Your own model'"
    )
    return UserError(field, value, problem, fix)


def _check_forward(section: ModelSection, model: nn.Module, seq_len: int, precision: str) -> None:
    """The forward traced as training runs it; a transformers model that fails its own forward was
    built from a config whose fields disagree, so the config is named, not a module's code."""
    try:
        check_forward(model, seq_len, precision)
    except UserError as exc:
        if section.hf_config is None or exc.field != "model":
            raise
        raise UserError(
            "model.hf_config",
            section.hf_config,
            f"the model transformers builds from it fails its own forward in {exc.value!r}: {exc.problem}",
            "make the config's fields agree with each other (a rotary or head dimension against hidden_size "
            "/ num_attention_heads, say); if transformers trains this config as it is, report it to the "
            "platform's maintainers",
        ) from exc


def check_plan_file(recipe: Recipe, model: nn.Module) -> None:
    """A plan file is read by the manual planner only, and must be a plan for this model and pool."""
    planner = recipe.planner
    if planner.plan_file is None:
        return
    if planner.name != "manual":
        raise UserError(
            "planner.plan_file",
            planner.plan_file,
            f"is read only by the manual planner, and planner.name is {planner.name!r}: it would be ignored",
            "set planner.name=manual to train that plan, or remove planner.plan_file",
        )
    from osdp_planners.manual import read_plan_file  # the planner's modules load only for a plan file

    read_plan_file(planner.plan_file, model, recipe.hardware.world_size)


def check_checkpoint_dir(recipe: Recipe) -> None:
    """A local checkpoint folder can be made: its nearest existing ancestor takes a new folder."""
    root = recipe.train.storage_root
    if "://" in root:
        return
    ancestor = Path(root)
    while not ancestor.exists():
        ancestor = ancestor.parent
    given = recipe.train.checkpoint_dir or "runs (the default)"
    if not ancestor.is_dir():
        raise UserError(
            "train.checkpoint_dir", given, f"{ancestor} is a file, not a folder", "name a folder for checkpoints"
        )
    try:
        os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".osdp-preflight-"))
    except OSError as exc:
        raise UserError(
            "train.checkpoint_dir",
            given,
            f"no folder can be made in {ancestor} ({exc.strerror})",
            "name a writable folder (on a cluster: one every node shares), or a URI such as s3://bucket/runs",
        ) from None


def check_local_pool(hw: HardwareSection) -> None:
    """A local Ray is this one machine: its cores or GPUs must hold the pool (unless nodes are to come)."""
    if hw.autoscaling:
        return
    if hw.nodes > 1:
        raise UserError(
            "hardware.nodes",
            hw.nodes,
            f"a local Ray is one node: {hw.nodes} nodes x {hw.workers_per_node} workers would all run on this machine",
            "set hardware.nodes=1, or submit to a cluster with --address (or RAY_ADDRESS)",
        )
    if hw.accelerator == "gpu":
        import torch

        present = torch.cuda.device_count()
        if present < hw.world_size:
            raise UserError(
                "hardware.accelerator",
                "gpu",
                f"the pool needs {hw.world_size} GPUs ({hw.nodes} node(s) x {hw.workers_per_node}) but this "
                f"machine has {present}",
                "set hardware.accelerator=cpu hardware.preset=cpu, or submit to a GPU cluster with --address",
            )
        return
    cores = os.cpu_count() or 1
    if hw.world_size > MAX_WORKERS_PER_CORE * cores:
        raise UserError(
            "hardware.workers_per_node",
            hw.workers_per_node,
            f"{hw.world_size} CPU workers on this machine's {cores} cores is over {MAX_WORKERS_PER_CORE} per core: "
            "the planner's probes and the workers would only wait for each other",
            f"use at most {MAX_WORKERS_PER_CORE * cores} workers here, or submit to a cluster with --address",
        )


def where_it_runs(address: str | None) -> Where:
    """A submit or sweep runs on a local Ray unless an address (or RAY_ADDRESS) names a cluster."""
    return Where.CLUSTER if address or os.environ.get("RAY_ADDRESS") else Where.LOCAL
