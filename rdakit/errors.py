"""Errors every layer may raise for the command line to print."""

__all__ = ["UserError"]


class UserError(Exception):
    """An error in what the user asked for (parameters, files): printed without a traceback.

    Commands wrap the ``TypeError``/``ValueError`` of parameter validation in it, so that the
    message (which names the parameter) is what the user sees.
    """
