"""`python -m pipeblocks ...` is the `pipeblocks` command; under torchrun,
`torchrun --nproc-per-node 4 -m pipeblocks train ...` runs one rank per process."""
import os
import sys

from .cli.main import main

code = main()
if "LOCAL_RANK" in os.environ and "RANK" in os.environ:
    # a torchrun worker: its result is written; the interpreter's teardown with torch and its
    # communication threads loaded can abort ("terminate called without an active exception")
    # and serves nobody, as for the ranks `spawn` starts
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
