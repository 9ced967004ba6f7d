"""`python -m cegppo_utils.runfolder export CHECKPOINT OUT` and `cache [--clear]` (export.py)."""

import sys

from cegppo_utils.data import UserError
from cegppo_utils.runfolder.export import main
from cegppo_utils.runfolder.process import one_line

try:
    main()
except UserError as e:  # a SystemExit whose code is 2: uncaught, Python would print nothing
    sys.stderr.write(f"runfolder.py: error: {one_line(e)}\n")  # one line: a newline in a path escaped, a long one cut
    sys.exit(2)
except KeyboardInterrupt:
    sys.exit("runfolder.py: interrupted; nothing was written (a partial export is removed)")
