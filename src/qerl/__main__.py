"""``qerl`` / ``python -m qerl``: the full Kedro CLI of this project (``qerl run``, ``qerl registry
list``, ``qerl catalog ...``, ``qerl viz ...`` with the viz extra), run from the project directory."""

from __future__ import annotations


def main() -> None:
    """Entry point: exactly ``kedro`` (the project's own commands in ``qerl.cli`` included)."""
    from kedro.framework.cli import main as kedro_main

    kedro_main()


if __name__ == "__main__":
    main()
