"""`python -m vllm_piep.meter -- CMD ARGS`: the same CLI as `python -m vllm_piep.meters`."""

import sys

from vllm_piep.meters.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
