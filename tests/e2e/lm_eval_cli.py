"""`python -m lm_eval` (the real CLI, each run's arguments as given) for tests/e2e/test_lm_eval.py, with two
savings: several runs in one interpreter (their arguments separated by a lone `--and`: torch, transformers and
lm-eval imported once, ~8 s of CPU a run), and without the index of lm-eval's own ~14,000 task YAMLs (the test's
tasks come from --include_path alone; parsing the built-in ones was two thirds of a run's CPU, ~25 s of 40). The
CLI has no flag for the latter; TaskManager's include_defaults is it.

    python tests/e2e/lm_eval_cli.py --model hf --tasks ... --include_path DIR ... --and --model local-completions ...
"""
from __future__ import annotations

import functools
import sys

from lm_eval.__main__ import cli_evaluate
from lm_eval.tasks import TaskManager

SEPARATOR = "--and"


def runs(argv: list[str]) -> list[list[str]]:
    """argv split at each SEPARATOR: one argument list per run."""
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == SEPARATOR:
            out.append([])
        else:
            out[-1].append(arg)
    return out


def main(argv: list[str]) -> None:
    TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)
    for args in runs(argv):
        sys.argv = [sys.argv[0], *args]  # what the CLI parses
        cli_evaluate()


if __name__ == "__main__":
    main(sys.argv[1:])
