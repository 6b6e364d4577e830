"""``python -m training``: see training/cli.py."""

from training.cli import main

raise SystemExit(main())
