"""Exception types. A ``UserError`` is bad input: the CLI prints its one sentence and exits 2."""


class UserError(Exception):
    """Bad input from the user (model name, mesh, plan file, budget...). Message: one sentence."""


class UnsupportedGraph(UserError):
    """A graph a pass or planner cannot take (in-place ops, missing fake values...)."""
