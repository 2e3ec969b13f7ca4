"""gradindex: training-data attribution as vector search over compressed per-example gradients.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it (before
torch, FAISS or NumPy start their OpenMP thread pools): threads that spin while they wait made every
stage 2.5-5x slower on a shared machine (issue 33 item 10). Set the variable yourself to choose
another policy; it takes effect only where ``gradindex`` is imported before those libraries.
"""

import os as _os

_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
