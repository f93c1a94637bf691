"""`python -m pipeblocks ...` is the `pipeblocks` command; under torchrun,
`torchrun --nproc-per-node 4 -m pipeblocks train ...` runs one rank per process."""
import sys

from .cli.main import main

sys.exit(main())
