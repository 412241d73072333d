"""`python -m vllm_piep.meter -- CMD ARGS`: the same CLI as `python -m vllm_piep.meters`, its
errors and usage named as typed here."""

import sys

from vllm_piep.meters.__main__ import main

PROG = "python -m vllm_piep.meter"

if __name__ == "__main__":
    sys.exit(main(prog=PROG))
