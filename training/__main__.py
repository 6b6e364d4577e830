"""``python -m training``: see training/cli/main.py."""

from training.cli.main import main

raise SystemExit(main())
