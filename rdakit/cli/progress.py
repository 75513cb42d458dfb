"""The progress bar of the commands that take more than a few seconds: compiling (the event
model's count, the placement's annealing), running a job, benchmarks."""

import contextlib

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["progress_bar", "UNITS"]

#: What the counts of a stage are, by the last word of its name (the flows prefix stages with
#: the iteration: ``iteration 2/3: running``).
UNITS = {"running": "cycles (of the estimate)", "placing": "annealing steps",
         "counting events": "interpreter steps (of the budget)",
         "timing ops": "performance model steps (of the budget)"}


def _unit(stage):
    return next((unit for end, unit in UNITS.items() if stage.endswith(end)), "")


@contextlib.contextmanager
def progress_bar(enabled):
    """A rich progress bar fed by ``progress(stage, done=None, total=None)`` calls (a no-op when
    disabled or when the output is not a terminal)."""
    if not enabled:
        yield lambda stage, done=None, total=None: None
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
                   TimeElapsedColumn(), transient=True)
    task = bar.add_task("starting", total=None, unit="")

    def update(stage, done=None, total=None):
        if total is not None:
            bar.update(task, description=stage, completed=done, total=max(total, done or 0),
                       unit=_unit(stage))
        else:
            bar.update(task, description=stage, completed=0, total=None, unit="")

    with bar:
        yield update
