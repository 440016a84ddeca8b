import sys

from furlong.cli.main import main

sys.exit(main())
