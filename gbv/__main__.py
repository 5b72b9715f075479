import sys

from gbv.cli import main

sys.exit(main())
