"""One lock for constructing torch modules in a process where stages are built.

While a stage's model is built, accelerate's init_empty_weights (engine/model/stage.py)
patches torch's module constructors process-wide, not per thread. Anything that
constructs modules meanwhile on another thread would get parameters on the meta device:
another stage, spare layers loading beside a serving slice, the int8 kernel check, or a
test's tiny model (CI: a tiny model built while an earlier test's pipeline loaded its
spares could not be saved, "Cannot copy out of meta tensor"). So each of them holds it.
"""

from __future__ import annotations

import threading

# reentrant: a check that builds a module may run inside a build that holds it
BUILD_LOCK = threading.RLock()
