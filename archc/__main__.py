"""`python -m archc`: the command line — how torchrun starts ranks
(`torchrun --nproc-per-node N -m archc run SOURCE --tp N`)."""

import sys

from archc.cli import main

sys.exit(main())
