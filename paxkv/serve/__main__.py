"""`python3 -m paxkv.serve MODEL [flags]`: the same as `paxkv serve MODEL [flags]`."""
import sys

from paxkv.serve.cli import main

sys.exit(main())
