"""The `osdp-platform` command: validate, plan, submit and sweep recipes; compare runs; open MLflow's UI;
prepare token files.

User mistakes exit 2 with one message. Ray's own logs, the workers' output and torch's FutureWarnings
stay off the terminal unless --verbose.
"""

import argparse
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

from rich.console import Console

from osdp_planners.errors import UserError, UserErrors
from osdp_platform.driver.faults import one_line, root_cause
from osdp_platform.recipe.loader import load_recipe

EXIT_FAULT = 1  # a fault at run time (a worker crashed, a node went away), not a mistake in the recipe
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
FORMATS = ("table", "json", "markdown")
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"  # MLflow server's switch for its job runners


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osdp-platform", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        action="store_true",
        help="let Ray's logs, the workers' output and warnings through to the terminal",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("validate", "check a recipe and print it resolved; --explain: what every key means"),
        ("plan", "plan a recipe without training (no GPU, no Ray workers needed)"),
        ("submit", "plan and train a recipe on Ray, tracked in MLflow"),
        ("sweep", "plan every cell of a grid (key=a,b,...), train those that fit, compare them"),
    ):
        cmd = sub.add_parser(name, help=text, parents=[common])
        cmd.add_argument("recipe", nargs="?" if name == "validate" else None, help="recipe YAML file")
        cmd.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5")
    sub.choices["validate"].add_argument(
        "--explain",
        action="store_true",
        help="print every recipe key with its type, default and meaning (and, given a recipe, its value there)",
    )
    plan = sub.choices["plan"]
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")
    plan.add_argument(
        "--png", help="write the predicted memory timeline here (default: the --out file's name with .png, or none)"
    )
    plan.add_argument(
        "--track",
        action="store_true",
        help="also record the plan as an MLflow run (no training), to compare plans before spending GPU time",
    )
    for name in ("submit", "sweep"):
        sub.choices[name].add_argument(
            "--address",
            help="Ray cluster: http://HEAD:8265 runs the command as a job "
            "through the Jobs API (the current folder is shipped as "
            "its working directory), ray://HEAD:10001 connects as a "
            "Ray client, HOST:6379 joins from inside the cluster "
            "(default: $RAY_ADDRESS, else a local Ray)",
        )
    sub.choices["submit"].add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue from the last checkpoint of this earlier run (MLflow run "
        "id), as a new run; the plan, worker count and split factors may differ",
    )
    sub.choices["sweep"].add_argument("--format", choices=FORMATS, default="table", help="of the comparison")
    cmp = sub.add_parser(
        "compare", help="runs side by side: predicted and measured throughput and memory", parents=[common]
    )
    cmp.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="MLflow run ids (default: --experiment's runs)")
    cmp.add_argument("--experiment", help="compare every plan and train run of this MLflow experiment")
    cmp.add_argument("--format", choices=FORMATS, default="table")
    cmp.add_argument("--wide", action="store_true", help="one line a run and full run ids (default: fit the terminal)")
    cmp.add_argument("--log", action="store_true", help="also record the comparison (table, chart) as an MLflow run")
    ui = sub.add_parser("ui", help="open the MLflow UI on the tracking store", parents=[common])
    ui.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    ui.add_argument("--port", type=int, default=5000)
    for cmd in (cmp, ui):
        cmd.add_argument("--uri", help="tracking store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    sync = sub.add_parser(
        "sync", help="upload the MLflow writes a run kept locally while its server was away", parents=[common]
    )
    sync.add_argument("folder", help="the folder the run's warning named (mlflow-pending/<run id>)")
    prepare = sub.add_parser(
        "prepare", help="tokenize text files into token files (data.source: token_files)", parents=[common]
    )
    prepare.add_argument("files", nargs="+", help="text files, one token file each")
    prepare.add_argument("--out", required=True, help="folder for the token files and their tokens.json")
    prepare.add_argument("--tokenizer", default="bytes", help="bytes, bpe (shipped) or a tokenizers JSON file")
    return parser


