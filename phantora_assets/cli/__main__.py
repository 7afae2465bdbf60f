"""``python -m phantora_assets.cli``: the same as the ``phantora-assets`` console script."""

import sys

from phantora_assets.cli import main

sys.exit(main())
