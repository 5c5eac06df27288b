"""``torchrun --nproc_per_node N -m headstart.train --config RECIPE.yaml``: the training command as a module
(the same as ``headstart train`` and ``torchrun scripts/train_eagle3.py``)."""

import sys

from headstart.scripts.command import entry_point
from headstart.scripts.train_eagle3 import main

if __name__ == "__main__":
    sys.exit(entry_point(main))
