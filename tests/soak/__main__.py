"""`python -m tests.soak` = scripts/soak."""
from tests.soak.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
