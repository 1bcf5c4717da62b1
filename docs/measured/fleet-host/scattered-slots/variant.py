"""``edgespec`` with the KV cache's read as one of ``reads.READS`` (env VARIANT: old, gather,
copy), for before/after runs of a benchmark in one checkout. Run:
VARIANT=old python variant.py bench-burst --streams 16 --burst 64 --modes chunked ..."""
import os
import sys

import reads
from edgespec_cli.main import main

reads.use(os.environ["VARIANT"])
sys.exit(main(sys.argv[1:]))
