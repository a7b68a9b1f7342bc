"""Build hook for the compiled core in native/ (metadata lives in pyproject.toml)."""
from setuptools import setup

setup()
