"""`python -m deterministic_inference.cli <command>` runs the `detinf` CLI."""

from deterministic_inference.cli.main import main

raise SystemExit(main())
