"""`python -m gpu_check`: what scripts/gpu_check.sh and the checks' child processes run."""

import sys

from gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
