"""Builders shared by several test folders (import as `helpers.clusters`; pytest.ini puts tests/ on the path)."""
