import sys

from rdakit.cli import main

sys.exit(main())
