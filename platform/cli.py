"""The `osdp-platform` command: validate, plan and submit recipes, prepare token files. User mistakes exit 2."""

import argparse
import sys
from pathlib import Path

from rich.console import Console

from osdp_planners.errors import UserError, UserErrors
from osdp_platform.recipe_loader import load_recipe

EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osdp-platform", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("validate", "check a recipe and print it resolved"),
                       ("plan", "plan a recipe without training (no GPU, no Ray workers needed)"),
                       ("submit", "plan and train a recipe on Ray, tracked in MLflow")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("recipe", help="recipe YAML file")
        cmd.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5")
    sub.choices["plan"].add_argument("--out", help="write the plan JSON here (default: print it)")
    sub.choices["plan"].add_argument("--png", help="write the predicted memory timeline here (default: plan.png "
                                                   "beside --out, or none)")
    sub.choices["submit"].add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS or local)")
    prepare = sub.add_parser("prepare", help="tokenize text files into token files (data.source: token_files)")
    prepare.add_argument("files", nargs="+", help="text files, one token file each")
    prepare.add_argument("--out", required=True, help="folder for the token files and their tokens.json")
    prepare.add_argument("--tokenizer", default="bytes", help="bytes, bpe (shipped) or a tokenizers JSON file")
    sub.choices["submit"].add_argument("--resume", metavar="RUN_ID",
                                       help="continue from the last checkpoint of this earlier run (MLflow run "
                                            "id), as a new run; the plan, worker count and split factors may differ")
    return parser


def _prepare(args: argparse.Namespace, console: Console) -> int:
    from osdp_platform.data import TokenFiles

    prepared = TokenFiles.prepare([Path(f) for f in args.files], args.tokenizer, Path(args.out))
    console.print(f"{len(prepared.files)} token file(s) ({prepared.dtype}, vocab {prepared.vocab_size}, tokenizer "
                  f"{prepared.tokenizer}) in {prepared.folder}: use data.source=token_files "
                  f"data.path={prepared.folder}", markup=False)
    return 0


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "prepare":
        return _prepare(args, console)
    recipe = load_recipe(args.recipe, args.overrides)
    if args.command == "validate":
        from osdp_platform.recipe_loader import recipe_to_yaml

        console.print(recipe_to_yaml(recipe), markup=False)
        console.print(f"[green]ok[/]: {args.recipe} is valid")
        return 0
    if args.command == "plan":
        from osdp_platform.planning import plan_recipe
        from osdp_platform.report import print_report

        result = plan_recipe(recipe)
        if args.out:
            Path(args.out).write_text(result.plan.to_json())
            console.print(f"plan written to {args.out}", markup=False)
        else:
            console.print(result.plan.to_json(), markup=False)
        png = args.png or (str(Path(args.out).with_suffix(".png")) if args.out else None)
        print_report(result, console, Path(png) if png else None)
        return 0
    from osdp_platform.submit import submit

    submit(recipe, address=args.address, console=console, resume=args.resume)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=False, soft_wrap=False, width=max(Console().width, 110))
    try:
        return _run(args, console)
    except (UserError, UserErrors) as exc:
        Console(stderr=True).print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
