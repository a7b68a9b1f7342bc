"""Run by the Python of ``hpcring run``'s CMD at start (rank_exec puts this folder,
``rank_life.SITE_DIR``, first on PYTHONPATH): a rank entry's hook. Hand an exception that ends it
to the rank's status record (:func:`hpcring.rank_life.record_uncaught`), register the ``hpcring``
torch.distributed backend once the script imports torch, as ``hpcring submit`` does
(:func:`hpcring.job.register_torch_backend_on_import`), watch the torch process group the script
may create (:func:`hpcring.diagnostics.torch_watch.install`), then run the ``sitecustomize`` this
file shadows, if any. A Python without hpcring just skips all that."""
import importlib.machinery
import importlib.util
import os
import sys

try:
    if os.environ.get("HPCRING_SESSION"):
        from hpcring.rank_life import record_uncaught
        record_uncaught()          # the rank's status record names the exception, as under submit
        from hpcring.job import register_torch_backend_on_import
        register_torch_backend_on_import()
        from hpcring.diagnostics import torch_watch
        torch_watch.install()
except ImportError:  # CMD's Python is not the one hpcring is installed in: nothing to watch with
    pass
except Exception as _e:  # noqa: BLE001 - never stop the user's program
    print(f"hpcring: torch hang watch not installed: {_e}", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


_chain()
