"""The ``posttrain`` command line."""
