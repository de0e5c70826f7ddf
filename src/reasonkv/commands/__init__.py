"""Command-line commands (one module each: ``add_arguments`` + ``run``)."""
