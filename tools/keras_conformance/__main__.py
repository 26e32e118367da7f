import sys

from tools.keras_conformance.run import main

sys.exit(main())
