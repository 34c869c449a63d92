"""How a `loom` command ends when something goes wrong: the problem on stderr, one `field: message` line each,
and a status a script can tell apart: 2 for input to fix (a bad file, a field the API refused), 1 otherwise."""

import functools

import typer

from trainer.config import ConfigError

from .client import ApiError, LoomError
from .credentials import NotLoggedIn
from .documents import DocumentError

SUCCEEDED = 0
FAILED = 1
BAD_INPUT = 2
CANCELLED = 3
# `loom run watch` ends with the run's outcome.
OUTCOMES = {"succeeded": SUCCEEDED, "failed": FAILED, "cancelled": CANCELLED}


def reports_errors(command):
    @functools.wraps(command)
    def guarded(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except ApiError as error:
            _print_fields(error.errors)
            raise typer.Exit(BAD_INPUT if error.bad_input else FAILED) from None
        except ConfigError as error:
            _print_fields(error.errors)
            raise typer.Exit(BAD_INPUT) from None
        except DocumentError as error:
            typer.echo(str(error), err=True)
            raise typer.Exit(BAD_INPUT) from None
        except (LoomError, NotLoggedIn) as error:
            typer.echo(str(error), err=True)
            raise typer.Exit(FAILED) from None

    return guarded


def _print_fields(errors: dict[str, str]) -> None:
    for field, message in errors.items():
        typer.echo(f"{field}: {message}", err=True)
