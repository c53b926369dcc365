"""The `pipette` command line."""
