"""How the command line reads its arguments: the arguments and options several commands share, and
bad input as one line on stderr naming the value and what is accepted, exit code 2, before anything
runs; typer's own usage errors (an unknown command or option, a missing or malformed value) are made
to say it the same way."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Hydra overrides: short names (tp dp sp vp layers hidden heads kv_heads vocab seq micro_batch "
        "global_batch steps dtype precision), groups (model mode batch kind device db launcher, "
        "+preset, +fault) or any key of --cfg.",
        show_default=False,
    ),
]
Device = Annotated[
    str | None,
    typer.Option(help="Runs whose hardware holds this text, any case: a GPU or CPU model, e.g. H100."),
]
DbOption = Annotated[
    str | None,
    typer.Option(
        "--db", help="SQLAlchemy URL of the database, as `runs` and `report` take it (or db.url=URL)."
    ),
]
ShowCfg = Annotated[bool, typer.Option("--cfg", help="Print the resolved config of every run, then exit.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print each run as one JSON object on stdout.")]


class _OneLineUsage:
    """typer's own usage errors (an unknown command or option, a missing or malformed value, an extra
    argument) as one line naming the bad input and what is accepted, exit code 2, like tpbench's
    checks of the config, instead of a box of several lines. They are raised while a command parses
    its arguments, before anything runs. `tpbench` alone still prints the help."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if not args and ctx.command.no_args_is_help:  # the help, raised (click >= 8.2) or printed
            return super().parse_args(ctx, args)  # type: ignore[misc]
        with _in_one_line(ctx):
            return super().parse_args(ctx, args)  # type: ignore[misc]


class OneLineGroup(_OneLineUsage, TyperGroup):
    def resolve_command(
        self, ctx: typer.Context, args: list[str]
    ) -> tuple[str | None, TyperCommand | TyperGroup | None, list[str]]:
        with _in_one_line(ctx):  # an unknown command
            return super().resolve_command(ctx, args)


class OneLineCommand(_OneLineUsage, TyperCommand):
    pass


@contextmanager
def _in_one_line(ctx: typer.Context) -> Iterator[None]:
    """Public API only: typer names none of click's usage errors but BadParameter (typer < 0.29 raises
    the click package's, typer 0.29 its own copy, typer._click), so they are known by what click
    documents of them: exit code 2 and format_message(); NoSuchOption has `possibilities`,
    BadOptionUsage an `option_name`, BadParameter (and MissingParameter) the `param`."""
    try:
        yield
    except Exception as e:
        if getattr(e, "exit_code", None) != 2 or not hasattr(e, "format_message"):
            raise  # typer.Exit has no message: tpbench's own one-line errors, already said
        usage(_usage_error_line(e, ctx))


def _usage_error_line(e: Exception, ctx: typer.Context) -> str:
    """`tpbench report: Option '--format' requires an argument; accepted for --format: html, md, ...`."""
    command = ctx.command
    unknown_option = hasattr(e, "possibilities")  # NoSuchOption: its message without the guesses
    said = (e.message if unknown_option else e.format_message()).rstrip(".")  # type: ignore[attr-defined]
    params = command.get_params(ctx)
    param = e.param if isinstance(e, typer.BadParameter) else None
    if not unknown_option and hasattr(e, "option_name"):  # BadOptionUsage
        param = next((p for p in params if e.option_name in p.opts), None)
    if unknown_option and getattr(e, "option_name", "") in ("-m", "--multirun"):
        accepted = "Hydra's multirun is `tpbench sweep` here: comma-separated values (tpbench sweep tp=2,4)"
    elif unknown_option:
        names = [name for p in params if p.param_type_name == "option" for name in p.opts]
        accepted = "accepted options are " + ", ".join(names)
    elif param is not None and getattr(param, "is_flag", False):
        accepted = f"{param.opts[0]} is a flag: given alone, it takes no value"
    elif param is not None:
        accepted = f"accepted for {param.opts[0]}: {getattr(param, 'help', None) or param.type.name}"
    elif isinstance(command, TyperGroup):
        accepted = "accepted commands are " + ", ".join(command.list_commands(ctx))
    else:
        accepted = "usage: " + ctx.get_usage().removeprefix("Usage: ")
    return f"{ctx.command_path}: {said}; {accepted}"


def one_line(message: str) -> None:
    print(" ".join(message.split()), file=sys.stderr, flush=True)


def usage(message: str) -> NoReturn:
    one_line(message)
    raise typer.Exit(EXIT_USAGE)


def check_filters(**given: str | None) -> None:
    """--status, --kind, --mode: a value no run can have is a typo, refused rather than matching nothing."""
    from tpbench.config import CONF_DIR
    from tpbench.experiments import KINDS
    from tpbench.results import Status

    accepted = {
        "status": tuple(Status),
        "kind": KINDS,
        "mode": tuple(sorted(p.stem for p in (CONF_DIR / "mode").glob("*.yaml"))),
    }
    for flag, value in given.items():
        if value is not None and value not in accepted[flag]:
            usage(f"--{flag} {value}: accepted are {', '.join(accepted[flag])}")


def out_format(fmt: str | None, out_path: str | None, formats: tuple[str, ...], default: str) -> str:
    """The format a file is written in: --format if given, else --out's extension, else `default`. An
    extension that is no format, or that contradicts --format, is refused rather than written over
    (`--out block.png` once wrote SVG into it)."""
    from pathlib import PurePath

    suffix = PurePath(out_path).suffix.removeprefix(".").lower() if out_path else ""
    if fmt is not None and fmt not in formats:
        usage(f"--format {fmt}: accepted are {', '.join(formats)}")
    if suffix and suffix not in formats:
        accepted = ", .".join(formats)
        usage(f"--out {out_path}: the extension .{suffix} is no format written; accepted are .{accepted}")
    if fmt is not None and suffix and suffix != fmt:
        usage(f"--out {out_path} with --format {fmt}: the extension says {suffix}; make them agree")
    return fmt or suffix or default


def with_db(overrides: list[str] | None, db: str | None) -> list[str]:
    """`--db URL` on `run` and `sweep`, the spelling `runs` and `report` take, as the override db.url=URL."""
    overrides = list(overrides or [])
    if db is None:
        return overrides
    given = [o for o in overrides if o.partition("=")[0] in ("db.url", "+db.url")]
    if given:
        usage(f"--db {db} with {given[0]}: accepted is the database given once, either way")
    return [*overrides, f"db.url={db}"]