def _store(uri: str | None) -> str:
    from osdp_platform.recipe.schema import TrackingSection

    return TrackingSection(uri=uri).resolved_uri


def _ui(uri: str, host: str, port: int, console: Console) -> int:
    if uri.startswith(("http://", "https://")):
        console.print(f"the tracking store is a server: open {uri}", markup=False)
        return 0
    console.print(f"MLflow UI on {uri}: http://{host}:{port} (Ctrl-C stops it)", markup=False)
    sys.stdout.flush()
    # Browsing runs needs none of MLflow's server-side jobs (GenAI evaluation, trace rollups): without this
    # the server starts seven job-runner processes, each loading MLflow (~15 CPU-s before the UI answers).
    env = {**os.environ, JOB_EXECUTION: os.environ.get(JOB_EXECUTION, "false")}
    os.execve(
        sys.executable,
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            uri,
            "--host",
            host,
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        env,
    )
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    from osdp_platform.planning.local import plan_recipe
    from osdp_platform.recipe.preflight import Where, preflight
    from osdp_platform.tracking.keys import RunKind
    from osdp_platform.tracking.report import log_report, plot, print_report
    from osdp_platform.tracking.runs import RunTracker, check_reachable

    recipe = load_recipe(args.recipe, args.overrides)
    preflight(recipe, Where.NOWHERE)
    if args.track:
        check_reachable(recipe.tracking.resolved_uri)
    result = plan_recipe(recipe)
    notes = Console(stderr=True) if args.json else console  # under --json stdout holds the plan alone, for a pipe
    if args.json:
        console.print(result.plan.to_json(), markup=False)
    if args.out:
        Path(args.out).write_text(result.plan.to_json())
        notes.print(f"plan written to {args.out}", markup=False)
    png = Path(args.png) if args.png else Path(args.out).with_suffix(".png") if args.out else None
    if not args.json:
        print_report(result, console, png)
    elif png is not None:
        notes.print(f"memory timeline written to {plot(result, png)}", markup=False)
    if args.track:
        tracker = RunTracker.start(recipe, RunKind.PLAN, result.plan)
        log_report(tracker, result)
        tracker.finish()
        notes.print(f"plan recorded as MLflow run {tracker.run_id}", markup=False)
    return 0


def _validate(args: argparse.Namespace, console: Console) -> int:
    from rich.markdown import Markdown

    from osdp_platform.recipe.docs import render_markdown
    from osdp_platform.recipe.loader import recipe_to_yaml
    from osdp_platform.recipe.preflight import Where, preflight
    from osdp_platform.tracking.runs import check_store

    if args.recipe is None:
        if not args.explain:
            raise UserError("recipe", None, "is missing", "pass a recipe YAML file (or --explain for every key)")
        console.print(Markdown(render_markdown()))
        return 0
    recipe = load_recipe(args.recipe, args.overrides)
    preflight(recipe, Where.NOWHERE)
    check_store(recipe.tracking.resolved_uri)
    if args.explain:
        console.print(Markdown(render_markdown(recipe.model_dump(mode="json"))))
    else:
        console.print(recipe_to_yaml(recipe), markup=False)
    console.print(f"[green]ok[/]: {args.recipe} is valid")
    return 0


def _prepare(args: argparse.Namespace, console: Console) -> int:
    from osdp_platform.runtime.data import TokenFiles

    prepared = TokenFiles.prepare([Path(f) for f in args.files], args.tokenizer, Path(args.out))
    console.print(
        f"{len(prepared.files)} token file(s) ({prepared.dtype}, vocab {prepared.vocab_size}, tokenizer "
        f"{prepared.tokenizer}) in {prepared.folder}: use data.source=token_files "
        f"data.path={prepared.folder}",
        markup=False,
    )
    return 0


