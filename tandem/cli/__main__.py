"""`python -m tandem.cli`."""
import sys

from tandem.cli import main

sys.exit(main())
