"""``python -m hpcring.bootstrap.store_server``: the child of StoreServerProcess (process.py)."""
from hpcring.bootstrap.store_server.process import _serve_child

if __name__ == "__main__":
    _serve_child()
