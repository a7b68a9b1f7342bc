"""Code the tests share that is not a fixture (fixtures live in the conftest files)."""
