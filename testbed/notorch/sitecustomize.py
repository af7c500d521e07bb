"""On PYTHONPATH, hides PyTorch from the process, as on a user's install (torch is only in Orchard's test extras):
transformers, imported by mlx-lm and lm-eval, then does not import it. tests/conftest.py puts this folder on the
PYTHONPATH of every process the tests start (Ray's workers, `driver` subprocesses, ring ranks)."""

import sys
from importlib.machinery import PathFinder


class NoTorch:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name == "torch" or name.startswith("torch.") else PathFinder.find_spec(name, path, target)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return PathFinder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [NoTorch if f is PathFinder else f for f in sys.meta_path]
