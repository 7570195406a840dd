"""`python -m loopscale.cli ...` (and `torchrun ... -m loopscale.cli ...`): the `loopscale` command."""
import sys

from . import main

sys.exit(main())
