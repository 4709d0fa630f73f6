"""`python -m deterministic_inference` runs the `detinf` CLI."""

from deterministic_inference.cli.main import main

raise SystemExit(main())
