"""``python -m inferscale_cli ...`` is the ``inferscale`` command."""

import sys

from inferscale_cli.main import main

sys.exit(main())
