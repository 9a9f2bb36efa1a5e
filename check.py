"""
check.py: the one command that runs every self-check this machine can (DESIGN.md "Self-checks",
docs/selfcheck.md) and prints the table: path | device | status | compared against | speed.

The modules that own accelerated paths register their checks with selfcheck.py when imported:
fp4.py (the GEMM backends, the kernels.cu families), attention.py (the Triton kernels), optim.py
(the fused AdamW kernel). This file imports them all and nothing imports it, so the command forms
no import circle (a `python -m fp4 check` would have fp4 import attention and optim, which import fp4).

$ python check.py       # the table, and results/<gpu>/check.json; exit status 1 if a path fell back
"""
import sys

import attention  # noqa: F401 (each import registers its module's checks)
import fp4  # noqa: F401
import optim  # noqa: F401
import selfcheck

if __name__ == "__main__":
    sys.exit(selfcheck.main(sys.argv[1:]))
