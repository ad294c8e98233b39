"""``python -m deploy``: the launcher (:func:`deploy.launch.main`), a supervised ``tritonserver`` in the foreground."""

import sys

from deploy.launch import main

sys.exit(main())
