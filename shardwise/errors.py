"""Exception types. A ``UserError`` is bad input: the CLI prints its one sentence and exits 2.
A ``CheckFailed`` is a run that went through but disagrees with its reference: the CLI prints the
result it carries (``--json``), the sentence on stderr, and exits 1."""


class UserError(Exception):
    """Bad input from the user (model name, mesh, plan file, budget...). Message: one sentence."""


class UnsupportedGraph(UserError):
    """A graph a pass or planner cannot take (in-place ops, missing fake values...)."""


class CheckFailed(Exception):
    """``--check`` found the distributed result off the one-process reference by more than the
    tolerance. Message: one sentence; ``result``: the command's JSON result, still printed."""

    def __init__(self, message: str, result: dict) -> None:
        super().__init__(message)
        self.result = result


def first_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
