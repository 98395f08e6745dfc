"""verispec: LLM inference built around lossless speculative decoding.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` for the process unless the variable (or
``GOMP_SPINCOUNT``) is already set. It takes effect only if torch is not imported yet (the OpenMP
runtime reads it when torch loads it). Why: torch's own ops between the native kernels' calls run
OpenMP parallel regions, and by default the OpenMP worker then spins for a while on the second
core, where the kernels' own worker needs to run, and every decode step waits for it. The
passive policy made decode steps clearly faster (docs/kernels.md, Threads).
"""

import os as _os

# the variables set here, for the process only: another program started from it (llama.cpp in a
# benchmark) gets the environment without them (verispec.runtime.foreign_env)
OWN_ENVIRONMENT: frozenset[str] = frozenset()
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    OWN_ENVIRONMENT = frozenset({"OMP_WAIT_POLICY"})

__version__ = "0.1.0"
