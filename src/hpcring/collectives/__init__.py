"""Collectives: the Communicator API and its backends (ring = compiled native/ library)."""
from hpcring.collectives.api import Communicator, Handle
from hpcring.collectives.backends import DTYPES, OPS, Backend

__all__ = ["Communicator", "Handle", "Backend", "DTYPES", "OPS"]
