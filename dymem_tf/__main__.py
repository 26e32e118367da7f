"""``python -m dymem_tf``: the command line (:mod:`dymem_tf.cli`)."""
import sys

from dymem_tf.cli import main

if __name__ == "__main__":
    sys.exit(main())
