"""Entry point of a compile worker process: ``python -m grammar_service.compile_worker``.

Started only by :class:`grammar_service.workers.CompileWorkers`; see that module.
"""

import sys

from grammar_service.workers import main

if __name__ == "__main__":
    sys.exit(main())
