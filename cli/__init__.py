"""The composition root: the `quantgate` command (cli/main.py). The only package that imports every folder;
nothing imports it (tests/test_layout.py)."""