def _as_job(args: argparse.Namespace, console: Console) -> int:
    """submit / sweep with a Jobs API address: the same command runs on the cluster as the job's driver."""
    from osdp_platform.driver.remote import submit_job
    from osdp_platform.recipe.preflight import Where, preflight

    if args.command == "sweep":
        name, options = Path(args.recipe).stem, ["--format", args.format]
    else:
        recipe = load_recipe(args.recipe, args.overrides)
        preflight(recipe, Where.CLUSTER)
        name, options = recipe.name, ["--resume", args.resume] if args.resume else []
    verbose = ["--verbose"] if args.verbose else []
    return submit_job(name, args.command, args.recipe, [*args.overrides, *options, *verbose], args.address, console)


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "prepare":
        return _prepare(args, console)
    if args.command == "compare":
        from osdp_platform.tracking.compare import compare

        compare(
            _store(args.uri),
            args.run_ids,
            args.experiment,
            args.format,
            console,
            record=args.log,
            wide=args.wide,
            uri_option="--uri",
        )
        return 0
    if args.command == "ui":
        return _ui(_store(args.uri), args.host, args.port, console)
    if args.command == "sync":
        from osdp_platform.driver.submit import warn_on
        from osdp_platform.tracking.runs import RunTracker

        done = RunTracker.sync(Path(args.folder), warn_on(console))
        console.print("uploaded" if done else "the server stopped answering; run sync again", markup=False)
        return 0 if done else 1
    if args.command == "validate":
        return _validate(args, console)
    if args.command == "plan":
        return _plan(args, console)
    if args.command in ("submit", "sweep"):
        from osdp_platform.driver.remote import is_jobs_api

        args.address = args.address or os.environ.get("RAY_ADDRESS")
        if args.address and is_jobs_api(args.address):
            return _as_job(args, console)
    if args.command == "sweep":
        from osdp_platform.driver.sweep import sweep

        sweep(args.recipe, args.overrides, args.address, console, args.format, args.verbose)
        return 0
    recipe = load_recipe(args.recipe, args.overrides)
    from osdp_platform.recipe.preflight import preflight, where_it_runs

    preflight(recipe, where_it_runs(args.address))  # before Ray and the training modules are even imported
    from osdp_platform.driver.submit import ray_logs_hint, submit
    from osdp_platform.tracking.runs import check_reachable

    check_reachable(recipe.tracking.resolved_uri)  # submit checks it too; a refused store is refused before the hint
    if not args.verbose:
        ray_logs_hint(console)
    submit(recipe, address=args.address, console=console, resume=args.resume, verbose=args.verbose)
    return 0


def _quiet() -> None:
    """Keep library chatter off the terminal, in this process and the ones it starts (planner probes, local Ray)."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # our own lines name the runs
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("default", category=FutureWarning, module="osdp_")  # the platform's own: a renamed key
    warnings.formatwarning = _one_line
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # retries of a server that went away: we warn once


def _one_line(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """A warning as the CLI's errors read (`warning: ...`), not Python's file, line and source."""
    return f"warning: {message}\n"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Arguments, with key=value overrides taken wherever they stand (`submit R --resume ID train.steps=5`);
    argparse alone reads positionals only before the first option."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not args.verbose:
        _quiet()
    console = Console(stderr=False, soft_wrap=False, width=max(Console().width, 110))
    errors = Console(stderr=True)
    try:
        return _run(args, console)
    except (UserError, UserErrors) as exc:
        errors.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        errors.print("interrupted", markup=False)
        return EXIT_INTERRUPTED
    except Exception as exc:
        cause = root_cause(exc)
        if isinstance(cause, (UserError, UserErrors)):
            errors.print(f"error: {cause}", markup=False, highlight=False, soft_wrap=True)
            return EXIT_USER_ERROR
        if args.verbose:
            traceback.print_exception(exc)
        hint = "" if args.verbose else "; --verbose shows the traceback, Ray's logs are in /tmp/ray/session_latest/logs"
        errors.print(f"error: {one_line(cause)}\n  ({args.command} failed{hint})", markup=False, highlight=False)
        return EXIT_FAULT


if __name__ == "__main__":
    sys.exit(main())
