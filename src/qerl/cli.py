"""Project commands: Kedro's own ``run``, guarded so that a refusal (bad parameter, missing input,
corrupt file) prints one line naming the field and the fix instead of a traceback, an unknown
pipeline name is listed with the close ones, and SIGTERM stops a run as cleanly as Ctrl-C.
The traceback of a refusal goes to ``data/09_logs/last_error.log``; ``QERL_DEBUG=1`` prints it.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click
from kedro.framework.cli.project import run as kedro_run

from qerl.errors import QerlConfigError


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _user_error(err: BaseException) -> BaseException | None:
    """The refusal behind ``err`` (a QerlConfigError or Kedro's parameter validation), if any."""
    from kedro.validation import ParameterValidationError

    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (QerlConfigError, ParameterValidationError)):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _keep_traceback(err: BaseException) -> None:
    """Write the refusal's traceback to data/09_logs/last_error.log (when run in a project)."""
    import traceback

    from qerl.train.distributed import is_main

    if not Path("conf").is_dir() or not is_main():  # under torchrun only rank 0 writes
        return
    path = Path("data/09_logs/last_error.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(err)))


def check_pipeline_names(names: list[str]) -> None:
    """Refuse unknown pipeline names, listing the known ones and the close matches."""
    from kedro.framework.project import pipelines

    known = sorted(pipelines.keys())
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=2)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise QerlConfigError("--pipelines", f"no pipeline named {name!r}", f"{hint}the pipelines are {', '.join(known)}")


def _guarded(command: click.Command) -> click.Command:
    original = command.callback

    def callback(*args: Any, **kwargs: Any) -> Any:
        signal.signal(signal.SIGTERM, _sigterm)
        try:
            names = list(kwargs.get("pipelines") or []) + ([kwargs["pipeline"]] if kwargs.get("pipeline") else [])
            check_pipeline_names(names)
            return original(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: an MLflow run (if any) ends as KILLED, not FINISHED
            mlflow = sys.modules.get("mlflow")
            if mlflow is not None and mlflow.active_run() is not None:
                mlflow.end_run("KILLED")
            raise
        except Exception as err:  # noqa: BLE001 - refusals become one line, anything else re-raises
            refusal = _user_error(err)
            if refusal is None or os.environ.get("QERL_DEBUG"):
                raise
            click.secho(f"Error: {refusal}", fg="red", err=True)
            _keep_traceback(err)
            sys.exit(2)

    return click.Command(name=command.name, params=command.params, callback=callback, help=command.help,
                         short_help=command.short_help, context_settings=command.context_settings)


@click.group(name="qerl")
def cli() -> None:
    """Project commands of qerl."""


cli.add_command(_guarded(kedro_run))
