"""`python -m polar_mitm.cli` is `polar-mitm`."""

import sys

from polar_mitm.cli import main

sys.exit(main())
