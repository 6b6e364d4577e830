"""The ``python -m training`` command line: its verbs and their flags."""
