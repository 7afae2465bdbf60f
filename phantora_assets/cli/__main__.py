"""``python -m phantora_assets.cli``: the same as the ``phantora-assets`` console script."""

from phantora_assets.cli import run

run()
