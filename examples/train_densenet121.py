"""Train DenseNet-121 (nonlinear network) on synthetic images, with or without Dymem.

    python examples/train_densenet121.py                      # Dymem with the default policy
    python examples/train_densenet121.py --policy none        # without Dymem
    python examples/train_densenet121.py --compare --budget 512MiB   # both, fresh processes, memory table
"""
import sys

import common

if __name__ == "__main__":
    sys.exit(common.main("densenet121", __doc__.splitlines()[0], default_batch=16, default_image_size=64))
