import os
import sys

# Tests import tests/dist_utils.py as a top-level module; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
