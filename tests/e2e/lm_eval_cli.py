"""`python -m lm_eval` (the real CLI, its arguments as given) without the index of lm-eval's own ~14,000 task
YAMLs: tests/e2e/test_lm_eval.py's tasks come from --include_path alone, and parsing the built-in ones was two
thirds of each run's CPU (~25 s of 40). The CLI has no flag for it; TaskManager's include_defaults is it.

    python tests/e2e/lm_eval_cli.py --model hf --tasks ... --include_path DIR ...
"""
from __future__ import annotations

import functools

from lm_eval.__main__ import cli_evaluate
from lm_eval.tasks import TaskManager

TaskManager.__init__ = functools.partialmethod(TaskManager.__init__, include_defaults=False)

if __name__ == "__main__":
    cli_evaluate()
