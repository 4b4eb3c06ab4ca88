"""The ``scd-store`` command line."""
