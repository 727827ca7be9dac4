"""How the entry points end: their own teardown done, the interpreter's shutdown kept short.

At exit CPython runs its cycle collector over every object still alive. With torch loaded (and
torch._dynamo, which every optimizer imports) that is several hundred thousand objects: 0.6 s to 1 s per
process, measured here, after the process group, the loaders, the writers and the logs are already closed.
A job pays it in every rank, the pre-flight and each torchrun restart; a test suite of real launches pays
it hundreds of times. `gc.freeze()` takes those objects out of the collector's view. They are still freed
by reference counting as the interpreter clears its modules; only reference cycles still alive at exit
are left to the operating system, as CPython leaves them whenever it likes (it promises no finaliser at
shutdown). Nothing of ours relies on one: every file and writer is closed in a `finally`.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_with(code: int | None) -> NoReturn:
    """`sys.exit(code)` with the collector's work at shutdown skipped (see the module's docstring)."""
    gc.freeze()
    sys.exit(code)
