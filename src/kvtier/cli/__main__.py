"""`python -m kvtier.cli`: the `kvtier` command (what the tests run as a user would)."""

from kvtier.cli import main

raise SystemExit(main())
