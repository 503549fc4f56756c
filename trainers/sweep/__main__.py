"""``python -m trainers.sweep``: only calls :func:`trainers.sweep.cli.main`.

Nothing is defined here: Tune pickles the trainable and the callbacks with the sweep, and
cloudpickle copies ``__main__``'s functions by value, defaults and all. A default ``print`` then
failed to pickle once Ray's driver had replaced print (tqdm_ray does, when its workers' first logs
arrive); the importable modules' functions are pickled by name.
"""

import sys

from trainers.sweep.cli import main

sys.exit(main())
