"""Train ResNet-50 (nonlinear network) on synthetic images, with or without Dymem.

    python examples/train_resnet50.py                      # Dymem with the default policy
    python examples/train_resnet50.py --policy none        # without Dymem
    python examples/train_resnet50.py --compare --budget 512MiB   # both, fresh processes, memory table
"""
import sys

import common

if __name__ == "__main__":
    sys.exit(common.main("resnet50", __doc__.splitlines()[0], default_batch=32, default_image_size=64))
