"""ExaMLOps serving plane shared library."""
