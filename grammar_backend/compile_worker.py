"""Entry point of a compile worker process: ``python -m grammar_backend.compile_worker``.

Started only by :class:`grammar_backend.workers.CompileWorkers`; see that module.
"""

import sys

from grammar_backend.workers import main

if __name__ == "__main__":
    sys.exit(main())
